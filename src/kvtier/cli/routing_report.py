"""``kvtier simulate --replicas``: hit ratio and load of each router at each replica count."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from kvtier.cli.replay_bar import replay_bar
from kvtier.policies.factory import CachePolicyFactory
from kvtier.sim.routing import ROUTERS, RoutingResult, replay_routed
from kvtier.sim.trace import Request


def run_routing(
    requests: list[Request],
    policy: str,
    replica_slots: int,
    replica_counts: tuple[int, ...],
    routers: tuple[str, ...] = ROUTERS,
    *,
    shared_slots: int | None = None,
    slack: float = 0.25,
    progress: bool,
) -> dict[str, Any]:
    """Every router at every replica count: the report ``--json`` prints."""
    bar = replay_bar(progress)
    rows: list[dict[str, Any]] = []
    with bar:
        task = bar.add_task("routing", total=len(requests) * len(replica_counts) * len(routers))
        for replicas in replica_counts:
            for router in routers:
                result = replay_routed(
                    requests,
                    lambda: CachePolicyFactory.create_cache_policy(policy, replica_slots),
                    replicas,
                    router,
                    shared_capacity=shared_slots,
                    slack=slack,
                    advance=lambda: bar.advance(task),
                )
                rows.append(_row(result))
    return {
        "requests": len(requests),
        "policy": policy,
        "replica_slots": replica_slots,
        "shared_slots": shared_slots,
        "slack": slack,
        "results": rows,
    }


def _row(result: RoutingResult) -> dict[str, Any]:
    return {
        "replicas": result.replicas,
        "router": result.router,
        "hit_ratio": result.hit_ratio,
        "primary_hit_ratio": result.primary_hit_ratio,
        "request_peak": result.request_peak,
        "prefill_peak": result.prefill_peak,
        "requests_per_replica": list(result.requests_per_replica),
    }


def routing_table(report: dict[str, Any]) -> Table:
    shared = report["shared_slots"]
    title = (
        f"kvtier simulate {report['trace']}: {report['requests']} requests; "
        f"{report['replica_slots']} {report['policy']} slots per replica"
        + (f", a shared tier of {shared}" if shared else "")
    )
    table = Table(title=title)
    columns = ["replicas", "router", "hit ratio", "busiest/mean requests", "busiest/mean prefill"]
    if shared:
        columns.insert(3, "of which CPU")
    for column in columns:
        table.add_column(column, justify="left" if column == "router" else "right")
    last = None
    for row in report["results"]:
        if last is not None and row["replicas"] != last:
            table.add_section()
        cells = [
            str(row["replicas"]) if row["replicas"] != last else "",
            row["router"],
            f"{row['hit_ratio']:.3f}",
            f"{row['request_peak']:.2f}",
            f"{row['prefill_peak']:.2f}",
        ]
        if shared:
            cells.insert(3, f"{row['primary_hit_ratio']:.3f}")
        table.add_row(*cells)
        last = row["replicas"]
    return table
