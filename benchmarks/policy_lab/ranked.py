"""The base of the lab's policies: evict the idle keys of lowest rank.

A subclass says what a key's rank is when it is used (touched or inserted);
ranks compare as tuples and only change when a key is used, so a heap with
stale entries skipped finds the lowest. Requests are read off the primary
tier's calls as leaf-lru reads them: a ``touch`` of a request's hits opens
one, so does an eviction not right after a touch (a request that hit
nothing makes room for its chunks); the inserts after either continue its
chain, root to leaf, which gives each key a depth and a parent. Inserts that
no touch or eviction announced (while the tier fills) join the last request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy

Rank = tuple[float, ...]


class RankedPolicy(CachePolicy):
    """Evicts the lowest-ranked idle keys; subclasses define :meth:`rank`."""

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self._heap: list[tuple[Rank, int, ChunkKey]] = []
        self._entry: dict[ChunkKey, int] = {}  # key -> serial of its live heap entry
        self._serial = itertools.count()
        #: Requests seen so far: the lab's clock.
        self.request = 0
        #: The current request's chain so far (its touched keys, then its inserts).
        self.chain: list[ChunkKey] = []
        self._last_call = ""

    # What subclasses define -------------------------------------------------

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        """The rank of ``key`` just used (``new``: inserted) at ``depth`` of the chain."""
        return (self.request, -depth)

    def forget(self, key: ChunkKey) -> None:
        """``key`` left the tier (evicted); a policy with ghosts remembers it here."""

    def opened(self) -> None:
        """A new request began (:attr:`request` already counts it)."""

    # The contract ------------------------------------------------------------

    def _open(self) -> None:
        self.request += 1
        self.chain = []
        self.opened()

    def _use(self, key: ChunkKey, new: bool) -> None:
        depth = len(self.chain)
        parent = self.chain[-1] if self.chain else None
        self.chain.append(key)
        self._push(key, self.rank(key, depth, parent, new))

    def _push(self, key: ChunkKey, rank: Rank) -> None:
        serial = next(self._serial)
        self._entry[key] = serial
        heapq.heappush(self._heap, (rank, serial, key))
        if len(self._heap) > 4 * len(self._entry) + 1024:
            self._heap = [e for e in self._heap if self._entry.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def get(self, key: ChunkKey) -> bool:
        if key not in self._entry:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        if not self.chain and self._last_call == "":
            self._open()
        self._last_call = "insert"
        self._use(key, key not in self._entry)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        self._open()
        self._last_call = "touch"
        for key in keys:
            if key in self._entry:
                self._use(key, False)

    def remove(self, key: ChunkKey) -> None:
        self._entry.pop(key, None)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        heap, entry = self._heap, self._entry
        victims: list[tuple[Rank, int, ChunkKey]] = []
        spared: list[tuple[Rank, int, ChunkKey]] = []
        while len(victims) < n and heap:
            item = heapq.heappop(heap)
            if entry.get(item[2]) != item[1]:
                continue  # stale: used again, or gone
            (spared if item[2] in protected else victims).append(item)
        for item in spared if len(victims) == n else spared + victims:
            heapq.heappush(heap, item)
        if len(victims) < n:
            return None
        if self._last_call != "touch":
            self._open()  # a request that hit nothing makes room for its chunks
        self._last_call = "evict"
        keys = [item[2] for item in victims]
        for key in keys:
            del entry[key]
            self.forget(key)
        return keys

    def clear(self) -> None:
        self._heap.clear()
        self._entry.clear()
        self.chain = []
        self._last_call = ""

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry
