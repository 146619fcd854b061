"""How much memory a command may still take, so that ``check`` and ``bench``
refuse sizes that would not fit before they allocate or start a tier."""

from __future__ import annotations

import click

from kvtier.machine import available_memory
from kvtier.units import format_bytes


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
