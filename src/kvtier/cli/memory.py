"""How much memory a command may still take, so that ``check`` and ``bench``
refuse sizes that would not fit before they allocate or start a tier."""

from __future__ import annotations

import os
from pathlib import Path

import click

from kvtier.units import format_bytes

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> tuple[int, str] | None:
    """Bytes this process may still allocate without swapping, and where that
    was read; ``None`` when the system does not say.

    The kernel's ``MemAvailable`` (what can be had without swapping), lowered
    to what the process's cgroup (v2) still allows under a container's limit.
    """
    found: list[tuple[int, str]] = []
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                found.append((int(value.split()[0]) * 1024, f"MemAvailable in {meminfo}"))
                break
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            found.append((pages, "free physical pages (sysconf)"))
        except (ValueError, OSError, AttributeError):
            pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            found.append((max(0, int(limit) - used), f"the cgroup limit in {cgroup}/memory.max"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def refuse_beyond_memory(
    needed: int,
    chunks: int,
    chunk_kib: int,
    why: str,
    available: tuple[int, str] | None = None,
) -> None:
    """Exit 2 (a usage error) when ``needed`` bytes for ``--chunks`` ×
    ``--chunk-kib`` exceed the memory available; ``why`` says what holds them.
    Does nothing when the system does not say how much is available."""
    available = available if available is not None else available_memory()
    if available is None or needed <= available[0]:
        return
    free, source = available
    raise click.UsageError(
        f"--chunks {chunks} × --chunk-kib {chunk_kib} needs {format_bytes(needed)} of memory "
        f"({why}), more than the {format_bytes(free)} available ({source}); "
        "lower --chunks or --chunk-kib"
    )
