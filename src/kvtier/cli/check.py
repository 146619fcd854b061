"""``kvtier check CONFIG``: validate, build every tier, round-trip chunks through each."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.cli.memory import refuse_beyond_memory
from kvtier.cli.options import POSITIVE, Seconds, config_argument
from kvtier.cli.probe import PHASES, bench_tier, codec_facts, needs_floats, probe_layout
from kvtier.config import load_config
from kvtier.errors import KVTierError, describe_error
from kvtier.keys import chunk_keys
from kvtier.layout import KVLayout
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.tiers.base import HealthCheck, Lookup, SecondaryTier
from kvtier.tiers.deadlines import CallTimeout, call_within
from kvtier.tiers.drive import resolve_lookup
from kvtier.units import format_bytes

T = TypeVar("T")


@dataclass
class _Outcome:
    ok: bool
    detail: str
    mb_per_s: float = 0.0


def round_trip(
    tier: SecondaryTier, slots: np.ndarray, layout: KVLayout, chunks: int, timeout: float
) -> _Outcome:
    """Store ``chunks`` chunks, look them up, load them back, compare bytes.

    ``slots`` holds ``2 * chunks`` slots (see :func:`bench_tier`).
    """
    if not tier.holds_stores:
        # Nothing to round-trip: check that lookups of unknown chunks resolve.
        tokens = np.random.default_rng().integers(0, 2**31, chunks * layout.chunk_tokens)
        keys = chunk_keys(layout.namespace, tokens, layout.chunk_tokens)
        answers = [resolve_lookup(tier, key, timeout=timeout) for key in keys]
        if any(answer is not Lookup.MISS for answer in answers):
            return _Outcome(False, f"unknown chunks found: {[a.value for a in answers]}")
        return _Outcome(True, "lookups answered (the tier keeps no stores)")
    phases = bench_tier(tier, slots, layout, chunks=chunks, batch=chunks, timeout=timeout)
    for name in PHASES:
        if phases[name].failures:
            return _Outcome(False, f"{name} failed for {phases[name].failures}/{chunks} chunks")
    moved = [phases["store"], phases["load"]]
    seconds = sum(phase.seconds for phase in moved)
    served = "as its lossy codec decodes them" if tier.codec_stage.lossy else "byte-exact"
    return _Outcome(True, served, sum(phase.nbytes for phase in moved) / seconds / 1e6)


def _readable(name: str, value: object) -> object:
    """Byte counts of a tier's description as people read them (``1.0 GiB``)."""
    if name.endswith("bytes") and isinstance(value, int) and not isinstance(value, bool):
        return format_bytes(value)
    return value


def _bounded(step: Callable[[], T], timeout: float) -> T:
    """``step()`` within ``timeout`` s (:class:`CallTimeout` if not): a stuck tier
    is left behind on its thread, and the command then exits at once."""
    return call_within(step, timeout, name="kvtier-check-step")


def _health(tier: SecondaryTier, timeout: float) -> list[HealthCheck]:
    """The tier's own checks; a hook that raises or hangs is one failed check."""
    try:
        return _bounded(lambda: list(tier.health()), timeout)
    except CallTimeout:
        return [HealthCheck("health", False, f"health() did not return within {timeout:g} s")]
    except Exception as exc:
        return [HealthCheck("health", False, describe_error(exc))]


def _abandon(message: str) -> NoReturn:
    """Exit now, leaving a stuck tier's threads behind (waiting for them would hang)."""
    click.echo(message, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


@click.command()
@config_argument
@click.option(
    "--chunks",
    type=POSITIVE,
    default=4,
    show_default=True,
    help="Chunks to round-trip per tier.",
)
@click.option(
    "--chunk-kib",
    type=POSITIVE,
    default=256,
    show_default=True,
    help="Size of each probe chunk, in KiB.",
)
@click.option(
    "--timeout",
    type=Seconds(),
    default=30.0,
    show_default=True,
    help="Seconds allowed per tier step: start-up, health checks, each transfer, shutdown.",
)
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
    refuse_beyond_memory(
        2 * chunks * chunk_kib * 1024,
        chunks,
        chunk_kib,
        "its primary tier holds each chunk twice: stored from, and loaded into",
    )
    layout = probe_layout(settings.chunk_tokens, chunk_kib, floats=needs_floats(settings))
    # Only the slots the probe needs (stores read one half, loads land in the
    # other), private whatever the configuration says about shared memory: a
    # check must never map a running engine's slots.
    settings = settings.model_copy(
        update={"cpu_bytes_to_use": 2 * chunks * layout.slot_bytes, "shared_memory_name": None}
    )
    try:
        spec = OffloadingSpecFactory.create_spec(settings, layout)
        manager = _bounded(spec.build_manager, timeout)
    except CallTimeout:
        where = getattr(spec, "starting", None) or "the tiers"
        _abandon(f"cannot start the tiers: {where} did not start within {timeout:g} s (--timeout)")
    except Exception as exc:
        click.echo(f"cannot start the tiers: {describe_error(exc)}", err=True)
        sys.exit(1)
    table = Table(title=f"kvtier check {config}")
    for column in ("#", "type", "check", "result", "detail"):
        table.add_column(column)
    failures = 0
    try:
        slots = manager.primary.buffer.array
        for index, tier in enumerate(manager.tiers):
            rows = [(c.name, c.ok, c.detail) for c in _health(tier, timeout)]
            try:
                outcome = round_trip(tier, slots, layout, slots.shape[0] // 2, timeout)
            except Exception as exc:
                outcome = _Outcome(False, describe_error(exc))
            detail = outcome.detail + (
                f", {outcome.mb_per_s:,.0f} MB/s" if outcome.mb_per_s else ""
            )
            rows.append(("round trip", outcome.ok, detail))
            if not tier.codec_stage.identity:
                codec = codec_facts(tier)
                rows.append(
                    (
                        "codec",
                        not codec["failures"],
                        f"{codec['codec']}{' (lossy)' if codec['lossy'] else ''} "
                        f"{codec['params']}: {format_bytes(codec['bytes_in'])} stored as "
                        f"{format_bytes(codec['bytes_out'])}, ratio {codec['ratio']}, "
                        f"{codec['failures']} codec failures",
                    )
                )
            for name, ok, text in rows:
                failures += not ok
                result = "[green]ok[/green]" if ok else "[red]FAILED[/red]"
                table.add_row(str(index), tier.tier_type, name, result, escape(text))
            facts = ", ".join(
                f"{name}={_readable(name, value)}"
                for name, value in tier.describe().items()
                if name != "type"
            )
            if facts:
                table.add_row(str(index), tier.tier_type, "backend", "", escape(facts))
            table.add_section()
    finally:
        try:
            _bounded(manager.shutdown, timeout)
        except CallTimeout:
            console.print(table)
            _abandon(f"the tiers did not shut down within {timeout:g} s (--timeout)")
    if not manager.tiers:
        console.print("configuration is valid")
        click.echo(
            f"warning: {config} names no secondary tiers, so chunks live only in each "
            "process's CPU tier and are lost when it exits; add a secondary_tiers list "
            "(see examples/local.yaml and examples/nvme.yaml)",
            err=True,
        )
    else:
        console.print(table)
    sys.exit(1 if failures else 0)
