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
        # key neither resident nor remembered, which enters the small queue,
        # then one the ghost remembers, which enters the main queue.
        freq, ghost, small, main = self._freq, self._ghost, self._small, self._main
        for key in keys:
            if key in freq:
                self.insert(key)  # a hit: never from the primary tier
                continue
            if key in ghost:  # a chunk evicted not long ago, stored again
                del ghost[key]
                main[key] = None
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
        # Skipped when there are enough keys even if every protected one is
        # resident: the primary tier's case, whose pins are few.
        if len(self._freq) - len(protected) < n:
            evictable = unprotected(itertools.chain(self._small, self._main), protected)
            if next(itertools.islice(evictable, n - 1, None), _NONE) is _NONE:
                return None
        # Protected keys met at a queue's head are set aside and put back in
        # front when done: the order S3-FIFO leaves them in (every key behind
        # them moved or went), and each is looked at once, not once per victim.
        # Each helper takes victims until it has enough or it is no longer its
        # queue's turn, so a run of victims from one queue costs one call.
        held_small: list[ChunkKey] = []
        held_main: list[ChunkKey] = []
        victims: list[ChunkKey] = []
        small, small_capacity = self._small, self.small_capacity
        try:
            while len(victims) < n:
                if len(small) + len(held_small) >= small_capacity:
                    found = self._evict_small(protected, held_small, victims, n) or (
                        self._evict_main(protected, held_main, victims, len(victims) + 1)
                    )
                else:
                    found = self._evict_main(protected, held_main, victims, n) or (
                        self._evict_small(protected, held_small, victims, len(victims) + 1)
                    )
                # A fallback to the small queue may promote all of it into an
                # emptied main queue and find no victim: main's turn comes next.
                # Both queues empty is unreachable by the count above; a loud
                # failure beats a wrong victim.
                if not found and not small and not self._main:
                    raise RuntimeError("S3-FIFO found no victim although enough keys are evictable")
        finally:
            if held_small:
                _put_back(small, held_small)
            if held_main:
                _put_back(self._main, held_main)
        return victims

    def _evict_small(
        self,
        protected: Collection[ChunkKey],
        held: list[ChunkKey],
        victims: list[ChunkKey],
        wanted: int,
    ) -> bool:
        """Drop the oldest unaccessed small keys, promoting accessed ones on the way.

        Takes victims until there are ``wanted`` or the small queue falls
        below its share (then main's turn); ``False`` if the small queue ran
        out before the next victim. Ends because every step removes a key
        from the small queue.
        """
        small, main, ghost, freqs = self._small, self._main, self._ghost, self._freq
        small_capacity, capacity = self.small_capacity, self.capacity
        while small:
            key = next(iter(small))
            del small[key]
            if key in protected:
                held.append(key)
                continue
            if freqs[key] > 0:
                main[key] = None
                continue
            del freqs[key]
            ghost[key] = None
            # The ghost remembers about as many keys as the cache holds.
            if len(ghost) > capacity:
                ghost.popitem(last=False)
            victims.append(key)
            if len(victims) == wanted or len(small) + len(held) < small_capacity:
                return True
        return False

    def _evict_main(
        self,
        protected: Collection[ChunkKey],
        held: list[ChunkKey],
        victims: list[ChunkKey],
        wanted: int,
    ) -> bool:
        """Drop the oldest main keys with no frequency left, re-queueing the others.

        Takes victims until there are ``wanted`` (main's turn lasts: taking
        from main leaves the small queue as it is); ``False`` if the main
        queue ran out first. Ends because every re-queue spends one unit of a
        bounded frequency.
        """
        main, freqs = self._main, self._freq
        while main:
            # One pass down the queue as it stands, changing it only after:
            # a re-queued key goes behind every key still ahead of it, so the
            # queue after the pass is the rest of it, then the re-queued keys
            # in the order they were met (a pass per lap of the queue).
            requeued: list[ChunkKey] = []
            gone: list[ChunkKey] = []
            found = False
            for key in main:
                if key in protected:
                    held.append(key)
                    gone.append(key)
                    continue
                freq = freqs[key]
                if freq > 0:
                    freqs[key] = freq - 1
                    requeued.append(key)
                    continue
                del freqs[key]
                victims.append(key)
                gone.append(key)
                if len(victims) == wanted:
                    found = True
                    break
            for key in gone:
                del main[key]
            for key in requeued:
                main.move_to_end(key)
            if found:
                return True
        return False

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
