"""Byte counts for people to read."""

from __future__ import annotations


def format_bytes(count: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB, TiB at most."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
