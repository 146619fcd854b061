"""The demo's closing tables: time to first token by where the prefix came from,
and what each tier served, stored and holds."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from rich.table import Table

from kvtier.demo.workload import DemoRun, RequestRecord
from kvtier.status import CacheStatus
from kvtier.units import format_bytes


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


@dataclass(frozen=True)
class PathSummary:
    """Requests of one kind (no kvtier, miss, a hit in some tier) taken together."""

    label: str
    requests: int
    prompt_tokens: int
    reused_tokens: int
    mean_ttft_s: float
    #: Mean time to first token of the same requests without kvtier.
    baseline_ttft_s: float

    @property
    def speedup(self) -> float:
        """How many times faster than the same requests without kvtier (means)."""
        return self.baseline_ttft_s / self.mean_ttft_s if self.mean_ttft_s else float("inf")

    @property
    def is_hit(self) -> bool:
        return self.reused_tokens > 0


def summarise(run: DemoRun, tier_types: list[str]) -> list[PathSummary]:
    """The baseline first, then the kvtier requests grouped by the source of their prefix."""
    baseline = {(r.conversation, r.turn): r.ttft_s for r in run.baseline}
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in run.kvtier + (run.refetch or []):
        groups[record.source(tier_types)].append(record)
    labels = {"miss": "kvtier: miss, prefill + store", "CPU": "kvtier: CPU-tier hit"}
    for tier in tier_types:
        labels[f"CPU+{tier}"] = f"kvtier: CPU + {tier}-tier hit"
        labels[tier] = f"kvtier: {tier}-tier hit *"
    rows = [_summary("no kvtier: full prefill", run.baseline, baseline)]
    for source, label in labels.items():
        if groups.get(source):
            rows.append(_summary(label, groups[source], baseline))
    return rows


def _summary(
    label: str, records: list[RequestRecord], baseline: dict[tuple[int, int], float]
) -> PathSummary:
    ttft = sum(r.ttft_s for r in records)
    reference = sum(baseline[(r.conversation, r.turn)] for r in records)
    return PathSummary(
        label=label,
        requests=len(records),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        reused_tokens=sum(r.reused_tokens for r in records),
        mean_ttft_s=ttft / len(records),
        baseline_ttft_s=reference / len(records),
    )


def ttft_table(rows: list[PathSummary]) -> Table:
    table = Table(
        title="Time to first token",
        caption="speed-up: mean TTFT of the same requests without kvtier ÷ with it\n"
        "* the CPU tier was empty: every reused chunk came from that tier",
    )
    table.add_column("path")
    for column in ("requests", "tokens reused", "mean TTFT", "without kvtier", "speed-up"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.label,
            str(row.requests),
            f"{row.reused_tokens:,} of {row.prompt_tokens:,}",
            _seconds(row.mean_ttft_s),
            _seconds(row.baseline_ttft_s),
            f"{row.speedup:.1f}×",
        )
    return table


def slow_hits_note(rows: list[PathSummary]) -> str | None:
    """Why reuse can lose on a model this small, when it did; ``None`` otherwise."""
    slow = [row for row in rows if row.is_hit and row.speedup < 1]
    if not slow:
        return None
    fastest = min(row.baseline_ttft_s for row in rows)
    return (
        f"reuse did not pay off on this model: a full prefill takes about "
        f"{_seconds(fastest)}, less than finding and copying its chunks. The --quick "
        "model is that small so the demo runs in seconds; the default model (or "
        "--model with a real one) shows what reuse saves."
    )


def tier_table(run: DemoRun, status: CacheStatus, slot_bytes: int) -> Table:
    """Per tier, over the kvtier phases: chunks served, hit rate, bytes."""
    records = run.kvtier + (run.refetch or [])
    table = Table(title="Tiers: chunks and bytes over the kvtier phases")
    table.add_column("tier")
    for column in ("chunks served", "hit rate", "served", "stored", "held"):
        table.add_column(column, justify="right")
    served = sum(r.primary_hit_chunks for r in records)
    asked = sum(r.full_chunks for r in records)
    written = sum(r.stored_chunks + sum(r.promoted_chunks) for r in records)
    table.add_row(
        "CPU (primary)",
        f"{served:,}",
        _rate(served, asked),
        format_bytes(served * slot_bytes),
        format_bytes(written * slot_bytes),
        format_bytes(status.primary.held_bytes),
    )
    for index, tier in enumerate(status.tiers):
        served = sum(r.promoted_chunks[index] for r in records)
        # A tier is asked for the prompt chunks that the tiers in front of it lacked.
        asked = sum(
            r.full_chunks - r.primary_hit_chunks - sum(r.promoted_chunks[:index]) for r in records
        )
        held = tier.held_bytes if tier.held_bytes is not None else tier.facts.get("held_bytes")
        table.add_row(
            f"{index}: {tier.tier_type}",
            f"{served:,}",
            _rate(served, asked),
            format_bytes(tier.stats["bytes_loaded"]),
            format_bytes(tier.stats["bytes_stored"]),
            format_bytes(held) if isinstance(held, int) else "-",
        )
    return table


def _rate(hits: int, asked: int) -> str:
    return f"{hits / asked:.0%}" if asked else "-"
