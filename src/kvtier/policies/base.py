"""The cache policy contract: which idle primary slot to give up."""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import filterfalse

from kvtier.keys import ChunkKey

Clock = Callable[[], float]


class CachePolicy(ABC):
    """Tracks the keys resident in the primary tier and picks eviction victims.

    Policies see keys only, never bytes or slots. The primary tier calls them
    under its own lock, so implementations need no locking of their own.

    A policy that uses time or randomness takes them from :attr:`clock` and
    :attr:`rng`, never from :mod:`time` or :mod:`random` directly: both always
    work (kvtier builds policies with the defaults), and a test injects its
    own to make the policy's choices reproducible.
    """

    def __init__(
        self, capacity: int, *, clock: Clock | None = None, rng: random.Random | None = None
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"cache policy capacity must be positive, got {capacity}")
        self.capacity = capacity
        #: Seconds, only ever increasing; default :func:`time.monotonic`.
        self.clock: Clock = clock if clock is not None else time.monotonic
        #: Default: a :class:`random.Random` seeded from the OS's entropy.
        self.rng: random.Random = rng if rng is not None else random.Random()

    @abstractmethod
    def get(self, key: ChunkKey) -> bool:
        """Whether ``key`` is tracked; a hit counts as an access."""

    @abstractmethod
    def insert(self, key: ChunkKey) -> None:
        """Start tracking ``key`` (newly resident in the primary tier)."""

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        """:meth:`insert` each of ``keys``, in order (the primary tier's batches).

        Override only with an exact, faster equivalent.
        """
        for key in keys:
            self.insert(key)

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """Stop tracking ``key`` (dropped for a reason other than eviction)."""

    @abstractmethod
    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Record an access to each tracked key in ``keys``, in order."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        """Choose and forget ``n`` victims outside ``protected``.

        Atomic: either all ``n`` victims are returned and forgotten, or
        ``None`` is returned and nothing changed.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every key (and any history such as ghost entries)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked (resident) keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked, without counting an access."""


def unprotected(entries: Iterable[ChunkKey], protected: Collection[ChunkKey]) -> Iterator[ChunkKey]:
    """Keys of ``entries`` (in their order: oldest first) outside ``protected``."""
    return filterfalse(protected.__contains__, entries)  # C-level for a set


def size_bound(protected: Collection[ChunkKey]) -> int:
    """An upper bound on ``len(protected)``, in constant time where ``len`` is not.

    A collection whose exact length costs a pass over it (the primary tier's
    view of the keys an eviction must spare, a union of its parts) offers a
    cheap bound as a ``size_bound()`` method; any other collection's ``len``.
    For a policy's shortcut when plenty of keys are evictable.
    """
    bound = getattr(protected, "size_bound", None)
    return len(protected) if bound is None else int(bound())
