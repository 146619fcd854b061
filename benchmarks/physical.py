"""How physically contiguous a buffer is: the DMA segments a direct-I/O request needs.

Direct I/O moves each physically contiguous run of a buffer's pages as one DMA
segment. On a virtual disk every segment can cost the host a separate
operation, so the same tier moving the same bytes can run at half speed from
a buffer whose 2 MiB slots are 80 pieces each instead of one. The benchmarks
print this figure next to their results so that comparisons are made on
buffers of the same quality.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096
_PFN_MASK = np.uint64((1 << 55) - 1)


def segments_per_slot(array: np.ndarray, slot_bytes: int) -> float | None:
    """Mean count of physically contiguous runs per slot of ``array`` (a
    C-contiguous, page-aligned buffer), or ``None`` where page frame numbers
    cannot be read (they need root: ``/proc/self/pagemap``)."""
    pages = array.nbytes // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(array.ctypes.data // PAGE * 8)
            entries = np.frombuffer(pagemap.read(pages * 8), dtype=np.uint64)
    except OSError:
        return None
    frames = (entries & _PFN_MASK).astype(np.int64)
    if not frames.any():
        return None  # unprivileged readers see zeros
    per_slot = frames.reshape(-1, slot_bytes // PAGE)
    runs = (np.diff(per_slot, axis=1) != 1).sum(axis=1) + 1
    return round(float(runs.mean()), 1)
