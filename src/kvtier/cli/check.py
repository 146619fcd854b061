"""``kvtier check CONFIG``: validate, build every tier, round-trip chunks through each."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.config import load_config
from kvtier.errors import KVTierError
from kvtier.keys import chunk_keys
from kvtier.layout import KVLayout
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.tiers.base import HealthCheck, Lookup, SecondaryTier, TransferJob
from kvtier.tiers.drive import resolve_lookup, run_job


def probe_layout(chunk_tokens: int, slot_kib: int) -> KVLayout:
    """A synthetic layout whose chunks are ``slot_kib`` KiB (for tools without an engine)."""
    # uint8, one layer, one head: K and V take 2 bytes per token per head_dim unit.
    per_token = max(1, slot_kib * 1024 // chunk_tokens // 2)
    return KVLayout(
        model_id="kvtier-probe",
        num_layers=1,
        num_kv_heads=1,
        head_dim=per_token,
        dtype="uint8",
        chunk_tokens=chunk_tokens,
    )


@dataclass
class _Outcome:
    ok: bool
    detail: str
    mb_per_s: float = 0.0


def round_trip(
    tier: SecondaryTier, slots: np.ndarray, layout: KVLayout, chunks: int, timeout: float
) -> _Outcome:
    """Store ``chunks`` random chunks, look them up, load them back, compare bytes."""
    rng = np.random.default_rng()
    tokens = rng.integers(0, 2**31, chunks * layout.chunk_tokens)
    keys = chunk_keys(layout.namespace, tokens, layout.chunk_tokens)
    if not tier.holds_stores:
        # Nothing to round-trip: check that lookups of unknown chunks resolve.
        answers = [resolve_lookup(tier, key, timeout=timeout) for key in keys]
        if any(answer is not Lookup.MISS for answer in answers):
            return _Outcome(False, f"unknown chunks found: {[a.value for a in answers]}")
        return _Outcome(True, "lookups answered (the tier keeps no stores)")
    expected = rng.integers(0, 256, (chunks, slots.shape[1]), dtype=np.uint8)
    slots[:chunks] = expected
    index = tuple(range(chunks))
    started = time.perf_counter()
    stored = run_job(tier, TransferJob(tuple(keys), index), loading=False, timeout=timeout)
    if not stored.success:
        return _Outcome(False, f"store failed for {chunks - len(stored.succeeded)}/{chunks} chunks")
    tier.drain()
    answers = [resolve_lookup(tier, key, timeout=timeout) for key in keys]
    if any(answer is not Lookup.HIT for answer in answers):
        return _Outcome(False, f"stored chunks not found: {[a.value for a in answers]}")
    slots[:chunks] = 0
    loaded = run_job(tier, TransferJob(tuple(keys), index), loading=True, timeout=timeout)
    seconds = time.perf_counter() - started
    if not loaded.success:
        return _Outcome(False, f"load failed for {chunks - len(loaded.succeeded)}/{chunks} chunks")
    if not np.array_equal(slots[:chunks], expected):
        return _Outcome(False, "loaded bytes differ from stored bytes")
    return _Outcome(True, "byte-exact", 2 * expected.nbytes / seconds / 1e6)


def _health(tier: SecondaryTier) -> list[HealthCheck]:
    """The tier's own checks; a hook that raises is one failed check."""
    try:
        return list(tier.health())
    except Exception as exc:
        return [HealthCheck("health", False, f"{type(exc).__name__}: {exc}")]


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--chunks", default=4, show_default=True, help="Chunks to round-trip per tier.")
@click.option("--chunk-kib", default=256, show_default=True, help="Size of each probe chunk.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds allowed per tier step.")
def check(config: Path, chunks: int, chunk_kib: int, timeout: float) -> None:
    """Validate CONFIG, start every tier, run its health checks, and round-trip
    chunks through each one.

    Exits non-zero if the configuration is invalid or any tier fails a check.
    """
    console = Console()
    try:
        settings = load_config(config)
    except KVTierError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    layout = probe_layout(settings.chunk_tokens, chunk_kib)
    # Only the slots the probe needs, private whatever the configuration says
    # about shared memory: a check must never map a running engine's slots.
    settings = settings.model_copy(
        update={"cpu_bytes_to_use": chunks * layout.slot_bytes, "shared_memory_name": None}
    )
    try:
        manager = OffloadingSpecFactory.create_spec(settings, layout).build_manager()
    except Exception as exc:
        click.echo(f"cannot start the tiers: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    table = Table(title=f"kvtier check {config}")
    for column in ("#", "type", "check", "result", "detail"):
        table.add_column(column)
    failures = 0
    try:
        slots = manager.primary.buffer.array
        for index, tier in enumerate(manager.tiers):
            rows = [(c.name, c.ok, c.detail) for c in _health(tier)]
            try:
                outcome = round_trip(tier, slots, layout, min(chunks, slots.shape[0]), timeout)
            except Exception as exc:
                outcome = _Outcome(False, f"{type(exc).__name__}: {exc}")
            detail = outcome.detail + (f", {outcome.mb_per_s:.0f} MB/s" if outcome.ok else "")
            rows.append(("round trip", outcome.ok, detail))
            for name, ok, text in rows:
                failures += not ok
                result = "[green]ok[/green]" if ok else "[red]FAILED[/red]"
                table.add_row(str(index), tier.tier_type, name, result, escape(text))
            facts = ", ".join(f"{k}={v}" for k, v in tier.describe().items() if k != "type")
            if facts:
                table.add_row(str(index), tier.tier_type, "backend", "", escape(facts))
            table.add_section()
    finally:
        manager.shutdown()
    if not manager.tiers:
        console.print("configuration is valid; it names no secondary tiers")
    else:
        console.print(table)
    sys.exit(1 if failures else 0)
