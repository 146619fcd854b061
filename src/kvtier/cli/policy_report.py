"""``kvtier simulate`` (without ``--replicas``): each policy at each capacity, against MIN.

Builds the report ``--json`` prints (per capacity: every policy's hit ratio,
its ratio to Belady's MIN, the share of the LRU-to-MIN gap it closes; with a
secondary tier, the hits each tier serves) and the table drawn from it.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from kvtier.cli.replay_bar import replay_bar
from kvtier.policies.factory import CachePolicyFactory
from kvtier.sim.cascade import CascadeResult, replay_cascade
from kvtier.sim.replay import CellResult, belady_min, replay
from kvtier.sim.trace import Request, distinct_blocks


def run(
    requests: list[Request],
    policies: tuple[str, ...],
    slots: list[int],
    *,
    progress: bool,
    secondary: int | None = None,
    batch: int = 1,
    codec_ratio: float | None = None,
) -> dict[str, Any]:
    """Every policy and MIN at every capacity (and with a ``secondary`` tier of that
    many chunks behind the primary, and again with ``codec_ratio`` times as many:
    the same bytes under a codec), in engine steps of ``batch`` requests: the
    report ``--json`` prints."""
    if secondary is not None and batch > 1:
        raise ValueError("the cascade replays one request at a time: batch must be 1")
    distinct = distinct_blocks(requests)
    bar = replay_bar(progress)
    cells: list[dict[str, Any]] = []
    with bar:
        tiers = 1 + (secondary is not None) + (codec_ratio is not None)
        runs = len(slots) * (len(policies) * tiers + 1)
        task = bar.add_task("replaying", total=len(requests) * runs)

        def advance() -> None:
            bar.advance(task)

        for capacity in slots:
            optimum = belady_min(requests, capacity, advance, batch=batch)
            results = [
                replay(
                    requests,
                    CachePolicyFactory.create_cache_policy(name, capacity),
                    name,
                    advance,
                    batch=batch,
                )
                for name in policies
            ]
            cell = _cell(capacity, distinct, optimum, results)
            if secondary is not None:
                for name in policies:
                    cascade = replay_cascade(
                        requests,
                        CachePolicyFactory.create_cache_policy(name, capacity),
                        name,
                        secondary,
                        advance,
                    )
                    cell["policies"][name]["with_secondary"] = _cascade_entry(cascade)
                    if codec_ratio is not None:
                        coded = replay_cascade(
                            requests,
                            CachePolicyFactory.create_cache_policy(name, capacity),
                            name,
                            int(secondary * codec_ratio),
                            advance,
                        )
                        entry = _cascade_entry(coded)
                        entry["codec_ratio"] = codec_ratio
                        cell["policies"][name]["with_codec"] = entry
            cells.append(cell)
    return {
        "requests": len(requests),
        "chunks": sum(len(request.blocks) for request in requests),
        "distinct_chunks": distinct,
        "batch": batch,
        "capacities": cells,
    }


def _cell(
    capacity: int, distinct: int, optimum: CellResult, results: list[CellResult]
) -> dict[str, Any]:
    by_name = {result.policy: result.hit_ratio for result in results}
    lru = by_name.get("lru")
    policies = {}
    for name, ratio in by_name.items():
        entry: dict[str, Any] = {
            "hit_ratio": ratio,
            "of_min": ratio / optimum.hit_ratio if optimum.hit_ratio else None,
        }
        if lru is not None:
            gap = optimum.hit_ratio - lru
            # With no gap (MIN no better than lru) there is nothing to close.
            entry["gap_closed"] = (ratio - lru) / gap if gap > 0 else None
        policies[name] = entry
    return {
        "slots": capacity,
        "share": capacity / distinct,
        "min_hit_ratio": optimum.hit_ratio,
        "policies": policies,
    }


def _cascade_entry(result: CascadeResult) -> dict[str, Any]:
    return {
        "secondary_slots": result.secondary_capacity,
        "hit_ratio": result.hit_ratio,
        "primary_hit_ratio": result.primary_hit_ratio,
        "secondary_hit_ratio": result.secondary_hit_ratio,
    }


def policy_table(report: dict[str, Any]) -> Table:
    title = (
        f"kvtier simulate {report['trace']}: {report['requests']} requests, "
        f"{report['chunks']} chunks, {report['distinct_chunks']} distinct"
    )
    if report.get("batch", 1) > 1:
        title += f", {report['batch']} requests a step"
    columns = ["slots", "share", "policy", "hit ratio", "of MIN", "LRU-to-MIN gap closed"]
    first_cell = report["capacities"][0]["policies"]
    secondary = next(iter(first_cell.values())).get("with_secondary")
    if secondary is not None:
        title += f"; with a secondary tier of {secondary['secondary_slots']} chunks"
        columns += ["CPU hits", "secondary hits", "both"]
    coded = next(iter(first_cell.values())).get("with_codec")
    if coded is not None:
        title += (
            f" and the same bytes under a codec of ratio {coded['codec_ratio']:g} "
            f"({coded['secondary_slots']} chunks)"
        )
        columns += ["both, codec"]
    if secondary is not None:
        title += ":"
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for cell in report["capacities"]:
        first = True
        rows = [(name, entry) for name, entry in cell["policies"].items()]
        rows.append(("MIN", {"hit_ratio": cell["min_hit_ratio"], "of_min": 1.0}))
        for name, entry in rows:
            closed = entry.get("gap_closed")
            row = [
                str(cell["slots"]) if first else "",
                f"{cell['share']:.1%}" if first else "",
                name,
                f"{entry['hit_ratio']:.3f}",
                f"{entry['of_min']:.2f}" if entry["of_min"] is not None else "-",
                f"{closed:.1%}" if closed is not None else "-",
            ]
            if secondary is not None:
                tiers = entry.get("with_secondary")
                row += (
                    ["-"] * 3
                    if tiers is None
                    else [
                        f"{tiers['primary_hit_ratio']:.3f}",
                        f"{tiers['secondary_hit_ratio']:.3f}",
                        f"{tiers['hit_ratio']:.3f}",
                    ]
                )
            if coded is not None:
                with_codec = entry.get("with_codec")
                row.append("-" if with_codec is None else f"{with_codec['hit_ratio']:.3f}")
            table.add_row(*row)
            first = False
        table.add_section()
    return table
