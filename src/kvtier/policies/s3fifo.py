"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues, scan-resistant."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy, size_bound, unprotected

#: Frequencies saturate here (two bits), so a hot key earns at most three reprieves.
MAX_FREQ = 3
#: A resident key's count is its frequency in the small queue, ``MAIN`` plus it
#: in the main queue: one dict lookup tells both which queue and how hot.
MAIN = MAX_FREQ + 1
#: The count after one more access, by count: saturating within each queue.
_NEXT = (*range(1, MAX_FREQ + 1), MAX_FREQ, *range(MAIN + 1, MAIN + MAX_FREQ + 1), MAIN + MAX_FREQ)
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
        # Queues are ordered oldest first. Keys enter at the tail and leave at
        # the head, or, rarely (remove), from the middle: deques, not dicts.
        self._small: deque[ChunkKey] = deque()
        self._main: deque[ChunkKey] = deque()
        self._ghost: OrderedDict[ChunkKey, None] = OrderedDict()  # values unused
        # Resident keys and their counts (see MAIN): accesses since entering,
        # or since their last re-queue.
        self._freq: dict[ChunkKey, int] = {}

    def get(self, key: ChunkKey) -> bool:
        count = self._freq.get(key)
        if count is None:
            return False
        self._freq[key] = _NEXT[count]
        return True

    def insert(self, key: ChunkKey) -> None:
        if self.get(key):
            return
        if key in self._ghost:
            # Seen recently enough to be remembered: it has proven reuse.
            del self._ghost[key]
            self._main.append(key)
            self._freq[key] = MAIN
        else:
            self._small.append(key)
            self._freq[key] = 0

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        # insert inlined for the primary tier's batches: the common case is a
        # key neither resident nor remembered, which enters the small queue,
        # then one the ghost remembers, which enters the main queue.
        counts, ghost, small, main = self._freq, self._ghost, self._small, self._main
        for key in keys:
            if key in counts:
                self.insert(key)  # a hit: never from the primary tier
            elif key in ghost:  # a chunk evicted not long ago, stored again
                del ghost[key]
                main.append(key)
                counts[key] = MAIN
            else:
                small.append(key)
                counts[key] = 0

    def remove(self, key: ChunkKey) -> None:
        count = self._freq.pop(key, None)
        if count is not None:
            (self._small if count < MAIN else self._main).remove(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        # ``get`` inlined: the primary tier touches every hit of every request.
        # A plain loop: each key costs its dict lookups, which C-level
        # batching (map, update) measured no cheaper.
        counts = self._freq
        for key in keys:
            count = counts.get(key)
            if count is not None:
                counts[key] = _NEXT[count]

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        # Eviction below promotes and re-queues keys as it goes, so decide
        # first whether it can succeed: it can exactly when n keys are
        # unprotected. Stops at the n-th, so it costs about n, not |protected|.
        # Skipped when there are enough keys even if every protected one is
        # resident: the primary tier's case, whose pins are few.
        if len(self._freq) - size_bound(protected) < n:
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
        small, main, small_capacity = self._small, self._main, self.small_capacity
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
                if not found and not small and not main:
                    raise RuntimeError("S3-FIFO found no victim although enough keys are evictable")
        finally:
            if held_small:
                small.extendleft(reversed(held_small))
            if held_main:
                main.extendleft(reversed(held_main))
        return victims

    def _evict_small(
        self,
        protected: Collection[ChunkKey],
        held: list[ChunkKey],
        victims: list[ChunkKey],
        wanted: int,
    ) -> bool:
        """Drop the oldest unaccessed small keys, promoting accessed ones on the way
        (:func:`_evict_small`: compiled where kvtier was built with a C compiler)."""
        return active.evict_small(
            self._small,
            self._main,
            self._ghost,
            self._freq,
            protected,
            held,
            victims,
            wanted,
            self.small_capacity,
            self.capacity,
            MAIN,
        )

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
        main, counts = self._main, self._freq
        while main:
            # One pass down the queue as it stands, to its first victim or
            # protected key: the keys before it are re-queued, which one
            # rotation does in C (their order behind the rest is the order
            # they were met in). A whole lap re-queues every key: no change.
            requeued = 0
            for key in main:
                if key in protected:
                    break
                count = counts[key]
                if count == MAIN:
                    break
                counts[key] = count - 1
                requeued += 1
            else:
                continue
            main.rotate(-requeued)
            key = main.popleft()
            if counts[key] != MAIN or key in protected:
                held.append(key)
                continue
            del counts[key]
            victims.append(key)
            if len(victims) == wanted:
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


def _evict_small(
    small: deque[ChunkKey],
    main: deque[ChunkKey],
    ghost: OrderedDict[ChunkKey, None],
    counts: dict[ChunkKey, int],
    protected: Collection[ChunkKey],
    held: list[ChunkKey],
    victims: list[ChunkKey],
    wanted: int,
    small_capacity: int,
    capacity: int,
    main_count: int,
) -> bool:
    """S3-FIFO's victims from its small queue, each one remembered by the ghost.

    Takes victims until there are ``wanted`` or the small queue falls below
    its share ``small_capacity`` (then main's turn); ``False`` if the small
    queue ran out before the next victim. Protected keys are set aside in
    ``held``; accessed keys move to main with their count plus ``main_count``
    (:data:`MAIN`). Ends because every step takes a key from the small queue.
    """
    take, promote = small.popleft, main.append
    while small:
        key = take()
        if key in protected:
            held.append(key)
            continue
        count = counts[key]
        if count:  # accessed: into main, with its frequency
            promote(key)
            counts[key] = count + main_count
            continue
        del counts[key]
        ghost[key] = None
        # The ghost remembers about as many keys as the cache holds.
        if len(ghost) > capacity:
            ghost.popitem(False)  # positional: a keyword costs more than the pop
        victims.append(key)
        if len(victims) == wanted or len(small) + len(held) < small_capacity:
            return True
    return False


class S3FIFOSteps(NamedTuple):
    """One implementation of S3-FIFO's per-key steps."""

    evict_small: Callable[
        [
            deque[ChunkKey],
            deque[ChunkKey],
            OrderedDict[ChunkKey, None],
            dict[ChunkKey, int],
            Collection[ChunkKey],
            list[ChunkKey],
            list[ChunkKey],
            int,
            int,
            int,
            int,
        ],
        bool,
    ]


#: Every implementation present, by name.
IMPLEMENTATIONS: dict[str, S3FIFOSteps] = {"python": S3FIFOSteps(_evict_small)}
try:
    from kvtier.policies._native import _steps
except ImportError:  # built without a C compiler
    IMPLEMENTATION = "python"
else:
    IMPLEMENTATIONS["compiled"] = S3FIFOSteps(_steps.s3fifo_evict_small)
    IMPLEMENTATION = "compiled"

#: The implementation every S3-FIFO policy runs.
active = IMPLEMENTATIONS[IMPLEMENTATION]
