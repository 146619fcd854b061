"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues, scan-resistant."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy, unprotected

#: Frequencies saturate here (two bits), so a hot key earns at most three reprieves.
MAX_FREQ = 3
#: No key: what a search that found none returns.
_NONE = object()


class S3FIFOCachePolicy(CachePolicy):
    """A small probationary FIFO, a main FIFO and a ghost FIFO of evicted keys.

    New keys enter the small queue (about a tenth of the capacity). Most keys
    are used once, so most leave from there without ever disturbing the main
    queue: a long scan of one-time keys cannot flush the working set. A key
    accessed while in the small queue moves to the main queue; a key in the
    ghost queue is re-inserted straight into main. Main is a FIFO with lazy
    promotion: a key with frequency left is re-queued with one less.
    """

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.small_capacity = max(1, capacity // 10)
        # Queues are ordered oldest first; values unused.
        self._small: OrderedDict[ChunkKey, None] = OrderedDict()
        self._main: OrderedDict[ChunkKey, None] = OrderedDict()
        self._ghost: OrderedDict[ChunkKey, None] = OrderedDict()
        # Resident keys and their access counts since entering (or last re-queue).
        self._freq: dict[ChunkKey, int] = {}

    def get(self, key: ChunkKey) -> bool:
        freq = self._freq.get(key)
        if freq is None:
            return False
        if freq < MAX_FREQ:
            self._freq[key] = freq + 1
        return True

    def insert(self, key: ChunkKey) -> None:
        if self.get(key):
            return
        if key in self._ghost:
            # Seen recently enough to be remembered: it has proven reuse.
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        # insert inlined for the primary tier's batches: the common case is a
        # key neither resident nor remembered, which enters the small queue.
        freq, ghost, small = self._freq, self._ghost, self._small
        for key in keys:
            if key in freq or key in ghost:
                self.insert(key)
            else:
                small[key] = None
                freq[key] = 0

    def remove(self, key: ChunkKey) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        # ``get`` inlined: the primary tier touches every hit of every request.
        counts = self._freq
        for key in keys:
            freq = counts.get(key)
            if freq is not None and freq < MAX_FREQ:
                counts[key] = freq + 1

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        # Eviction below promotes and re-queues keys as it goes, so decide
        # first whether it can succeed: it can exactly when n keys are
        # unprotected. Stops at the n-th, so it costs about n, not |protected|.
        evictable = unprotected(itertools.chain(self._small, self._main), protected)
        if next(itertools.islice(evictable, n - 1, None), _NONE) is _NONE:
            return None
        # Protected keys met at a queue's head are set aside and put back in
        # front when done: the order S3-FIFO leaves them in (every key behind
        # them moved or went), and each is looked at once, not once per victim.
        held_small: list[ChunkKey] = []
        held_main: list[ChunkKey] = []
        victims = []
        try:
            for _ in range(n):
                if len(self._small) + len(held_small) >= self.small_capacity:
                    victim = self._evict_small(protected, held_small) or self._evict_main(
                        protected, held_main
                    )
                else:
                    victim = self._evict_main(protected, held_main) or self._evict_small(
                        protected, held_small
                    )
                # Unreachable by the count above; a loud failure beats a wrong victim.
                if victim is None:
                    raise RuntimeError("S3-FIFO found no victim although enough keys are evictable")
                del self._freq[victim]
                victims.append(victim)
        finally:
            _put_back(self._small, held_small)
            _put_back(self._main, held_main)
        return victims

    def _evict_small(
        self, protected: Collection[ChunkKey], held: list[ChunkKey]
    ) -> ChunkKey | None:
        """Drop the oldest unaccessed small key, promoting accessed ones on the way.

        Ends because every step removes a key from the small queue.
        """
        small = self._small
        while small:
            key = next(iter(small))
            del small[key]
            if key in protected:
                held.append(key)
                continue
            if self._freq[key] > 0:
                self._main[key] = None
                continue
            self._ghost[key] = None
            # The ghost remembers about as many keys as the cache holds.
            if len(self._ghost) > self.capacity:
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self, protected: Collection[ChunkKey], held: list[ChunkKey]) -> ChunkKey | None:
        """Drop the oldest main key with no frequency left, re-queueing the others.

        Ends because every re-queue spends one unit of a bounded frequency.
        """
        main, freqs = self._main, self._freq
        while main:
            key = next(iter(main))
            if key in protected:
                del main[key]
                held.append(key)
                continue
            freq = freqs[key]
            if freq > 0:
                freqs[key] = freq - 1
                main.move_to_end(key)
                continue
            del main[key]
            return key
        return None

    def clear(self) -> None:
        for queue in (self._small, self._main, self._ghost):
            queue.clear()
        self._freq.clear()

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


def _put_back(queue: OrderedDict[ChunkKey, None], held: list[ChunkKey]) -> None:
    """Return ``held`` keys to the head of ``queue``, in their order."""
    for key in reversed(held):
        queue[key] = None
        queue.move_to_end(key, last=False)
