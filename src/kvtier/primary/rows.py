"""Whole chunk rows copied between the primary tier's slots and a caller's rows.

One call copies every row of a load or a store, so the interpreter lock is
given up once: a loop would give it up at each row and, beside a thread
running Python (an engine's, or the tier's workers), wait a switch interval
(5 ms) to get it back each time. Compiled (``_native/_slots.c``) where kvtier
was built with a C compiler, which also streams a copy of more than 4 MiB
past the caches (1.6-1.9x a plain copy's speed where measured); else numpy,
with the same results and errors of the same kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

#: ``copy_rows(target, target_rows, source, source_rows)``: row
#: ``target_rows[i]`` of ``target`` becomes row ``source_rows[i]`` of
#: ``source``, for every ``i``. Both are C-contiguous two-dimensional arrays
#: with rows of the same length, which do not overlap.
RowCopy = Callable[[np.ndarray, Sequence[int], np.ndarray, Sequence[int]], None]


def _in_range(rows: Sequence[int], count: int, which: str) -> None:
    if len(rows) and (min(rows) < 0 or max(rows) >= count):
        raise IndexError(f"{which} rows {min(rows)}..{max(rows)} out of range for {count} rows")


def _copy_rows(
    target: np.ndarray, target_rows: Sequence[int], source: np.ndarray, source_rows: Sequence[int]
) -> None:
    if len(target_rows) != len(source_rows):
        raise ValueError(f"{len(target_rows)} target rows but {len(source_rows)} source rows")
    _in_range(target_rows, len(target), "target")
    _in_range(source_rows, len(source), "source")
    if isinstance(target_rows, range) and target_rows.step == 1:  # a load: a gather
        # "clip": numpy writes into ``out`` directly (the rows are in range).
        out = target[target_rows.start : target_rows.stop]
        np.take(source, source_rows, axis=0, out=out, mode="clip")
        return
    into = list(target_rows)  # a tuple would index dimensions, not rows
    if isinstance(source_rows, range) and source_rows.step == 1:  # a store: a scatter
        target[into] = source[source_rows.start : source_rows.stop]  # from a view
    else:
        target[into] = source[list(source_rows)]


#: Every implementation present, by name.
IMPLEMENTATIONS: dict[str, RowCopy] = {"python": _copy_rows}
try:
    from kvtier.primary._native import _slots
except ImportError:  # built without a C compiler
    IMPLEMENTATION = "python"
else:
    IMPLEMENTATIONS["compiled"] = _slots.copy_rows
    IMPLEMENTATION = "compiled"

#: The implementation the primary tier runs.
copy_rows = IMPLEMENTATIONS[IMPLEMENTATION]
