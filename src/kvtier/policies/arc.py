"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003)."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy, unprotected


class ARCCachePolicy(CachePolicy):
    """Balances recency against frequency, learning the balance from its mistakes.

    Resident keys live in ``T1`` (seen once) or ``T2`` (seen again). Evicted
    keys leave a ghost in ``B1`` or ``B2``. Re-inserting a ghost means the
    eviction was a mistake, so the target size :attr:`p` of ``T1`` moves
    toward the list that would have kept it. A one-time scan only ever fills
    ``T1``, so keys in ``T2`` outlive it.
    """

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        # Every list is ordered oldest first; values unused.
        self._t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b2: OrderedDict[ChunkKey, None] = OrderedDict()
        #: Target size of ``T1``, between 0 and ``capacity``.
        self.p = 0

    def get(self, key: ChunkKey) -> bool:
        if key in self._t1:
            # A second access: the key has shown it is reused.
            del self._t1[key]
            self._t2[key] = None
            return True
        if key in self._t2:
            self._t2.move_to_end(key)
            return True
        return False

    def insert(self, key: ChunkKey) -> None:
        self.insert_all((key,))

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        # Every new chunk of the primary tier comes through here: compiled
        # where kvtier was built with a C compiler.
        self.p = active.insert_all(
            self._t1, self._t2, self._b1, self._b2, keys, self.p, self.capacity
        )

    def remove(self, key: ChunkKey) -> None:
        # Not an eviction, so no ghost: its return would teach nothing.
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        # ``get`` inlined: the primary tier touches every hit of every request.
        t1, t2 = self._t1, self._t2
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            # Mostly keys seen again already, all in T2: one C-level pass.
            deque(map(t2.move_to_end, keys), maxlen=0)
            return
        except KeyError:
            # A key in T1 or untracked stopped it part-way: the whole touch again,
            # key by key, leaves the order one pass leaves (each key moved
            # once more, in order, behind the rest).
            pass
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        # ARC's REPLACE, once per victim: take from T1 while it is over its
        # target p, else from T2; from the other list when protected keys
        # exhaust one. Only taking from T1 moves the comparison, so the victims
        # are, in order: the oldest of T1 down to its target, then the oldest
        # of T2, then (T2 exhausted) more of T1. Chosen before anything
        # changes, so a shortfall changes nothing.
        t1, t2 = self._t1, self._t2
        from_t1 = unprotected(t1, protected)
        over_target = min(n, max(0, len(t1) - self.p))
        first = list(itertools.islice(from_t1, over_target))
        if len(first) == n:  # the usual case: all from T1, so T2 need not be looked at
            active.demote(t1, t2, self._b1, self._b2, first, (), self.capacity)
            return first
        from_t2 = list(itertools.islice(unprotected(t2, protected), n - len(first)))
        then_t1 = []
        if len(first) == over_target:  # else T1 ran out: T2 was all that was left
            then_t1 = list(itertools.islice(from_t1, n - len(first) - len(from_t2)))
        if len(first) + len(from_t2) + len(then_t1) < n:
            return None
        active.demote(t1, t2, self._b1, self._b2, first + then_t1, from_t2, self.capacity)
        return first + from_t2 + then_t1

    def clear(self) -> None:
        for entries in (self._t1, self._t2, self._b1, self._b2):
            entries.clear()
        self.p = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


Entries = OrderedDict[ChunkKey, None]


def _trim_ghosts(t1: Entries, t2: Entries, b1: Entries, b2: Entries, capacity: int) -> None:
    """ARC's directory bounds: ``|T1| + |B1| <= c`` and all four lists ``<= 2c``."""
    excess = len(t1) + len(b1) - capacity
    while excess > 0 and b1:
        b1.popitem(False)  # positional: a keyword costs more than the pop
        excess -= 1
    excess = len(t1) + len(t2) + len(b1) + len(b2) - 2 * capacity
    while excess > 0 and b2:
        b2.popitem(False)
        excess -= 1


def _insert_all(
    t1: Entries,
    t2: Entries,
    b1: Entries,
    b2: Entries,
    keys: Sequence[ChunkKey],
    p: int,
    capacity: int,
) -> int:
    """ARC's insert of each key, in order; returns the new target size ``p`` of T1.

    A run of keys seen nowhere has its ghosts trimmed once, before the next
    other key: the lists only grow through the run, so one trim pops exactly
    the ghosts a trim after each key would have.
    """
    untrimmed = False
    for key in keys:
        if key in b1:  # evicted from T1 too early: T1 deserved more room
            if untrimmed:  # the next key sees the lists as trimmed after each key
                _trim_ghosts(t1, t2, b1, b2, capacity)
                untrimmed = False
            if key in b1:  # the trim may have dropped its ghost: then it is new
                step = len(b2) // len(b1)
                p = min(capacity, p + (step if step > 1 else 1))
                del b1[key]
                t2[key] = None
                continue
        elif key in b2:  # evicted from T2 too early: T2 deserved more room
            if untrimmed:
                _trim_ghosts(t1, t2, b1, b2, capacity)
                untrimmed = False
            if key in b2:
                step = len(b1) // len(b2)
                p = max(0, p - (step if step > 1 else 1))
                del b2[key]
                t2[key] = None
                continue
        elif key in t1 or key in t2:  # a hit: it leaves p alone
            if untrimmed:  # a hit shrinks T1 + B1: the trim before it pops more
                _trim_ghosts(t1, t2, b1, b2, capacity)
                untrimmed = False
            if key in t1:  # seen again: the key has shown it is reused
                del t1[key]
                t2[key] = None
            else:
                t2.move_to_end(key)
            continue
        # Only a new key grows the directory; a ghost hit just moves one.
        t1[key] = None
        untrimmed = True
    if untrimmed:
        _trim_ghosts(t1, t2, b1, b2, capacity)
    return p


def _demote(
    t1: Entries,
    t2: Entries,
    b1: Entries,
    b2: Entries,
    from_t1: Sequence[ChunkKey],
    from_t2: Sequence[ChunkKey],
    capacity: int,
) -> None:
    """Victims become the newest ghosts, in order: of ``B1`` from ``T1``, of
    ``B2`` from ``T2``; then the directory is trimmed (a policy tracking more
    keys than its capacity has ghosts to spare)."""
    for resident, ghosts, victims in ((t1, b1, from_t1), (t2, b2, from_t2)):
        for victim in victims:
            del resident[victim]
            ghosts[victim] = None
    _trim_ghosts(t1, t2, b1, b2, capacity)


class ARCSteps(NamedTuple):
    """One implementation of ARC's per-key steps."""

    insert_all: Callable[[Entries, Entries, Entries, Entries, Sequence[ChunkKey], int, int], int]
    demote: Callable[
        [Entries, Entries, Entries, Entries, Sequence[ChunkKey], Sequence[ChunkKey], int], None
    ]


#: Every implementation present, by name.
IMPLEMENTATIONS: dict[str, ARCSteps] = {"python": ARCSteps(_insert_all, _demote)}
try:
    from kvtier.policies._native import _steps
except ImportError:  # built without a C compiler
    IMPLEMENTATION = "python"
else:
    IMPLEMENTATIONS["compiled"] = ARCSteps(_steps.arc_insert_all, _steps.arc_demote)
    IMPLEMENTATION = "compiled"

#: The implementation every ARC policy runs.
active = IMPLEMENTATIONS[IMPLEMENTATION]
