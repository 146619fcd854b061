"""Hit density by class and age, after LHD (Beckmann et al., NSDI 2018)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy

#: Age buckets: four a doubling of the age in requests, the last open-ended.
BUCKETS = 64
CLASSES = 3  # used once, twice, three times or more


def bucket(age: int) -> int:
    return min(BUCKETS - 1, int(4 * math.log2(1 + age)))


def bucket_age(index: int) -> float:
    """A bucket's least age, in requests."""
    return float(2 ** (index / 4) - 1)


class HitDensity(CachePolicy):
    """Evicts, among ``samples`` chunks drawn at random, the one whose class
    (uses: 1, 2, 3+) and age (requests since its last use) promise the fewest
    hits per request of the slot's time still to spend: for each class and age,
    hits at older ages over the slot-time those chunks took until their hit or
    eviction, learned online from this tier's own hits and evictions (counts
    decayed by ``decay`` each ``capacity`` events). Requests are counted by the
    primary tier's touches and by evictions not right after a touch."""

    def __init__(
        self, capacity: int, *, samples: int = 64, decay: float = 0.9, **kwargs: Any
    ) -> None:
        super().__init__(capacity, **kwargs)
        self.samples, self.decay = samples, decay
        self.keys: list[ChunkKey] = []
        self.index: dict[ChunkKey, int] = {}
        self.last: dict[ChunkKey, int] = {}
        self.uses: dict[ChunkKey, int] = {}
        self._start_learning()

    def _start_learning(self) -> None:
        self.hits = [[0.0] * BUCKETS for _ in range(CLASSES)]
        self.ends = [[0.0] * BUCKETS for _ in range(CLASSES)]
        # Before anything is learned: the older, the less (plain LRU's order).
        self.density = [[1.0 / (1 + b) for b in range(BUCKETS)] for _ in range(CLASSES)]
        self.request = 0
        self._events = 0
        self._after_touch = False

    def _class(self, key: ChunkKey) -> int:
        return min(self.uses[key], CLASSES) - 1

    def _event(self) -> None:
        self._events += 1
        if self._events >= self.capacity:
            self._events = 0
            self._learn()

    def _learn(self) -> None:
        for hits, ends, density in zip(self.hits, self.ends, self.density, strict=True):
            later_hits = later_count = later_time = 0.0
            for index in range(BUCKETS - 1, -1, -1):
                # Everything that reached this age: its hits, and the slot-time it
                # still spent from here (each counted at its bucket's least age).
                later_hits += hits[index]
                later_count += hits[index] + ends[index]
                later_time += (hits[index] + ends[index]) * (bucket_age(index) + 1)
                spent = later_time - bucket_age(index) * later_count
                density[index] = later_hits / spent if spent > 0 else 0.0
                hits[index] *= self.decay
                ends[index] *= self.decay

    def _add(self, key: ChunkKey) -> None:
        self.index[key] = len(self.keys)
        self.keys.append(key)

    def _drop(self, key: ChunkKey) -> None:
        at = self.index.pop(key)
        last = self.keys.pop()
        if last != key:
            self.keys[at] = last
            self.index[last] = at
        del self.last[key], self.uses[key]

    def get(self, key: ChunkKey) -> bool:
        if key not in self.index:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        self._after_touch = False
        if key not in self.index:
            self._add(key)
            self.uses[key] = 0
        self.uses[key] += 1
        self.last[key] = self.request

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        self.request += 1
        self._after_touch = True
        for key in keys:
            if key not in self.index:
                continue
            self.hits[self._class(key)][bucket(self.request - self.last[key])] += 1
            self._event()
            self.uses[key] += 1
            self.last[key] = self.request

    def remove(self, key: ChunkKey) -> None:
        if key in self.index:
            self._drop(key)

    def _rank(self, key: ChunkKey) -> float:
        return self.density[self._class(key)][bucket(self.request - self.last[key])]

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        # One look at each spared key; the draws then test this set.
        spared = {key for key in protected if key in self.index}
        if len(self.keys) - len(spared) < n:
            return None  # checked before any draw: a failed call changes nothing
        if not self._after_touch:
            self.request += 1  # a request that hit nothing
        self._after_touch = False
        victims = []
        for _ in range(n):
            drawn = [self.keys[self.rng.randrange(len(self.keys))] for _ in range(self.samples)]
            free = [key for key in drawn if key not in spared]
            if not free:  # mostly spared keys: take them in order instead
                free = [key for key in self.keys if key not in spared][: self.samples]
            victim = min(free, key=self._rank)
            self.ends[self._class(victim)][bucket(self.request - self.last[victim])] += 1
            self._event()
            self._drop(victim)
            victims.append(victim)
        return victims

    def clear(self) -> None:
        self.keys.clear()
        self.index.clear()
        self.last.clear()
        self.uses.clear()
        self._start_learning()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.index
