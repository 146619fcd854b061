"""The cache policy contract: which idle primary slot to give up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import filterfalse
from typing import Any

from kvtier.keys import ChunkKey

Clock = Callable[[], float]


class CachePolicy(ABC):
    """Tracks the keys resident in the primary tier and picks eviction victims.

    Policies see keys only, never bytes or slots. The primary tier calls them
    under its own lock, so implementations need no locking of their own.
    ``clock`` and ``rng`` are injected so that policies which use time or
    randomness stay deterministic under test.
    """

    def __init__(self, capacity: int, *, clock: Clock | None = None, rng: Any = None) -> None:
        if capacity <= 0:
            raise ValueError(f"cache policy capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self.rng = rng

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
