"""Replaying a CPU primary tier with one evicting secondary tier behind it,
moving chunks as the manager does, with every transfer finished before the
next request.

See docs/cli.md, ``kvtier simulate``, 'With a secondary tier', for the model
and what it leaves out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy
from kvtier.sim.replay import Advance, PrimaryReplay
from kvtier.sim.trace import Request


@dataclass(frozen=True)
class CascadeResult:
    """One primary policy and capacity, with one secondary tier, over one trace."""

    policy: str
    capacity: int
    secondary_capacity: int
    primary_hits: int
    secondary_hits: int
    chunks: int

    @property
    def hit_ratio(self) -> float:
        return (self.primary_hits + self.secondary_hits) / self.chunks if self.chunks else 0.0

    @property
    def primary_hit_ratio(self) -> float:
        return self.primary_hits / self.chunks if self.chunks else 0.0

    @property
    def secondary_hit_ratio(self) -> float:
        return self.secondary_hits / self.chunks if self.chunks else 0.0


class CascadeReplay(PrimaryReplay):
    """A primary tier under ``policy`` and an LRU secondary tier of ``secondary_capacity``."""

    def __init__(self, policy: CachePolicy, secondary_capacity: int) -> None:
        if secondary_capacity < 1:
            raise ValueError(f"secondary_capacity must be positive, got {secondary_capacity}")
        super().__init__(policy)
        self.secondary_capacity = secondary_capacity
        #: The secondary tier's chunks, least recently stored or loaded first.
        self.secondary: OrderedDict[int, None] = OrderedDict()

    def request(self, blocks: Sequence[int]) -> int:
        """Replay one request; returns its hits in both tiers (see :meth:`request_by_tier`)."""
        primary_hits, secondary_hits = self.request_by_tier(blocks)
        return primary_hits + secondary_hits

    def request_by_tier(self, blocks: Sequence[int]) -> tuple[int, int]:
        """Replay one request; returns its hits served by the primary and by the secondary tier."""
        policy, resident, secondary = self.policy, self.resident, self.secondary
        keys: list[ChunkKey] = blocks  # type: ignore[assignment]  # any hashable will do
        leading = 0
        for block in blocks:
            if block not in resident:
                break
            leading += 1
        if leading:
            policy.touch(keys[:leading])
        promoted: list[int] = []
        hits = leading
        chain = set(keys)
        for block in blocks[leading:]:
            if block not in resident:
                if block not in secondary:
                    break
                if len(resident) + len(promoted) >= self.slots:
                    victims = policy.evict(1, chain)
                    if victims is None:  # no room to promote into: a miss
                        break
                    resident.difference_update(victims)
                promoted.append(block)
            hits += 1
        for block in promoted:
            resident.add(block)
            policy.insert(block)  # type: ignore[arg-type]
            secondary.move_to_end(block)
        if promoted:
            policy.touch(keys[leading:hits])
        self._write_through(self.store(blocks))
        return hits - len(promoted), len(promoted)

    def _write_through(self, written: list[int]) -> None:
        """The secondary tier's store of the chunks the primary tier just wrote.

        The tier skips what it holds when the job is submitted, without
        refreshing it, so the job's own writes may then evict a chunk it
        skipped: its room is made among all it holds, oldest first. Of a job
        larger than the whole tier, only its last chunks stay.
        """
        secondary, capacity = self.secondary, self.secondary_capacity
        new = [block for block in dict.fromkeys(written) if block not in secondary][-capacity:]
        for _ in range(len(secondary) + len(new) - capacity):  # none when it all fits
            secondary.popitem(last=False)
        for block in new:
            secondary[block] = None


def replay_cascade(
    requests: Sequence[Request],
    policy: CachePolicy,
    name: str,
    secondary_capacity: int,
    advance: Advance | None = None,
) -> CascadeResult:
    """Hits per tier of ``policy`` (fresh) in front of a secondary tier, over ``requests``."""
    cascade = CascadeReplay(policy, secondary_capacity)
    primary_hits = secondary_hits = chunks = 0
    for request in requests:
        in_primary, in_secondary = cascade.request_by_tier(request.blocks)
        primary_hits += in_primary
        secondary_hits += in_secondary
        chunks += len(request.blocks)
        if advance is not None:
            advance()
    return CascadeResult(
        name, policy.capacity, secondary_capacity, primary_hits, secondary_hits, chunks
    )
