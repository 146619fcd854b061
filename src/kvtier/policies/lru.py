"""Least recently used."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy


class LRUCachePolicy(CachePolicy):
    """Evicts the idle key whose last access is oldest."""

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        # Oldest first; values unused.
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def get(self, key: ChunkKey) -> bool:
        if key not in self._order:
            return False
        self._order.move_to_end(key)
        return True

    def insert(self, key: ChunkKey) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        order = self._order
        expected = len(order) + len(keys)
        for key in keys:  # the primary tier's case: new keys, each once
            order[key] = None
        if len(order) != expected:
            # A key was tracked already, or listed twice: where insert would
            # have moved it to the end, assignment left it in place. Moving
            # every key to the end again, in order, gives insert's order.
            for key in keys:
                order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            # The primary tier touches only tracked keys: one C-level pass.
            deque(map(self._order.move_to_end, keys), maxlen=0)
        except KeyError:
            # An untracked key stopped it part-way: moving the tracked ones to the
            # end once more, in order, leaves the same order as moving them once.
            for key in keys:
                if key in self._order:
                    self._order.move_to_end(key)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        # unprotected() inlined: a call less on every store that evicts.
        idle = itertools.filterfalse(protected.__contains__, self._order)
        victims = list(itertools.islice(idle, n))
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
