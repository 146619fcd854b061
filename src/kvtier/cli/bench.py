"""``kvtier bench CONFIG``: store, lookup and load throughput and latency per tier.

Each configured tier is driven alone, one job at a time (``--batch`` chunks
per job), the way the manager drives it: store every chunk, look each one
up, load every chunk back into zeroed slots and check its bytes. Latency is
what a caller sees, from submit to result. Throughput is set against a
baseline measured in the same run: a plain copy of the same bytes between
primary slots.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kvtier.cli.memory import refuse_beyond_memory
from kvtier.cli.options import POSITIVE, Seconds, config_argument
from kvtier.cli.probe import (
    PHASES,
    bench_tier,
    codec_facts,
    codec_speed,
    needs_floats,
    probe_layout,
)
from kvtier.config import load_config
from kvtier.errors import KVTierError, describe_error
from kvtier.specs.factory import OffloadingSpecFactory


def copy_baseline(slots: np.ndarray, batch: int, rounds: int) -> float:
    """MB/s of copying ``batch`` slots onto ``batch`` others: what any tier is set against."""
    src, dst = slots[:batch], slots[batch : 2 * batch]
    started = time.perf_counter()
    for _ in range(rounds):
        np.copyto(dst, src)
    seconds = time.perf_counter() - started
    return rounds * src.nbytes / seconds / 1e6 if seconds else 0.0


@click.command()
@config_argument
@click.option(
    "--chunks", type=POSITIVE, default=128, show_default=True, help="Chunks to move per tier."
)
@click.option(
    "--chunk-kib", type=POSITIVE, default=256, show_default=True, help="Size of each chunk in KiB."
)
@click.option(
    "--batch", type=POSITIVE, default=8, show_default=True, help="Chunks per store or load job."
)
@click.option(
    "--tier", "tier_indexes", type=int, multiple=True, help="Bench only this tier (repeatable)."
)
@click.option(
    "--timeout", type=Seconds(), default=60.0, show_default=True, help="Seconds allowed per job."
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench(
    config: Path,
    chunks: int,
    chunk_kib: int,
    batch: int,
    tier_indexes: tuple[int, ...],
    timeout: float,
    as_json: bool,
) -> None:
    """Measure store, lookup and load throughput and latency of every tier in CONFIG.

    Writes CHUNKS probe chunks to each tier under a namespace of their own
    (no engine ever reads them; the tier's eviction ages them out). Exits
    non-zero if any tier fails a chunk.
    """
    try:
        settings = load_config(config)
    except KVTierError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    count = len(settings.secondary_tiers)
    unknown = [i for i in tier_indexes if not 0 <= i < count]
    if unknown:
        valid = f"0 to {count - 1}" if count else "none"
        raise click.BadParameter(
            f"no tier {unknown[0]}: {config} names {count} tier{'' if count == 1 else 's'} "
            f"(indexes {valid})",
            param_hint="--tier",
        )
    tier_indexes = tuple(dict.fromkeys(tier_indexes))  # each tier once, in the order given
    batch = min(batch, chunks)
    refuse_beyond_memory(
        max(chunks, 3 * batch) * chunk_kib * 1024,
        chunks,
        chunk_kib,
        "the chunks it moves, which a memory tier keeps in this process, or three batches "
        "of slots if more",
    )
    layout = probe_layout(settings.chunk_tokens, chunk_kib, floats=needs_floats(settings))
    # A primary tier of exactly the slots the bench uses, private to this
    # process whatever the configuration says about shared memory.
    settings = settings.model_copy(
        update={"cpu_bytes_to_use": 2 * batch * layout.slot_bytes, "shared_memory_name": None}
    )
    try:
        manager = OffloadingSpecFactory.create_spec(settings, layout).build_manager()
    except Exception as exc:
        click.echo(f"cannot start the tiers: {describe_error(exc)}", err=True)
        sys.exit(1)
    selected = tier_indexes or tuple(range(len(manager.tiers)))
    slots = manager.primary.buffer.array
    report: dict[str, Any] = {
        "config": str(config),
        "chunk_bytes": layout.slot_bytes,
        "chunks": chunks,
        "batch": batch,
        "tiers": [],
    }
    failed = False
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=as_json,
    )
    try:
        baseline = copy_baseline(slots, batch, rounds=max(1, chunks // batch))
        report["copy_mb_per_s"] = baseline
        with progress:
            for index in selected:
                tier = manager.tiers[index]
                if not tier.holds_stores:
                    report["tiers"].append(
                        {
                            "tier": index,
                            "tier_type": tier.tier_type,
                            "skipped": "a pull-only tier keeps no stores, so nothing to load back",
                        }
                    )
                    continue
                tasks = {
                    phase: progress.add_task(f"tier {index} {tier.tier_type} {phase}", total=chunks)
                    for phase in PHASES
                }
                entry: dict[str, Any] = {"tier": index, "tier_type": tier.tier_type}
                try:
                    phases = bench_tier(
                        tier,
                        slots,
                        layout,
                        chunks=chunks,
                        batch=batch,
                        timeout=timeout,
                        advance=_advancer(progress, tasks),
                    )
                except Exception as exc:
                    entry["error"] = describe_error(exc)
                    failed = True
                else:
                    entry.update({name: p.summary(baseline) for name, p in phases.items()})
                    failed = failed or any(p.failures for p in phases.values())
                if not tier.codec_stage.identity:
                    entry["codec"] = {**codec_facts(tier), **codec_speed(tier, layout)}
                report["tiers"].append(entry)
    finally:
        manager.shutdown()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        console = Console()
        console.print(_table(report))
        for line in _codec_verdicts(report):
            console.print(line)
    sys.exit(1 if failed else 0)


def _advancer(progress: Progress, tasks: dict[str, TaskID]) -> Callable[[str, int], None]:
    def advance(phase: str, done: int) -> None:
        progress.advance(tasks[phase], done)

    return advance


def _codec_verdicts(report: dict[str, Any]) -> list[str]:
    """One line per tier with a codec: whether it pays on that tier's loads."""
    lines = []
    for entry in report["tiers"]:
        codec = entry.get("codec")
        if codec is None or "load" not in entry:
            continue
        pays = codec["pays_below_mb_per_s"]
        loaded = entry["load"]["mb_per_s"]
        lines.append(
            f"tier {entry['tier']} {entry['tier_type']}: codec {codec['codec']} decodes "
            f"{codec['decode_mb_per_s']:.0f} MB/s per core, so it speeds up loads only on a "
            f"tier moving under {pays:.0f} MB/s per decoding worker; this tier loaded "
            f"{loaded:.0f} MB/s through it"
            + ("" if pays > 0 else " (it does not shrink these chunks)")
        )
    return lines


def _codec_label(codec: dict[str, Any]) -> str:
    ratio = codec["ratio"]
    return f" {codec['codec']}×{ratio:.2f}" if ratio else f" {codec['codec']}"


def _table(report: dict[str, Any]) -> Table:
    table = Table(
        title=f"kvtier bench {report['config']}: {report['chunks']} chunks of "
        f"{report['chunk_bytes'] // 1024} KiB, {report['batch']} per job; "
        f"slot copy {report['copy_mb_per_s']:.0f} MB/s",
        caption="p50, p90, p99: latency of one job in ms; ×copy: MB/s over the slot copy's; "
        "TYPE CODEC×R: the tier's codec and the ratio it stored chunks at (MB/s of raw KV)",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    # Short headers that never wrap, so the table fits 80 columns.
    for column in ("#", "type", "phase"):
        table.add_column(column, no_wrap=True)
    for column in ("chunks/s", "MB/s", "×copy", "p50", "p90", "p99", "fail"):
        table.add_column(column, justify="right", no_wrap=True)
    for entry in report["tiers"]:
        if "skipped" in entry:
            table.add_row(str(entry["tier"]), entry["tier_type"], "skipped")
            continue
        if "error" in entry:
            table.add_row(
                str(entry["tier"]), entry["tier_type"], "[red]error[/red]", entry["error"]
            )
            continue
        codec = entry.get("codec")
        for phase in PHASES:
            result = entry[phase]
            latency = result["latency_ms"]
            table.add_row(
                str(entry["tier"]),
                entry["tier_type"] + (_codec_label(codec) if codec else ""),
                phase,
                f"{result['chunks_per_s']:.0f}",
                f"{result['mb_per_s']:.0f}" if phase != "lookup" else "-",
                f"{result['vs_copy']:.2f}" if phase != "lookup" else "-",
                f"{latency['p50']:.3f}",
                f"{latency['p90']:.3f}",
                f"{latency['p99']:.3f}",
                f"[red]{result['failures']}[/red]" if result["failures"] else "0",
            )
    return table
