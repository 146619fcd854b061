"""Reuse hazard by use-count class, learned online from ghosts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy
from policy_lab.hit_density import BUCKETS, CLASSES, bucket


class HazardClasses(CachePolicy):
    """One LRU list per use-count class (used once, twice, three times or more).

    The hazard of a class at an age is the chance that a chunk of that class,
    unused for that many requests, is used at that age: reuses at the age
    over the chunks that reached it, learned from this tier's hits and from
    ghosts (the last ``ghost_share`` × capacity chunks evicted; a ghost
    inserted again counts as a reuse, one dropped from the ghosts as an end).
    Evicts the least recently used chunk overall, unless another class's
    oldest chunk has a hazard below ``margin`` × that one's: then that.
    Requests are counted as the hit density policy counts them.
    """

    def __init__(
        self, capacity: int, *, ghost_share: float = 1.0, margin: float = 0.5, **kwargs: Any
    ) -> None:
        super().__init__(capacity, **kwargs)
        self.ghost_slots, self.margin = int(ghost_share * capacity), margin
        self.lists: list[OrderedDict[ChunkKey, int]] = [OrderedDict() for _ in range(CLASSES)]
        self._start()

    def _start(self) -> None:
        self.klass: dict[ChunkKey, int] = {}
        self.ghosts: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()
        self.reuses = [[0] * BUCKETS for _ in range(CLASSES)]
        self.ends = [[0] * BUCKETS for _ in range(CLASSES)]
        self.request = 0
        self._after_touch = False

    def hazard(self, klass: int, age: int) -> float:
        at = bucket(age)
        reached = sum(self.reuses[klass][at:]) + sum(self.ends[klass][at:])
        return self.reuses[klass][at] / reached if reached else 1.0

    def _use(self, key: ChunkKey, klass: int) -> None:
        self.klass[key] = klass
        self.lists[klass][key] = self.request
        self.lists[klass].move_to_end(key)

    def get(self, key: ChunkKey) -> bool:
        if key not in self.klass:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        self._after_touch = False
        if key in self.klass:
            return
        ghost = self.ghosts.pop(key, None)
        klass = 0
        if ghost is not None:
            klass, last = ghost
            self.reuses[klass][bucket(self.request - last)] += 1
            klass = min(klass + 1, CLASSES - 1)
        self._use(key, klass)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        self.request += 1
        self._after_touch = True
        for key in keys:
            klass = self.klass.get(key)
            if klass is None:
                continue
            last = self.lists[klass].pop(key)
            self.reuses[klass][bucket(self.request - last)] += 1
            self._use(key, min(klass + 1, CLASSES - 1))

    def remove(self, key: ChunkKey) -> None:
        klass = self.klass.pop(key, None)
        if klass is not None:
            del self.lists[klass][key]

    def _oldest(
        self, klass: int, protected: Collection[ChunkKey], exhausted: set[int]
    ) -> ChunkKey | None:
        """The least recent key of a class outside ``protected``; spared keys met
        on the way move to the recent end (keeping their last use), once a call."""
        if klass in exhausted:
            return None
        entries = self.lists[klass]
        for _ in range(len(entries)):
            key = next(iter(entries))
            if key not in protected:
                return key
            entries.move_to_end(key)
        exhausted.add(klass)
        return None

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        if len(self.klass) - len({key for key in protected if key in self.klass}) < n:
            return None
        if not self._after_touch:
            self.request += 1  # a request that hit nothing
        self._after_touch = False
        victims: list[ChunkKey] = []
        exhausted: set[int] = set()
        for _ in range(n):
            oldest = {}
            for klass in range(CLASSES):
                key = self._oldest(klass, protected, exhausted)
                if key is not None:
                    oldest[klass] = key
            by_age = min(oldest, key=lambda k: self.lists[k][oldest[k]])
            chosen = by_age
            floor = self.margin * self._hazard_of(by_age, oldest[by_age])
            for klass, key in oldest.items():
                if self._hazard_of(klass, key) < floor:
                    chosen, floor = klass, self._hazard_of(klass, key)
            victim = oldest[chosen]
            last = self.lists[chosen].pop(victim)
            del self.klass[victim]
            victims.append(victim)
            if self.ghost_slots:
                self.ghosts[victim] = (chosen, last)
                if len(self.ghosts) > self.ghost_slots:
                    _, (klass, gone) = self.ghosts.popitem(last=False)
                    self.ends[klass][bucket(self.request - gone)] += 1
        return victims

    def _hazard_of(self, klass: int, key: ChunkKey) -> float:
        return self.hazard(klass, self.request - self.lists[klass][key])

    def clear(self) -> None:
        for entries in self.lists:
            entries.clear()
        self._start()

    def __len__(self) -> int:
        return len(self.klass)

    def __contains__(self, key: object) -> bool:
        return key in self.klass
