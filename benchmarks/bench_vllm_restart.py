"""A restarted vLLM engine's first reuse of a prefix from ``fs``, against the
same prefix from kvtier's CPU tier, with where the difference goes.

One engine stores the prefixes of ``--rounds`` rounds in an ``fs`` root
(``kvtier-store`` of ``bench_vllm.py``); then ``--runs`` fresh engines on
that root each serve, per round, B from ``fs`` (promoted into the CPU tier,
then copied into vLLM's cache), C from vLLM's own cache, and, with vLLM's
cache emptied, D from kvtier's CPU tier (``kvtier-fs`` of ``bench_vllm.py``).
B ÷ D, round by round, is what a restart costs over a warm CPU tier (goal:
1.2× at most); each engine's median is one run's figure. With
``--baseline-src`` every run starts an engine of an older kvtier too, the
two taking turns going first, and the two must give the same tokens.

``--warm-start`` adds engines whose kvtier sets ``warm_start_bytes``: their
B finds the prefix in the CPU tier if the warm start brought it back before
the prompt came; with ``--baseline-src`` too, the older kvtier also runs
with a warm start, beside it.

``--trace`` time-stamps, in each engine's processes, the connector's calls,
the promotion's submission, each read of the tier's workers, progress
announcements and the worker's page copies (``restart_trace.py``), and
prints the median breakdown of B and D (ms from the prompt's start).

    .venv-vllm/bin/python benchmarks/bench_vllm_restart.py --runs 5 --trace \\
        --baseline-src /path/to/older/kvtier/src
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import restart_trace
from bench_vllm import _engine, _load_average, make_model, prompt_rounds, work_directory

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
#: The restarted engines store nothing: nothing to drain when they stop.
SHUTDOWN_S = 10


def _tracing(work: Path) -> Path:
    """A directory whose ``sitecustomize`` installs the tracer in every process
    started with it on ``PYTHONPATH``; the trace file is named per engine."""
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "if os.environ.get('KVTIER_BENCH_TRACE'):\n"
        "    import restart_trace\n"
        "    restart_trace.install(os.environ['KVTIER_BENCH_TRACE'])\n"
    )
    return site


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="restarted engines per side")
    parser.add_argument("--rounds", type=int, default=5, help="prefixes each engine serves")
    parser.add_argument("--prefix", type=int, default=3072, help="shared prefix tokens")
    parser.add_argument("--tail", type=int, default=64, help="distinct tail tokens")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--baseline-src", type=Path, help="an older kvtier's src, run alike")
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="also run engines with warm_start_bytes set, beside those without",
    )
    parser.add_argument("--trace", action="store_true", help="break B and D down by stage")
    args = parser.parse_args()
    with work_directory("kvtier-bench-restart-") as work:
        _run(work, args)


def _run(work: Path, args: argparse.Namespace) -> None:
    """Every engine of the run under ``work``, and the report."""
    model = make_model(work, args.layers, args.hidden)
    warmup, rounds = prompt_rounds(args.rounds, args.prefix, args.tail)
    common = {
        "model": str(model),
        "block_size": 128,
        "max_model_len": args.prefix + args.tail + 64,
        "multiprocessing": True,
        "ttft": True,
        "tensor_parallel_size": 1,
    }
    kvtier = {
        "kvtier": {
            "chunk_tokens": args.chunk_tokens,
            "cpu_bytes_to_use": "1GiB",
            "secondary_tiers": [{"type": "fs", "root_dir": str(work / "fs")}],
        },
    }
    # Each side: the kvtier source it imports and its kvtier configuration.
    sides = {"after": (SRC, kvtier)}
    if args.baseline_src is not None:
        sides["before"] = (args.baseline_src.resolve(), kvtier)
    if args.warm_start:
        warm = {"kvtier": {**kvtier["kvtier"], "warm_start_bytes": "1GiB"}}
        sides["warm start"] = (SRC, warm)
        if args.baseline_src is not None:
            sides["warm start before"] = (args.baseline_src.resolve(), warm)
    site = _tracing(work) if args.trace else None

    def env(src: Path, trace: Path | None) -> dict[str, str]:
        paths = [str(src)] + ([str(site)] if site is not None else [])
        variables = {"PYTHONPATH": os.pathsep.join(paths)}
        if trace is not None:
            variables["KVTIER_BENCH_TRACE"] = str(trace)
        return variables

    load_before = _load_average()
    _engine(
        work,
        "store",
        {**common, "extra_config": kvtier, "prompts": [warmup] + [r["A"] for r in rounds]},
        env(SRC, None),
    )
    loads = [warmup] + [r[tail] for r in rounds for tail in "BCD"]
    fs_spec = {
        **common,
        "prompts": loads,
        "reset_after": [True] + [tail != "B" for _ in rounds for tail in "BCD"],
        "shutdown_timeout_s": SHUTDOWN_S,
    }
    ratios: dict[str, list[float]] = {side: [] for side in sides}
    breakdowns: dict[str, dict[str, list[dict[str, float]]]] = {
        side: {"B": [], "D": []} for side in sides
    }
    tokens: dict[str, list[list[int]]] = {}
    order = list(sides)
    for run in range(args.runs):
        for side in order if run % 2 == 0 else order[::-1]:
            trace = work / f"{side}-{run}.trace" if args.trace else None
            src, extra_config = sides[side]
            spec = {**fs_spec, "extra_config": extra_config}
            result = _engine(work, f"{side}-{run}".replace(" ", "-"), spec, env(src, trace))
            ttft, cached = result["ttft_s"][1:], result["cached"][1:]
            b, d = ttft[0::3], ttft[2::3]
            if any(c < args.prefix for c in cached[0::3] + cached[2::3]):
                raise SystemExit(f"{side} run {run}: a prefix was not served whole: {cached}")
            ratios[side].append(statistics.median(f / c for f, c in zip(b, d, strict=True)))
            if tokens.setdefault("reference", result["tokens"]) != result["tokens"]:
                raise SystemExit(f"{side} run {run}: tokens differ from the first engine's")
            if trace is not None:
                prompts = restart_trace.summarise(str(trace))[1:]
                breakdowns[side]["B"] += prompts[0::3]
                breakdowns[side]["D"] += prompts[2::3]
            print(f"run {run} {side}: B/D {ratios[side][-1]:.2f}x", flush=True)
    print(
        f"prompt {args.prefix + args.tail} tokens ({args.prefix} shared), {args.rounds} rounds "
        f"an engine, {args.runs} runs; load average {load_before:.1f} before, "
        f"{_load_average():.1f} after"
    )
    for side, values in ratios.items():
        print(
            f"{side}: kvtier-fs / kvtier-cpu, median of run medians "
            f"{statistics.median(values):.2f}x (runs {', '.join(f'{v:.2f}' for v in values)})"
        )
    for after, before in (("after", "before"), ("warm start", "warm start before")):
        if before in ratios:
            paired = [a / b for a, b in zip(ratios[after], ratios[before], strict=True)]
            print(f"{after} / {before}, run by run: median {statistics.median(paired):.2f}")
    if args.trace:
        for side, by_prompt in breakdowns.items():
            for name, rows in by_prompt.items():
                print(f"{side}, {name} (ms, p50 (p10-p90)):")
                print("\n".join(restart_trace.stage_lines(rows)))
            same_round = [
                {"ttft": b["ttft"] - d["ttft"]}
                for b, d in zip(by_prompt["B"], by_prompt["D"], strict=True)
            ]
            print(f"{side}, B - D of the same round:")
            print("\n".join(restart_trace.stage_lines(same_round)))


if __name__ == "__main__":
    main()
