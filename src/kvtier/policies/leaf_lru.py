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

    The chunks last used by one request form a group, read off the primary
    tier's calls: a ``touch`` of its hits opens one, and the ``n`` inserts
    ``evict(n)`` made room for join it. Inserts no eviction announced keep
    plain LRU order. A touch of the keys that lead one group takes the group
    over as it is. Work per operation is LRU's plus one dict lookup; state is
    one group reference per key. Why: see docs/policies-and-specs.md,
    'Built-in policies, measured'.
    """

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        # Groups by serial, least recently used first; each holds its keys oldest first.
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._group_of: dict[ChunkKey, _Group] = {}
        # Serials of groups of inserts no request announced: evicted oldest first, as LRU.
        self._unannounced: set[int] = set()
        self._serial = 0
        self._current = _group(self._serial)
        #: Inserts still to join the current request's group.
        self._announced = 0
        #: The group the last touch opened, and its size then: while both hold, no
        #: insert came since, so an evict serves the touching request.
        self._touched: tuple[int, int] = (-1, -1)

    def _open(self, announced: bool = True, group: _Group | None = None) -> None:
        """Start the next group: ``group`` (out of its place) or a new, empty one."""
        if not self._current:
            self._groups.pop(self._serial, None)
            self._unannounced.discard(self._serial)
        self._serial += 1
        if group is None:
            group = _group(self._serial)
        else:
            group.serial = self._serial
        self._current = self._groups[self._serial] = group
        if not announced:
            self._unannounced.add(self._serial)

    def _drop_if_empty(self, group: _Group) -> None:
        """Forget an emptied group, unless it is the current one."""
        if not group and group is not self._current and self._groups.get(group.serial) is group:
            del self._groups[group.serial]
            self._unannounced.discard(group.serial)

    def _leave(self, key: ChunkKey) -> None:
        """Take a tracked key out of its group, dropping the group once empty."""
        group = self._group_of.pop(key)
        group.remove(key)
        self._drop_if_empty(group)

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
        current = self._current
        old = self._group_of.get(key)
        if old is not current:  # never from the primary tier, which inserts only new keys
            if old is not None:
                self._leave(key)
            self._group_of[key] = current
            current.append(key)

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        # insert inlined for the primary tier's batches: new keys that an
        # eviction announced join the current group.
        group_of, current = self._group_of, self._current
        join, before = current.append, len(current)
        for key in itertools.islice(keys, self._announced):
            if key in group_of:
                break
            group_of[key] = current
            join(key)
        joined = len(current) - before
        self._announced -= joined
        for key in keys[joined:]:  # the general case, key by key
            self.insert(key)

    def remove(self, key: ChunkKey) -> None:
        if key in self._group_of:
            self._leave(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        if self._touched == (self._serial, len(keys)) and self._current == keys:
            # The same hits touched again with nothing in between (a lookup, then
            # the load of what it found): they already are the newest group.
            return
        self._announced = 0
        leading = self._led_by(keys)
        if leading is not None:
            # Those keys become the new group as they are; only the keys after
            # them move, into a group that takes their old group's place.
            self._split_after(leading, len(keys))
            self._open(group=leading)
        else:
            self._open()
            self._gather(keys)
        self._touched = (self._serial, len(self._current))

    def _gather(self, keys: list[ChunkKey]) -> None:
        """Move each tracked key of ``keys``, in order, into the new current group.

        Each group the keys leave is rebuilt once after, not searched once per
        key: linear in the keys and the sizes of the groups they leave.
        """
        group_of, current = self._group_of, self._current
        left: dict[int, _Group] = {}
        last = current
        repeated = False
        for key in keys:
            group = group_of.get(key)
            if group is None:
                continue
            if group is current:
                repeated = True  # listed twice: it ends where it was listed last
            else:
                if group is not last:
                    left[id(group)] = last = group
                group_of[key] = current
            current.append(key)
        if repeated:
            current.reverse()
            current[:] = dict.fromkeys(current)
            current.reverse()
        for group in left.values():
            group[:] = [key for key in group if group_of[key] is group]
            self._drop_if_empty(group)

    def _led_by(self, keys: list[ChunkKey]) -> _Group | None:
        """The group whose oldest keys are ``keys``, in order, if there is one.

        The common case: a request hits the prefix the previous request of that
        prefix used, and those keys lead that request's group.
        """
        group = self._group_of.get(keys[0]) if keys else None
        if group is None or group[: len(keys)] != keys:
            return None
        return group

    def _split_after(self, group: _Group, count: int) -> None:
        """Move the keys after the first ``count`` of ``group`` into a group in its place."""
        serial, group_of = group.serial, self._group_of
        rest = _group(serial, group[count:])
        if rest:
            del group[count:]
            for key in rest:
                group_of[key] = rest
            self._groups[serial] = rest
        else:
            del self._groups[serial]
            self._unannounced.discard(serial)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        victims: list[ChunkKey] = []
        # Per group that gives victims: how many, and whether a protected key
        # lay between them (else they are the end of its list, or the start).
        gave: list[tuple[_Group, bool, int, bool]] = []
        wanted, unannounced = n, self._unannounced
        for serial, group in self._groups.items():
            taken = len(victims)
            oldest_first = serial in unannounced
            spared = False
            for key in group if oldest_first else reversed(group):
                if key in protected:
                    spared = True
                    continue
                victims.append(key)
                wanted -= 1
                if not wanted:
                    break
            if len(victims) > taken:
                gave.append((group, oldest_first, len(victims) - taken, spared))
            if not wanted:
                break
        else:
            return None  # too few evictable: nothing changed
        group_of = self._group_of
        for key in victims:
            del group_of[key]
        taken = 0
        for group, oldest_first, count, spared in gave:
            if spared:
                gone = set(victims[taken : taken + count])
                group[:] = [key for key in group if key not in gone]
            elif oldest_first:
                del group[:count]
            else:
                del group[-count:]
            taken += count
            if not group:
                self._drop_if_empty(group)
        if self._touched != (self._serial, len(self._current)):
            self._open()  # a request that hit nothing: its new chunks start a group
        self._touched = (-1, -1)
        self._announced = n
        return victims

    def clear(self) -> None:
        self._groups.clear()
        self._group_of.clear()
        self._unannounced.clear()
        self._current = _group(self._serial)
        self._announced = 0
        self._touched = (-1, -1)

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, key: object) -> bool:
        return key in self._group_of


class _Group(list[ChunkKey]):
    """The keys one request used last, oldest first, and its place among the groups.

    A list, not a dict: keys join at the end and victims leave from an end,
    so a list does in one C-level slice what a dict does key by key. Keys a
    touch moves elsewhere leave by one rebuild of the list per touch; a key
    removed (or inserted again elsewhere, which the primary tier never does)
    is searched for.
    """

    __slots__ = ("serial",)
    serial: int


def _group(serial: int, keys: Iterable[ChunkKey] = ()) -> _Group:
    # Not an __init__: a group is made per request, and a Python-level
    # constructor costs more than the rest of making it.
    group = _Group(keys)
    group.serial = serial
    return group
