"""W-TinyLFU (Einziger et al., 2017), with exact counts in place of a sketch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy

Queue = OrderedDict[ChunkKey, None]


class WTinyLFU(CachePolicy):
    """A window LRU of ``window_share`` of the slots in front of a segmented
    LRU (probation, then a protected segment of 80 % of the rest). When room
    is needed and the window is full, its least recent chunk is admitted to
    the main segments only if it was used more often than the chunk
    probation would give up; the loser is evicted. Use counts are exact,
    kept for evicted chunks too, and halved every ``10 × capacity`` uses
    (TinyLFU's aging).
    """

    def __init__(self, capacity: int, *, window_share: float = 0.01, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.window_slots = max(1, int(window_share * capacity))
        self.protected_slots = max(1, int(0.8 * (capacity - self.window_slots)))
        self.window: Queue = OrderedDict()
        self.probation: Queue = OrderedDict()
        self.protected: Queue = OrderedDict()
        self.uses: dict[ChunkKey, int] = {}
        self._counted = 0

    def _count(self, key: ChunkKey) -> None:
        self.uses[key] = self.uses.get(key, 0) + 1
        self._counted += 1
        if self._counted >= 10 * self.capacity:
            self._counted = 0
            self.uses = {k: v // 2 for k, v in self.uses.items() if v > 1}

    def _protect(self, key: ChunkKey) -> None:
        self.protected[key] = None
        while len(self.protected) > self.protected_slots:
            demoted, _ = self.protected.popitem(last=False)
            self.probation[demoted] = None

    def get(self, key: ChunkKey) -> bool:
        if key not in self:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        self._count(key)
        if key not in self:
            self.window[key] = None
            # The window's overflow moves on to probation: the tier made room
            # for the insert (the contest happened in evict), so main has it.
            while len(self.window) > self.window_slots:
                oldest, _ = self.window.popitem(last=False)
                self.probation[oldest] = None

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            if key in self.window:
                self.window.move_to_end(key)
            elif key in self.probation:
                del self.probation[key]
                self._protect(key)
            elif key in self.protected:
                self.protected.move_to_end(key)
            else:
                continue
            self._count(key)

    def remove(self, key: ChunkKey) -> None:
        for queue in (self.window, self.probation, self.protected):
            queue.pop(key, None)

    @staticmethod
    def _oldest(
        queue: Queue, protected: Collection[ChunkKey], exhausted: set[int]
    ) -> ChunkKey | None:
        """The least recent key of ``queue`` outside ``protected``. The spared keys
        met on the way go to the recent end, and a queue found to hold only spared
        keys is ``exhausted`` for the call, so each key is looked at about once."""
        if id(queue) in exhausted:
            return None
        for _ in range(len(queue)):
            key = next(iter(queue))
            if key not in protected:
                return key
            queue.move_to_end(key)
        exhausted.add(id(queue))
        return None

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        if len(self) - len({key for key in protected if key in self}) < n:
            return None  # checked first: nothing below can fail
        victims: list[ChunkKey] = []
        exhausted: set[int] = set()
        while len(victims) < n:
            candidate: ChunkKey | None = None
            loser: ChunkKey | None
            if len(self.window) >= self.window_slots:  # an insert will push one out
                candidate = self._oldest(self.window, protected, exhausted)
            victim = self._oldest(self.probation, protected, exhausted)
            if victim is None:
                victim = self._oldest(self.protected, protected, exhausted)
            if candidate is not None and victim is not None:
                if self.uses.get(candidate, 0) > self.uses.get(victim, 0):
                    del self.window[candidate]  # admitted; probation gives up its victim
                    self.probation[candidate] = None
                    loser = victim
                else:
                    loser = candidate
            elif candidate is not None or victim is not None:
                loser = candidate if candidate is not None else victim
            else:  # only the window, within its share, has a key to give
                loser = self._oldest(self.window, protected, exhausted)
            assert loser is not None  # the count above guarantees one
            self.remove(loser)
            victims.append(loser)
        return victims

    def clear(self) -> None:
        for queue in (self.window, self.probation, self.protected):
            queue.clear()
        self.uses.clear()
        self._counted = 0

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    def __contains__(self, key: object) -> bool:
        return key in self.window or key in self.probation or key in self.protected
