"""What a running :class:`~kvtier.KVCache` holds and how its tiers fare, read-only.

``cache.status`` is the documented way to watch a cache (operators, tests,
engine statistics) without reaching into the manager or the primary tier.
Each property reads a fresh snapshot; nothing here changes the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck

if TYPE_CHECKING:
    from kvtier.manager import TieringManager

__all__ = ["CacheStatus", "PrimaryStatus", "TierStatus"]


@dataclass(frozen=True)
class PrimaryStatus:
    """The CPU primary tier: its slots by state, and what happened to them."""

    num_slots: int
    slot_bytes: int
    #: Slots holding nothing.
    free: int
    #: Slots holding a chunk no one reads: the ones eviction may take.
    idle: int
    #: Slots read now (an engine load, a cascade, a peer sending them).
    pinned: int
    #: Slots being written.
    writing: int
    #: Slots out of use: the memory for them ran out (a full ``/dev/shm``).
    retired: int
    #: Chunks lookups found here.
    hits: int
    evictions: int

    @property
    def chunks(self) -> int:
        """Chunks held or being written."""
        return self.idle + self.pinned + self.writing

    @property
    def held_bytes(self) -> int:
        return self.chunks * self.slot_bytes


@dataclass(frozen=True)
class TierStatus:
    """One secondary tier, in configuration order."""

    index: int
    tier_type: str
    #: The tier's counters (:class:`~kvtier.tiers.base.TierStats` as a dict).
    stats: dict[str, int]
    #: Bytes the tier holds, where it keeps count (``None`` where it does not).
    held_bytes: int | None
    #: Chunks the tier holds, where it keeps count.
    chunk_count: int | None
    #: What the tier says of itself (backend, paths, modes: ``describe()``).
    facts: dict[str, object]


class CacheStatus:
    """The read-only view of a :class:`~kvtier.KVCache` (its ``status``)."""

    def __init__(self, manager: TieringManager) -> None:
        self._manager = manager

    @property
    def primary(self) -> PrimaryStatus:
        primary = self._manager.primary
        return PrimaryStatus(
            num_slots=primary.num_slots,
            slot_bytes=primary.buffer.slot_bytes,
            hits=primary.hits,
            evictions=primary.evictions,
            **primary.busy_counts(),
        )

    @property
    def tiers(self) -> tuple[TierStatus, ...]:
        return tuple(
            TierStatus(
                index=index,
                tier_type=tier.tier_type,
                stats=tier.stats.as_dict(),
                held_bytes=getattr(tier, "held_bytes", None),
                chunk_count=getattr(tier, "chunk_count", None),
                facts=tier.describe(),
            )
            for index, tier in enumerate(self._manager.tiers)
        )

    def tier_stats(self) -> list[tuple[str, dict[str, int]]]:
        """Each secondary tier's type and counters, in order: the part of
        :attr:`tiers` cheap enough to read every engine step."""
        return [(tier.tier_type, tier.stats.as_dict()) for tier in self._manager.tiers]

    @property
    def tier_types(self) -> list[str]:
        return [tier.tier_type for tier in self._manager.tiers]

    @property
    def busy(self) -> bool:
        """Whether a transfer or a promotion is still in flight."""
        return self._manager.busy

    def slot_states(self) -> dict[ChunkKey, int]:
        """Each resident chunk's reference count: ``-1`` while written, ``0``
        idle, ``n`` read by ``n`` readers (a snapshot)."""
        return dict(self._manager.primary.refcounts())

    def holds(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key: whether the primary tier holds the chunk (ready or being written)."""
        primary = self._manager.primary
        return [primary.slot_of(key) is not None for key in keys]

    def health(self) -> list[tuple[str, Sequence[HealthCheck]]]:
        """Each tier's type and its health checks. May block briefly: the
        checks reach the backends (as ``kvtier check`` does)."""
        return [(tier.tier_type, tier.health()) for tier in self._manager.tiers]
