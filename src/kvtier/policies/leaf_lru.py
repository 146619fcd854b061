"""LRU over requests that gives up the deepest chunks of a prefix chain first."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
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
        #: The group the last touch opened, and its size then: while both hold, no
        #: insert came since, so an evict serves the touching request.
        self._touched: tuple[int, int] = (-1, -1)

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

    def get(self, key: ChunkKey) -> bool:
        if key not in self._group_of:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        if self._announced:
            self._announced -= 1
        elif self._serial not in self._unannounced:
            self._open(announced=False)
        serial = self._serial
        old = self._group_of.setdefault(key, serial)
        if old != serial:  # never from the primary tier, which inserts only new keys
            self._group_of[key] = old
            self._leave(key)
            self._group_of[key] = serial
        self._current[key] = None

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        # insert inlined for the primary tier's batches: new keys that an
        # eviction announced join the current group.
        group_of, current, serial = self._group_of, self._current, self._serial
        joined = 0
        for key in itertools.islice(keys, self._announced):
            if key in group_of:
                break
            group_of[key] = serial
            current[key] = None
            joined += 1
        self._announced -= joined
        for key in keys[joined:]:  # the general case, key by key
            self.insert(key)

    def remove(self, key: ChunkKey) -> None:
        if key in self._group_of:
            self._leave(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        keys = list(keys)
        if self._touched == (self._serial, len(keys)) and list(self._current) == keys:
            # The same hits touched again with nothing in between (a lookup, then
            # the load of what it found): they already are the newest group.
            return
        self._open()
        self._announced = 0
        # _leave and _join inlined: the primary tier touches every hit of every request.
        group_of, groups, serial, current = (
            self._group_of,
            self._groups,
            self._serial,
            self._current,
        )
        # A chain's keys mostly come from one group (its last request): look each
        # group up once per run of its keys.
        last, group = -1, current
        for key in keys:
            old = group_of.get(key)
            if old is None:
                continue
            if old != last:
                if not group and last != serial and last in groups:
                    del groups[last]
                    self._unannounced.discard(last)
                last, group = old, groups[old]
            del group[key]
            group_of[key] = serial
            current[key] = None
        if not group and last != serial and last in groups:
            del groups[last]
            self._unannounced.discard(last)
        self._touched = (serial, len(current))

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        victims: list[ChunkKey] = []
        wanted, unannounced = n, self._unannounced
        for serial, group in self._groups.items():
            for key in group if serial in unannounced else reversed(group):
                if key not in protected:
                    victims.append(key)
                    wanted -= 1
                    if not wanted:
                        break
            if not wanted:
                break
        else:
            return None  # too few evictable: nothing changed
        # _leave inlined: the primary tier evicts for most stores.
        group_of, groups, current = self._group_of, self._groups, self._current
        for key in victims:
            serial = group_of.pop(key)
            group = groups[serial]
            del group[key]
            if not group and group is not current:
                del groups[serial]
                self._unannounced.discard(serial)
        if self._touched != (self._serial, len(self._current)):
            self._open()  # a request that hit nothing: its new chunks start a group
        self._touched = (-1, -1)
        self._announced = n
        return victims

    def clear(self) -> None:
        self._groups.clear()
        self._group_of.clear()
        self._unannounced.clear()
        self._current = {}
        self._announced = 0
        self._touched = (-1, -1)

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, key: object) -> bool:
        return key in self._group_of
