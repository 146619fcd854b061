"""The ``fs`` tier's in-memory index: which chunks are on disk, in LRU order,
and how many bytes they (and the writes in flight) take."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class ChunkIndex:
    """Keys to file sizes, least recently used first, bounded by ``max_bytes``.

    A write first :meth:`reserve`\\ s its bytes (evicting as needed), so the
    files on disk plus the writes in flight never exceed the bound; it then
    :meth:`commit`\\ s or :meth:`release`\\ s the reservation. Methods that
    evict return the victims; the caller deletes their files.
    """

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._held = 0
        self._reserved = 0
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def held_bytes(self) -> int:
        """Bytes of indexed chunk files."""
        return self._held

    @property
    def used_bytes(self) -> int:
        """Bytes of indexed chunk files plus writes in flight."""
        return self._held + self._reserved

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)

    def remove(self, key: bytes) -> bool:
        """Forget ``key``; whether it was indexed."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self._held -= size
            return True

    def reserve(self, size: int) -> tuple[bool, list[bytes]]:
        """Make room for a write of ``size`` bytes: whether it fits, and the
        keys evicted trying (their files must go either way).

        It does not fit when writes already in flight fill ``max_bytes``.
        """
        with self._lock:
            self._reserved += size
            victims = self._evict_locked()
            if self.max_bytes is not None and self._held + self._reserved > self.max_bytes:
                self._reserved -= size
                return False, victims
            return True, victims

    def release(self, size: int) -> None:
        """Give back a reservation whose write failed."""
        with self._lock:
            self._reserved -= size

    def commit(self, key: bytes, size: int, reserved: int) -> None:
        """Index a written chunk as most recently used, ending its reservation."""
        with self._lock:
            self._reserved -= reserved
            self._held += size - self._sizes.pop(key, 0)
            self._sizes[key] = size

    def adopt(self, key: bytes, size: int) -> list[bytes]:
        """Index a chunk found on disk (stored by another process) as most
        recently used; returns the keys evicted to stay within the bound."""
        with self._lock:
            self._held += size - self._sizes.pop(key, 0)
            self._sizes[key] = size
            return self._evict_locked(protect=key)

    def merge_scan(self, found: Iterable[tuple[bytes, int]]) -> list[bytes]:
        """Add chunks from a directory scan (oldest first) *behind* every chunk
        indexed meanwhile, which are newer; returns the keys evicted."""
        with self._lock:
            merged: OrderedDict[bytes, int] = OrderedDict()
            for key, size in found:
                if key not in self._sizes:
                    merged[key] = size
                    self._held += size
            merged.update(self._sizes)
            self._sizes = merged
            return self._evict_locked()

    def _evict_locked(self, protect: bytes | None = None) -> list[bytes]:
        victims: list[bytes] = []
        if self.max_bytes is None:
            return victims
        while self._held + self._reserved > self.max_bytes and self._sizes:
            key, size = next(iter(self._sizes.items()))
            if key == protect:
                if len(self._sizes) == 1:
                    break
                self._sizes.move_to_end(key)
                continue
            del self._sizes[key]
            self._held -= size
            victims.append(key)
        return victims
