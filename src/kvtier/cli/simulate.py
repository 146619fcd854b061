"""``kvtier simulate TRACE``: hit ratio of each policy at each capacity, against Belady's MIN.

Replays a trace through kvtier's real policy objects, making exactly the
calls ``KVCache`` makes on its primary tier, and sets each result against
Belady's MIN at the same capacity: the share of the LRU-to-MIN gap a policy
closes says how much better eviction could still do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ByteSize, TypeAdapter, ValidationError
from rich.console import Console

from kvtier.cli.options import EXISTING_FILE
from kvtier.cli.policy_report import policy_table, run
from kvtier.cli.routing_report import routing_table, run_routing
from kvtier.errors import KVTierError, MissingDependencyError
from kvtier.policies.factory import policy_registry
from kvtier.sim.plot import load_matplotlib, plot_format, plot_report
from kvtier.sim.synthetic import ChatShape, chat_trace, parse_chat_shape
from kvtier.sim.trace import (
    DEFAULT_BLOCK_SIZE,
    Request,
    TraceFormatError,
    distinct_blocks,
    parse_records,
    read_trace,
)

DEFAULT_POLICIES = ("lru", "leaf-lru", "arc", "s3fifo")
DEFAULT_CAPACITIES = ("5%", "10%", "20%")


def parse_capacity(
    text: str, distinct: int, chunk_bytes: int | None = None, option: str = "--capacity"
) -> int:
    """Slots for ``text``: ``5%`` of the distinct chunks, a chunk count such as ``2000``,
    or, given ``chunk_bytes``, a size such as ``8GiB`` (rounded down to whole chunks)."""
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if not 0 < share <= 1:
                raise ValueError
            return max(1, int(share * distinct))
        if text.isdigit():
            slots = int(text)
        elif chunk_bytes is not None:
            slots = _BYTES.validate_python(text) // chunk_bytes
        else:
            raise ValueError
        if slots < 1:
            raise ValueError
        return slots
    except (ValueError, ValidationError):
        sizes = " or a size such as 8GiB" if chunk_bytes is not None else ""
        raise click.BadParameter(
            f"{text!r} is neither a share such as 5% (0-100 %), a positive chunk count{sizes}"
            + ("" if chunk_bytes is not None else " (sizes need --chunk-bytes)"),
            param_hint=option,
        ) from None


_BYTES: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)


@click.command()
@click.argument(
    "trace", required=False, type=click.Path(dir_okay=False, path_type=Path), metavar="[TRACE]"
)
@click.option(
    "--chat-seed",
    type=int,
    help="Replay a generated multi-turn chat trace (this seed) instead of a file.",
)
@click.option(
    "--chat-shape",
    "chat_shape",
    multiple=True,
    metavar="FIELD=VALUE",
    help="With --chat-seed, change one field of the generated chat's shape, e.g. "
    "mean_turns=12 or system_tokens=100-400 (repeatable; see the fields in "
    "'kvtier simulate' of the CLI reference).",
)
@click.option(
    "-b",
    "--batch",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Replay requests in engine steps of N, as vLLM's scheduler does: N lookups, "
    "then N stores (a request never hits what its own step stores).",
)
@click.option(
    "-p",
    "--policy",
    "policies",
    multiple=True,
    help=f"Policy to replay (repeatable; default {', '.join(DEFAULT_POLICIES)}).",
)
@click.option(
    "-c",
    "--capacity",
    "capacities",
    multiple=True,
    help="Primary slots: a share of the distinct chunks (5%), a count (2000), or with "
    f"--chunk-bytes a size (8GiB) (repeatable; default {', '.join(DEFAULT_CAPACITIES)}).",
)
@click.option(
    "--chunk-bytes",
    help="Bytes of one chunk (the layout's slot bytes, e.g. 2MiB), for capacities given as sizes.",
)
@click.option(
    "--block-size",
    default=DEFAULT_BLOCK_SIZE,
    show_default=True,
    help="Tokens per block of the trace (its chunk size).",
)
@click.option(
    "-s",
    "--secondary",
    help="Also replay each policy with one evicting secondary tier of this capacity behind "
    "the primary (same units as --capacity), and report hits per tier.",
)
@click.option(
    "-r",
    "--replicas",
    "replica_counts",
    multiple=True,
    type=click.IntRange(min=1),
    help="Route the trace across this many replicas instead (repeatable): each has a "
    "primary tier of --capacity (one) under --policy (one, default lru), --secondary "
    "is a tier they share; compares round-robin, first-chunk hashing and kvtier's scores.",
)
@click.option(
    "--slack",
    default=0.25,
    show_default=True,
    type=click.FloatRange(min=0),
    help="With --replicas: kvtier routing's load cap, the share above an even split "
    "a replica may take of recent requests.",
)
@click.option(
    "--codec-ratio",
    type=click.FloatRange(min=1.0),
    help="With --secondary: also replay with that tier's chunks stored by a codec of this "
    "compression ratio (e.g. 1.6 for lossless, 3.2 for int4; see docs/codecs.md), so the "
    "same bytes hold that many times the chunks, and report both hit ratios.",
)
@click.option(
    "--codec",
    "codec_entry",
    help="With --secondary and --kv: measure this codec's ratio (a name, or its entry as "
    "JSON) on the KV in --kv, and replay with it as --codec-ratio.",
)
@click.option(
    "--kv",
    "kv_path",
    type=EXISTING_FILE,
    help="A .npy of KV chunks, shaped (chunks, layers, 2, tokens, kv_heads, head_dim), "
    "float16, float32 or bfloat16 (benchmarks/bench_codecs.py --save-kv writes one).",
)
@click.option("--limit", type=int, help="Replay only the first N requests.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also draw hit ratio against capacity, one line per policy and MIN, to this "
    ".svg or .png file (needs the 'plot' extra: matplotlib).",
)
def simulate(
    trace: Path | None,
    chat_seed: int | None,
    chat_shape: tuple[str, ...],
    batch: int,
    policies: tuple[str, ...],
    capacities: tuple[str, ...],
    block_size: int,
    chunk_bytes: str | None,
    secondary: str | None,
    replica_counts: tuple[int, ...],
    slack: float,
    codec_ratio: float | None,
    codec_entry: str | None,
    kv_path: Path | None,
    limit: int | None,
    as_json: bool,
    plot_path: Path | None,
) -> None:
    """Replay TRACE through eviction policies at several primary-tier capacities.

    TRACE is JSON Lines, gzipped or not, one request a line with
    "hash_ids" (prefix block ids) and "input_length" (tokens), as in
    Mooncake's published traces and kvtier's recorder. Prints each policy's
    hit ratio (leading resident chunks / all chunks), its ratio to Belady's
    MIN, and the share of the LRU-to-MIN gap it closes. With --secondary,
    also the hits each tier serves when an LRU-evicting secondary tier sits
    behind the primary one (every transfer done before the next request).
    With --plot, also draws hit ratio against capacity to an SVG or PNG file.
    With --batch N, requests are replayed N to an engine step. With
    --replicas, routes the trace across replicas instead and prints each
    router's hit ratio and load.
    """
    if (trace is None) == (chat_seed is None):
        raise click.UsageError("give a TRACE file or --chat-seed, not both or neither")
    if chat_shape and chat_seed is None:
        raise click.UsageError("--chat-shape shapes a generated trace: give --chat-seed too")
    if replica_counts and batch > 1:
        raise click.UsageError(
            "--replicas replays one request at a time: it cannot be combined with --batch"
        )
    if secondary is not None and batch > 1:
        raise click.UsageError(
            "--secondary replays one request at a time: it cannot be combined with --batch"
        )
    try:
        shape = parse_chat_shape(chat_shape)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--chat-shape") from None
    if block_size < 1 or (limit is not None and limit < 1):
        raise click.BadParameter("--block-size and --limit must be positive")
    if replica_counts and (len(policies) > 1 or len(capacities) > 1 or plot_path is not None):
        raise click.UsageError("--replicas takes one --policy and one --capacity, and no --plot")
    policies = tuple(dict.fromkeys(policies or (("lru",) if replica_counts else DEFAULT_POLICIES)))
    for name in policies:
        try:
            policy_registry.resolve(name, None, entry="--policy")
        except KVTierError as exc:
            raise click.BadParameter(str(exc), param_hint="--policy") from None
    if codec_entry is not None or kv_path is not None:
        if codec_entry is None or kv_path is None or codec_ratio is not None:
            raise click.UsageError("give --codec with --kv (instead of --codec-ratio)")
        codec_ratio = measured_ratio(codec_entry, kv_path)
    if codec_ratio is not None and secondary is None:
        raise click.UsageError("--codec-ratio applies to the --secondary tier: give one")
    if plot_path is not None:
        _check_plotting(plot_path)
    try:
        requests = _load(trace, chat_seed, shape, block_size, limit)
    except TraceFormatError as exc:
        click.echo(f"kvtier simulate: {exc}", err=True)
        sys.exit(2)
    distinct = distinct_blocks(requests)
    chunk = _chunk_bytes(chunk_bytes)
    slots = [parse_capacity(text, distinct, chunk) for text in capacities or DEFAULT_CAPACITIES]
    secondary_slots = (
        None if secondary is None else parse_capacity(secondary, distinct, chunk, "--secondary")
    )
    if replica_counts:
        report = run_routing(
            requests,
            policies[0],
            slots[0],
            replica_counts,
            shared_slots=secondary_slots,
            slack=slack,
            progress=not as_json,
        )
    else:
        report = run(
            requests,
            policies,
            slots,
            progress=not as_json,
            secondary=secondary_slots,
            batch=batch,
            codec_ratio=codec_ratio,
        )
    report["trace"] = str(trace) if trace is not None else _chat_name(chat_seed, chat_shape)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        Console().print(routing_table(report) if replica_counts else policy_table(report))
    if plot_path is not None:
        try:
            plot_report(report, plot_path)
        except OSError as exc:
            click.echo(
                f"kvtier simulate: cannot write the plot {str(plot_path)!r}: {exc}", err=True
            )
            sys.exit(2)


def _check_plotting(path: Path) -> None:
    """Fail before any replay when the plot could not be drawn: a suffix that names
    no image format, or matplotlib (the ``plot`` extra) not installed."""
    try:
        plot_format(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--plot") from None
    if not path.parent.is_dir():
        raise click.BadParameter(f"{str(path.parent)!r} is not a directory", param_hint="--plot")
    try:
        load_matplotlib()
    except MissingDependencyError as exc:
        click.echo(f"kvtier simulate --plot needs matplotlib: {exc}", err=True)
        sys.exit(2)


def _chunk_bytes(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        size = int(_BYTES.validate_python(text))
    except ValidationError:
        size = 0
    if size < 1:
        raise click.BadParameter(f"{text!r} is not a size such as 2MiB", param_hint="--chunk-bytes")
    return size


def _chat_name(seed: int | None, shape: tuple[str, ...]) -> str:
    return f"chat seed {seed}" + "".join(f", {field}" for field in shape)


def _load(
    trace: Path | None,
    chat_seed: int | None,
    shape: ChatShape,
    block_size: int,
    limit: int | None,
) -> list[Request]:
    if trace is not None:
        return read_trace(trace, block_size=block_size, limit=limit)
    assert chat_seed is not None
    records = chat_trace(chat_seed, shape)  # each names its own block size
    return parse_records(enumerate(records, 1), f"chat trace (seed {chat_seed})", limit=limit)


def measured_ratio(codec_entry: str, kv_path: Path) -> float:
    """The ratio ``codec_entry`` gets on the KV chunks in ``kv_path``."""
    import numpy as np

    from kvtier.codecs import CodecStage, codec_config
    from kvtier.layout import KVLayout

    try:
        entry: Any = (
            json.loads(codec_entry) if codec_entry.lstrip().startswith("{") else codec_entry
        )
        chunks = np.load(kv_path)
        if chunks.ndim != 6 or chunks.shape[2] != 2:
            raise ValueError(
                f"KV of shape {chunks.shape}: expected (chunks, layers, 2, tokens, heads, dim)"
            )
        _, layers, _, tokens, heads, dim = chunks.shape
        # numpy saves bfloat16 (an extension dtype) as 2-byte records.
        bf16 = chunks.dtype.kind == "V" and chunks.dtype.itemsize == 2
        dtype = "bfloat16" if bf16 else chunks.dtype.name
        layout = KVLayout("kvtier-simulate", layers, heads, dim, dtype, tokens)
        stage = CodecStage(codec_config(entry, entry="--codec").build(layout), layout)
    except (ValueError, TypeError, KVTierError) as exc:
        raise click.BadParameter(str(exc), param_hint="--codec/--kv") from None
    buffer = stage.scratch(1)[0]
    encoded = sum(stage.encode(memoryview(chunk.tobytes()), buffer) for chunk in chunks)
    return chunks.nbytes / encoded
