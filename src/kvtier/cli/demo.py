"""``kvtier demo``: a real model, a chat workload, and what kvtier saves on it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvtier.cli.options import EXISTING_FILE
from kvtier.config import KVTierConfig, load_config
from kvtier.errors import KVTierError, MissingDependencyError, describe_error
from kvtier.units import format_bytes

if TYPE_CHECKING:
    from kvtier.demo.workload import ChatWorkload, DemoRun
    from kvtier.integrations.transformers import PrefixCache

DEFAULT_DIR = Path("kvtier-demo")


def default_config(directory: Path, chunk_tokens: int) -> dict[str, Any]:
    """The embedded configuration: a CPU tier, and an ``fs`` tier in ``directory/fs``
    that outlives the process."""
    return {
        "chunk_tokens": chunk_tokens,
        "cpu_bytes_to_use": "512MiB",
        "secondary_tiers": [{"type": "fs", "root_dir": str(directory / "fs"), "max_bytes": "2GiB"}],
    }


@click.command()
@click.option(
    "--config",
    "config_path",
    type=EXISTING_FILE,
    help="kvtier configuration to run the workload on [default: a CPU tier and an "
    "fs tier under --dir].",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A local Hugging Face causal-LM directory [default: a small Llama built "
    "locally from a fixed seed].",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DIR,
    show_default=True,
    help="Where the default configuration keeps its files.",
)
@click.option("--quick", is_flag=True, help="A tiny model and workload that run in seconds.")
@click.option("--system-tokens", type=click.IntRange(min=1), help="Tokens of the system prompt.")
@click.option("--conversations", type=click.IntRange(min=1), help="Conversations to run.")
@click.option("--turns", type=click.IntRange(min=1), help="Turns per conversation.")
@click.option("--new-tokens", type=click.IntRange(min=1), help="Tokens generated per turn.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="Model dtype.",
)
def demo(
    config_path: Path | None,
    model_path: Path | None,
    directory: Path,
    quick: bool,
    system_tokens: int | None,
    conversations: int | None,
    turns: int | None,
    new_tokens: int | None,
    dtype: str,
) -> None:
    """Show kvtier's main job on a real model: a multi-turn chat with a long shared
    system prompt, without kvtier, through kvtier, and from the secondary tiers.

    Reports the time to first token of each, the tokens reused, the hit rate
    and bytes of each tier, and checks that greedy outputs are identical with
    and without kvtier (exit status 1 if not). Nothing is downloaded. Run it
    twice: the second run starts with an empty CPU tier and is served by the
    chunks a persistent secondary tier kept.
    """
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 100))  # logs: room for the tables
    try:
        import torch

        from kvtier.demo.model import SIZES, ByteTokenizer, build_demo_model, load_local_model
        from kvtier.demo.workload import chat_workload
        from kvtier.integrations.transformers import PrefixCache
    except (ImportError, MissingDependencyError) as exc:
        missing = MissingDependencyError(
            getattr(exc, "name", None) or "transformers", "transformers"
        )
        click.echo(f"kvtier demo needs a model runtime: {missing}", err=True)
        sys.exit(2)

    size = SIZES["quick" if quick else "default"]
    try:
        settings = load_config(config_path or default_config(directory, size.chunk_tokens))
    except KVTierError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)

    torch_dtype = getattr(torch, dtype)
    if model_path is None:
        model = build_demo_model(size).to(torch_dtype)
        tokenizer: Any = ByteTokenizer()
        model_id = f"kvtier-demo-llama-{size.name}"
        origin = "built locally from a fixed seed"
    else:
        try:
            model, tokenizer = load_local_model(model_path, torch_dtype)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
            click.echo(
                # The first line: transformers appends every model type it knows.
                f"cannot load a model from {model_path}: {describe_error(exc).splitlines()[0]}\n"
                "--model takes a local Hugging Face causal-LM directory (config.json and "
                "its weights, e.g. what save_pretrained() writes); leave it out to run "
                "the built-in model",
                err=True,
            )
            sys.exit(2)
        model_id = str(model_path.resolve())
        origin = f"loaded from {model_path}"
    workload = chat_workload(
        tokenizer,
        system_tokens=system_tokens or size.system_tokens,
        conversations=conversations or size.conversations,
        turns=turns or size.turns,
        new_tokens=new_tokens or size.new_tokens,
    )
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and workload.longest_sequence > context:
        click.echo(
            f"the workload needs up to {workload.longest_sequence:,} tokens per conversation, "
            f"more than the model's context of {context:,} (max_position_embeddings); "
            "make it shorter with --system-tokens, --turns or --new-tokens",
            err=True,
        )
        sys.exit(2)
    try:
        kv = PrefixCache(model, settings, model_id=model_id)
    except Exception as exc:
        click.echo(f"cannot start kvtier: {describe_error(exc)}", err=True)
        sys.exit(1)
    with kv:
        _describe(console, model, origin, kv, settings, workload)
        try:
            run = _run_with_progress(console, kv, workload)
        except Exception as exc:  # a model that loads but cannot run this workload
            kind = model.config.model_type
            click.echo(f"the workload failed on the {kind} model: {describe_error(exc)}", err=True)
            sys.exit(1)
        _report(console, run, kv)
    sys.exit(1 if run.mismatches() else 0)


def _describe(
    console: Console,
    model: Any,
    origin: str,
    kv: PrefixCache,
    settings: KVTierConfig,
    workload: ChatWorkload,
) -> None:

    layout = kv.layout
    params = sum(p.numel() for p in model.parameters()) / 1e6
    console.print(
        f"[bold]model[/bold] {model.config.model_type}, {layout.num_layers} layers, "
        f"{layout.num_kv_heads} KV heads × {layout.head_dim}, {params:.1f}M parameters, "
        f"{layout.dtype}, {origin}"
    )
    console.print(
        f"[bold]kv cache[/bold] {format_bytes(layout.bytes_per_token)} per token; "
        f"chunks of {layout.chunk_tokens} tokens = {format_bytes(layout.slot_bytes)}"
    )
    tiers = [f"CPU {format_bytes(int(settings.cpu_bytes_to_use))}"]
    for tier in kv.kv.status.tiers:
        where = tier.facts.get("root_dir")
        tiers.append(f"{tier.tier_type}" + (f" in {where}" if where else ""))
    console.print(f"[bold]tiers[/bold] {' → '.join(tiers)}")
    console.print(
        f"[bold]workload[/bold] {workload.conversations} conversations × {workload.turns} "
        f"turns, {len(workload.system):,}-token shared system prompt, "
        f"{workload.new_tokens} tokens per reply (greedy)"
    )


def _run_with_progress(console: Console, kv: PrefixCache, workload: ChatWorkload) -> DemoRun:
    from kvtier.demo.workload import run_demo

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        current: list[TaskID] = []

        def on_phase(name: str, total: int) -> None:
            current.append(progress.add_task(name, total=total))

        def on_request() -> None:
            progress.advance(current[-1])

        return run_demo(kv, workload, on_phase=on_phase, on_request=on_request)


def _report(console: Console, run: DemoRun, kv: PrefixCache) -> None:
    from kvtier.demo.report import slow_hits_note, summarise, tier_table, ttft_table

    tier_types = kv.kv.status.tier_types
    rows = summarise(run, tier_types)
    console.print(ttft_table(rows))
    note = slow_hits_note(rows)
    if note:
        console.print(f"[bold yellow]note:[/bold yellow] {note}")
    console.print(tier_table(run, kv.kv.status, kv.layout.slot_bytes))
    records = run.kvtier + (run.refetch or [])
    reused = sum(r.reused_tokens for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    console.print(
        f"tokens reused: {reused:,} of {prompt:,} prompt tokens ({reused / prompt:.0%}) "
        f"over {len(records)} kvtier requests"
    )
    first = run.kvtier[0]
    if sum(first.promoted_chunks):
        console.print(
            f"[bold green]served from the {first.source(tier_types)} tier of an earlier run:"
            f"[/bold green] this process started with an empty CPU tier, and its first request "
            f"reused {first.reused_tokens:,} of {first.prompt_tokens:,} prompt tokens"
        )
    elif tier_types:
        console.print(
            "run it again: a new process starts with an empty CPU tier, and a persistent "
            "secondary tier serves its first request"
        )
    mismatches = run.mismatches()
    compared = len(records)
    if mismatches:
        console.print(
            f"[bold red]✗ greedy outputs differ with and without kvtier[/bold red] in "
            f"{len(mismatches)} of {compared} requests: {mismatches[:5]}"
        )
    else:
        tokens = sum(len(r.tokens) for r in records)
        console.print(
            f"[bold green]✓ greedy outputs identical with and without kvtier[/bold green] "
            f"({compared} requests, {tokens:,} generated tokens)"
        )
