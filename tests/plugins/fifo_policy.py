"""An out-of-tree cache policy, loaded by module path in the tests."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy


class FIFOCachePolicy(CachePolicy):
    """Evicts the idle key inserted first; accesses change nothing."""

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self._order: dict[ChunkKey, None] = {}  # insertion order

    def get(self, key: ChunkKey) -> bool:
        return key in self._order

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        pass

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        victims = [key for key in self._order if key not in protected][: max(n, 0)]
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
