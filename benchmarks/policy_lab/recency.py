"""Recency weighted otherwise: LRFU and bimodal insertion."""

from __future__ import annotations

import math
from typing import Any

from kvtier.keys import ChunkKey
from policy_lab.ranked import Rank, RankedPolicy


class LRFU(RankedPolicy):
    """LRFU (Lee et al., 1999): each use adds ``2^(-λ × age in requests)`` to a
    key's combined recency and frequency; the lowest goes first. Kept as a
    base-2 logarithm at time zero, where ranks never change with time alone.
    ``λ`` near 1 is LRU, near 0 LFU. The values of evicted keys are kept without
    bound (``history``), so a key that returns resumes its count."""

    def __init__(self, capacity: int, *, lam: float = 0.01, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.lam = lam
        self.value: dict[ChunkKey, float] = {}

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        now = self.lam * self.request
        old = self.value.get(key)
        if old is None:
            value = now
        else:
            high, low = max(now, old), min(now, old)
            value = high + math.log2(1 + 2 ** (low - high))
        self.value[key] = value
        return (value, -depth)

    def clear(self) -> None:
        super().clear()
        self.value.clear()


class BimodalInsertion(RankedPolicy):
    """Bimodal insertion per request (after Qureshi et al., 2007): a request's
    new chunks enter at the least recently used end, unless the request is
    drawn (chance ``mru_chance``) to enter them at the most recently used end;
    a chunk used again moves to the most recent end as in LRU."""

    def __init__(self, capacity: int, *, mru_chance: float = 1 / 32, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.mru_chance = mru_chance
        self._drawn_for = -1
        self._at_mru = False

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        if not new:
            return (1, self.request, -depth)
        if self._drawn_for != self.request:
            self._drawn_for = self.request
            self._at_mru = self.rng.random() < self.mru_chance
        return (1 if self._at_mru else 0, self.request, -depth)
