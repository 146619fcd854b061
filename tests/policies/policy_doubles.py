"""A policy written as the docs say: its time and randomness come from ``self.clock``
and ``self.rng``, which it uses without checking that they were injected."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies import CachePolicy


class RandomOldPolicy(CachePolicy):
    """Evicts random keys among those not accessed for a while."""

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.last_access: dict[ChunkKey, float] = {}

    def get(self, key: ChunkKey) -> bool:
        if key not in self.last_access:
            return False
        self.last_access[key] = self.clock()
        return True

    def insert(self, key: ChunkKey) -> None:
        self.last_access[key] = self.clock()

    def remove(self, key: ChunkKey) -> None:
        self.last_access.pop(key, None)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            if key in self.last_access:
                self.last_access[key] = self.clock()

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        candidates = sorted(
            (k for k in self.last_access if k not in protected), key=self.last_access.__getitem__
        )
        if len(candidates) < n:
            return None
        # Random victims among the older half (at least n) of the candidates.
        victims = self.rng.sample(candidates[: max(n, len(candidates) // 2)], n)
        for victim in victims:
            del self.last_access[victim]
        return victims

    def clear(self) -> None:
        self.last_access.clear()

    def __len__(self) -> int:
        return len(self.last_access)

    def __contains__(self, key: object) -> bool:
        return key in self.last_access
