"""Frequency classes and segmented LRU: ranks that put a key's use count first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvtier.keys import ChunkKey
from policy_lab.ranked import Rank, RankedPolicy


class FrequencyClasses(RankedPolicy):
    """Evicts from the lowest use-count class first (used once, twice, ...,
    ``classes`` times or more), the least recently used request's deepest
    chunk first within a class. Counts are of requests, and die with the key."""

    def __init__(self, capacity: int, *, classes: int = 3, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.classes = classes
        self.uses: dict[ChunkKey, int] = {}

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        uses = self.uses[key] = 1 if new else self.uses.get(key, 0) + 1
        return (min(uses, self.classes), self.request, -depth)

    def forget(self, key: ChunkKey) -> None:
        self.uses.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self.uses.clear()


class SegmentedLRU(RankedPolicy):
    """Segmented LRU with ghosts: new keys enter probation; a key used again,
    or inserted while its ghost is remembered (evicted not long ago), enters
    the protected segment (``protected_share`` of the capacity; its least
    recently used key falls back to probation when it overflows). Probation
    is evicted first, each segment least recently used request first, deepest
    chunk first. Ghosts: the last ``ghost_share`` × capacity keys evicted."""

    def __init__(
        self,
        capacity: int,
        *,
        protected_share: float = 0.8,
        ghost_share: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(capacity, **kwargs)
        self.protected_slots = max(1, int(protected_share * capacity))
        self.ghost_slots = int(ghost_share * capacity)
        #: Protected keys, least recently used first: their last use and depth.
        self.protected: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()
        self.ghosts: OrderedDict[ChunkKey, None] = OrderedDict()

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        ghost = new and key in self.ghosts
        if ghost:
            del self.ghosts[key]
        if ghost or not new:
            self.protected[key] = (self.request, depth)
            self.protected.move_to_end(key)
            while len(self.protected) > self.protected_slots:
                demoted, (last, its_depth) = self.protected.popitem(last=False)
                self._push(demoted, (0, last, -its_depth))
            return (1, self.request, -depth)
        return (0, self.request, -depth)

    def forget(self, key: ChunkKey) -> None:
        self.protected.pop(key, None)
        if self.ghost_slots:
            self.ghosts[key] = None
            if len(self.ghosts) > self.ghost_slots:
                self.ghosts.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        self.protected.clear()
        self.ghosts.clear()
