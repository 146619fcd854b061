"""kvtier's counters in vLLM's own connector statistics.

vLLM asks the scheduler-side connector for its stats every step, sums them
across reports with :meth:`KVTierConnectorStats.aggregate`, and logs the
total of each interval (``KV Transfer metrics: ...``). kvtier reports what
changed since the previous report: the connector's own counters, the
primary tier's hits (``primary_hits``) and, per tier,
``tier<i>_<type>_<counter>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.status import CacheStatus


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counter deltas; aggregating sums them."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return KVTierConnectorStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def totals(connector: Mapping[str, int], status: CacheStatus) -> dict[str, int]:
    """Every reported counter's value since the engine started."""
    values = dict(connector)
    values["primary_hits"] = status.primary.hits
    for index, (tier_type, stats) in enumerate(status.tier_stats()):
        for name, value in stats.items():
            values[f"tier{index}_{tier_type}_{name}"] = value
    return values


class StatsDeltas:
    """Turns running totals into what changed since the last call."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, current: Mapping[str, int]) -> KVTierConnectorStats | None:
        delta = {
            k: v - self._last.get(k, 0) for k, v in current.items() if v != self._last.get(k, 0)
        }
        self._last = dict(current)
        return KVTierConnectorStats(delta) if delta else None
