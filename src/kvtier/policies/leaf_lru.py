"""LRU over requests that gives up the deepest chunks of a prefix chain first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy


class LeafFirstLRUCachePolicy(CachePolicy):
    """Evicts from the least recently used request, its deepest chunk first.

    A chunk serves a request only while every chunk before it in the prefix
    is resident: evicting a chain's root strands all of its descendants.
    Plain LRU does just that, because the primary tier touches and inserts a
    request's chunks root first, so within one request the root is the
    oldest. This policy keeps LRU's order between requests and reverses it
    within one: the chunks last used by the same request form a group, and
    the oldest group gives up its deepest chunks (the leaves of its chain)
    before their ancestors.

    Groups are read off the calls the primary tier makes for a request: a
    ``touch`` of its hits opens one; ``evict(n)`` makes room for its ``n``
    new chunks, which join the group (a new one if nothing was hit). Inserts
    that no eviction announced, as while the tier fills, cannot be told apart
    by request, so they keep plain LRU order. Work per operation is LRU's
    plus one dict lookup; state is one group id per key.
    """

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        # Groups, least recently used first; each holds its keys oldest first.
        self._groups: OrderedDict[int, dict[ChunkKey, None]] = OrderedDict()
        self._group_of: dict[ChunkKey, int] = {}
        # Groups of inserts no request announced: evicted oldest first, as LRU.
        self._unannounced: set[int] = set()
        self._serial = 0
        self._current: dict[ChunkKey, None] = {}
        #: Inserts still to join the current request's group.
        self._announced = 0
        #: Whether the last call was a touch: an evict after one serves that request.
        self._touched = False

    def _open(self, announced: bool = True) -> None:
        if not self._current:
            self._groups.pop(self._serial, None)
            self._unannounced.discard(self._serial)
        self._serial += 1
        self._current = {}
        self._groups[self._serial] = self._current
        if not announced:
            self._unannounced.add(self._serial)

    def _leave(self, key: ChunkKey) -> None:
        """Take a tracked key out of its group, dropping the group once empty."""
        serial = self._group_of.pop(key)
        group = self._groups[serial]
        del group[key]
        if not group and group is not self._current:
            del self._groups[serial]
            self._unannounced.discard(serial)

    def _join(self, key: ChunkKey) -> None:
        self._group_of[key] = self._serial
        self._current[key] = None

    def get(self, key: ChunkKey) -> bool:
        if key not in self._group_of:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        if key in self._group_of:
            self._leave(key)
        if self._announced > 0:
            self._announced -= 1
        elif self._serial not in self._unannounced:
            self._open(announced=False)
        self._touched = False
        self._join(key)

    def remove(self, key: ChunkKey) -> None:
        if key in self._group_of:
            self._leave(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        self._open()
        self._announced = 0
        self._touched = True
        for key in keys:
            if key in self._group_of:
                self._leave(key)
                self._join(key)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        victims: list[ChunkKey] = []
        for serial, group in self._groups.items():
            order = group if serial in self._unannounced else reversed(group)
            for key in order:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == n:
                        break
            if len(victims) == n:
                break
        else:
            return None  # too few evictable: nothing changed
        for key in victims:
            self._leave(key)
        if not self._touched:
            self._open()  # a request that hit nothing: its new chunks start a group
        self._touched = False
        self._announced = n
        return victims

    def clear(self) -> None:
        self._groups.clear()
        self._group_of.clear()
        self._unannounced.clear()
        self._current = {}
        self._announced = 0
        self._touched = False

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, key: object) -> bool:
        return key in self._group_of
