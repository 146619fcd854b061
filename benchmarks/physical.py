"""The physical side of a storage benchmark: a buffer's DMA segments, a cold page cache.

Direct I/O moves each physically contiguous run of a buffer's pages as one DMA
segment. On a virtual disk every segment can cost the host a separate
operation, so the same tier moving the same bytes can run at half speed from
a buffer whose 2 MiB slots are 80 pieces each instead of one. The benchmarks
print this figure next to their results so that comparisons are made on
buffers of the same quality.
"""

from __future__ import annotations

import os

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


def drop_caches(root: str | os.PathLike[str]) -> str:
    """Write back and evict ``root``'s files from the page cache; the method
    used (``drop_caches`` needs root, else ``posix_fadvise`` per file)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return "drop_caches"
    except OSError:
        for directory, _, files in os.walk(root):
            for name in files:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        return "fadvise"
