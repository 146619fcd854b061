"""Replaying a trace across replicas: what routing by kvtier's scores is worth
against round-robin and first-chunk routers, in hit ratio and load.

See docs/fleet.md, 'What routing is worth, simulated'.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.policies.base import CachePolicy
from kvtier.sim.cascade import CascadeReplay
from kvtier.sim.replay import Advance, PrimaryReplay
from kvtier.sim.trace import Request

ROUTERS = ("round-robin", "first-chunk", "kvtier")


@dataclass(frozen=True)
class RoutingResult:
    """One router over one trace, at one replica count."""

    router: str
    replicas: int
    chunks: int
    primary_hits: int
    shared_hits: int
    requests_per_replica: tuple[int, ...]
    misses_per_replica: tuple[int, ...]

    @property
    def hit_ratio(self) -> float:
        return (self.primary_hits + self.shared_hits) / self.chunks if self.chunks else 0.0

    @property
    def primary_hit_ratio(self) -> float:
        return self.primary_hits / self.chunks if self.chunks else 0.0

    @staticmethod
    def _peak(loads: Sequence[int]) -> float:
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 0.0

    @property
    def request_peak(self) -> float:
        """Requests of the busiest replica over the mean (1.0: perfectly even)."""
        return self._peak(self.requests_per_replica)

    @property
    def prefill_peak(self) -> float:
        """Chunks to prefill on the busiest replica over the mean."""
        return self._peak(self.misses_per_replica)


class _LoadWindow:
    """Requests each replica took among the last ``size`` routed."""

    def __init__(self, replicas: int, size: int) -> None:
        self.loads = [0] * replicas
        self.recent: deque[int] = deque()
        self.size = size

    def add(self, replica: int) -> None:
        self.recent.append(replica)
        self.loads[replica] += 1
        if len(self.recent) > self.size:
            self.loads[self.recent.popleft()] -= 1


def first_chunk_replica(blocks: Sequence[int], replicas: int) -> int:
    """The replica a hash of the first chunk names (stable across processes)."""
    digest = hashlib.blake2b(str(blocks[0]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % replicas


def leading_run(replica: PrimaryReplay, blocks: Sequence[int]) -> int:
    resident = replica.resident
    run = 0
    for block in blocks:
        if block not in resident:
            break
        run += 1
    return run


def replay_routed(
    requests: Sequence[Request],
    new_policy: Callable[[], CachePolicy],
    replicas: int,
    router: str,
    *,
    shared_capacity: int | None = None,
    slack: float = 0.25,
    window: int | None = None,
    advance: Advance | None = None,
) -> RoutingResult:
    """Replay ``requests`` over ``replicas`` replicas (each a fresh ``new_policy()``)."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; one of {', '.join(ROUTERS)}")
    if replicas < 1:
        raise ValueError(f"replicas must be positive, got {replicas}")
    fleet: list[PrimaryReplay]
    if shared_capacity is None:
        fleet = [PrimaryReplay(new_policy()) for _ in range(replicas)]
    else:
        shared: OrderedDict[int, None] = OrderedDict()
        cascades = [CascadeReplay(new_policy(), shared_capacity) for _ in range(replicas)]
        for cascade in cascades:
            cascade.secondary = shared  # one tier behind every replica
        fleet = list(cascades)
    load = _LoadWindow(replicas, window or 8 * replicas)
    cap = math.ceil(load.size / replicas * (1 + slack))
    requests_per = [0] * replicas
    misses_per = [0] * replicas
    primary_hits = shared_hits = chunks = 0
    for number, request in enumerate(requests):
        blocks = request.blocks
        if router == "round-robin":
            chosen = number % replicas
        elif router == "first-chunk":
            chosen = first_chunk_replica(blocks, replicas) if blocks else number % replicas
        else:
            chosen = max(
                (r for r in range(replicas) if load.loads[r] < cap),
                key=lambda r: (leading_run(fleet[r], blocks), -load.loads[r], -r),
            )
        replica = fleet[chosen]
        if isinstance(replica, CascadeReplay):
            from_primary, from_shared = replica.request_by_tier(blocks)
        else:
            from_primary, from_shared = replica.request(blocks), 0
        primary_hits += from_primary
        shared_hits += from_shared
        chunks += len(blocks)
        requests_per[chosen] += 1
        misses_per[chosen] += len(blocks) - from_primary - from_shared
        load.add(chosen)
        if advance is not None:
            advance()
    return RoutingResult(
        router,
        replicas,
        chunks,
        primary_hits,
        shared_hits,
        tuple(requests_per),
        tuple(misses_per),
    )
