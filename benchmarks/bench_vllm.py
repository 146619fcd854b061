"""Time to first token in vLLM on the CPU: kvtier hits against vLLM's own prefix-cache hit.

For each tensor-parallel size asked for, three engines, each in its own
process, serve rounds of prompts after a short warm-up. The prompts of a
round share a long prefix (a fresh one each round) and differ in a short
tail: A, B, C, D.

* ``vllm`` (no connector): A is prefilled whole (``vllm``); B, C and D hit
  vLLM's own prefix cache (``vllm-native``). Its first tokens are the
  reference every other engine must give.
* ``kvtier-store``: kvtier with a CPU tier and an ``fs`` tier, vLLM's cache
  emptied after each prompt: A is prefilled, and its prefix offloaded.
* ``kvtier-fs``: a fresh engine on the same ``fs`` directory, as after a
  restart. In each round B loads the prefix from ``fs`` (``kvtier-fs``:
  promoted into the CPU tier, then copied into vLLM's cache), C hits vLLM's
  own cache in the same engine (``native (same)``), then vLLM's cache is
  emptied and D loads the prefix from kvtier's CPU tier (``kvtier-cpu``).
  B ÷ D, round by round, is what a restart costs over a warm CPU tier.

``vs native`` compares each kvtier hit with the native hit of the same
round in the same engine (median and range of the per-round ratios; 1.00x is
level), so the load of a shared machine weighs on both sides alike.
``vs vllm`` is the speed-up over prefilling (medians).

**Floor.** What a fs hit cannot avoid beyond a native hit is reading the
prefix's chunk files from the disk and copying its bytes into vLLM's cache.
After the engines, the benchmark reads the chunk files of one prefix (with
``O_DIRECT`` where the filesystem allows it, as the fs tier does: raw from
the disk) and copies the prefix's bytes once in memory (each of the TP
workers copies its share, in parallel: one share is timed); the median
``kvtier-fs`` minus ``native (same)`` is set against that floor.

Run (in the environment built by ``scripts/test-vllm.sh``)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--prefix 3072] [--rounds 3] [--tp 1 2]

TP=2 on vLLM's CPU build binds one worker per core; on a 2-core machine the
benchmark sets ``VLLM_CPU_OMP_THREADS_BIND='0|1' VLLM_CPU_NUM_OF_RESERVED_CPU=0``
unless the environment already sets them.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ENGINE = Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm_engine.py"
#: Bytes after the payload in a chunk file (``kvtier.tiers.fs.io.TRAILER_BLOCK``).
TRAILER_BLOCK = 4096


@contextmanager
def work_directory(prefix: str) -> Iterator[Path]:
    """A scratch directory for a run's model, tiers and engine logs: removed
    once the run succeeded, kept (and named on stderr) when it failed, for
    the engines' logs."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    except BaseException:
        print(f"the engines' logs are kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


def _engine(
    work: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one engine over ``spec`` in its own process (``env``: variables to set there)."""
    spec_file, result_file = work / f"{name}.json", work / f"{name}-result.json"
    spec_file.write_text(json.dumps(spec))
    with (work / f"{name}.log").open("w") as log:
        subprocess.run(
            [sys.executable, str(ENGINE), str(spec_file), str(result_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            env={**_environment(spec.get("tensor_parallel_size", 1)), **(env or {})},
        )
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def _environment(tensor_parallel_size: int) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    if tensor_parallel_size > 1:
        cores = "|".join(str(core) for core in range(tensor_parallel_size))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def _served(run: dict[str, Any], prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
    """An engine's answers keyed by prompt."""
    return {
        json.dumps(prompt): {"ttft_s": ttft, "cached": cached, "tokens": tokens}
        for prompt, ttft, cached, tokens in zip(
            prompts, run["ttft_s"], run["cached"], run["tokens"], strict=True
        )
    }


def _row(times: list[float], cached: list[int]) -> dict[str, Any]:
    return {
        "ttft_s_median": statistics.median(times),
        "ttft_s": times,
        "cached_tokens": cached,
    }


def _measure(
    work: Path,
    common: dict[str, Any],
    kvtier: dict[str, Any],
    warmup: list[int],
    rounds: list[dict[str, list[int]]],
    tp: int,
) -> dict[str, dict[str, Any]]:
    """TTFT figures of the three engines at one tensor-parallel size."""
    common = {**common, "tensor_parallel_size": tp}
    plain = [warmup] + [r[tail] for r in rounds for tail in "ABCD"]
    stores = [warmup] + [r["A"] for r in rounds]
    loads = [warmup] + [r[tail] for r in rounds for tail in "BCD"]
    runs = {
        "vllm": _engine(
            work,
            f"vllm-tp{tp}",
            {
                **common,
                "extra_config": None,
                "prompts": plain,
                # The prefix stays cached through B, C, D, and goes before the next round.
                "reset_after": [True] + [tail == "D" for _ in rounds for tail in "ABCD"],
            },
        ),
        "kvtier-store": _engine(
            work, f"kvtier-store-tp{tp}", {**common, "extra_config": kvtier, "prompts": stores}
        ),
        "kvtier-fs": _engine(
            work,
            f"kvtier-fs-tp{tp}",
            {
                **common,
                "extra_config": kvtier,
                "prompts": loads,
                # B (from fs), C (vLLM's own hit), vLLM's cache emptied, D (from the CPU tier).
                "reset_after": [True] + [tail != "B" for _ in rounds for tail in "BCD"],
            },
        ),
    }
    reference = _served(runs["vllm"], plain)
    answers = {
        "kvtier-store": _served(runs["kvtier-store"], stores),
        "kvtier-fs": _served(runs["kvtier-fs"], loads),
    }
    for engine, served in answers.items():
        for prompt, answer in served.items():
            if answer["tokens"] != reference[prompt]["tokens"]:
                raise SystemExit(
                    f"TP={tp}: {engine} gave {answer['tokens']} where vLLM alone gave "
                    f"{reference[prompt]['tokens']}"
                )

    def column(served: dict[str, dict[str, Any]], tail: str, field: str) -> list[Any]:
        return [served[json.dumps(r[tail])][field] for r in rounds]

    fs = answers["kvtier-fs"]
    rows = {
        "vllm": _row(column(reference, "A", "ttft_s"), column(reference, "A", "cached")),
        "vllm-native": _row(
            [served for tail in "BCD" for served in column(reference, tail, "ttft_s")],
            [served for tail in "BCD" for served in column(reference, tail, "cached")],
        ),
        "kvtier-store": _row(
            column(answers["kvtier-store"], "A", "ttft_s"),
            column(answers["kvtier-store"], "A", "cached"),
        ),
        "native (same)": _row(column(fs, "C", "ttft_s"), column(fs, "C", "cached")),
        "kvtier-fs": _row(column(fs, "B", "ttft_s"), column(fs, "B", "cached")),
        "kvtier-cpu": _row(column(fs, "D", "ttft_s"), column(fs, "D", "cached")),
    }
    prefill = rows["vllm"]["ttft_s_median"]
    native = rows["vllm-native"]["ttft_s_median"]
    same_engine = rows["native (same)"]["ttft_s"]
    for name, row in rows.items():
        row["speedup_vs_vllm"] = prefill / row["ttft_s_median"]
        if name in ("kvtier-fs", "kvtier-cpu"):
            ratios = [t / n for t, n in zip(row["ttft_s"], same_engine, strict=True)]
            row["vs_native_same_round"] = ratios
            row["ttft_vs_native"] = statistics.median(ratios)
            row["extra_over_native_s"] = [
                t - n for t, n in zip(row["ttft_s"], same_engine, strict=True)
            ]
        else:
            row["ttft_vs_native"] = row["ttft_s_median"] / native
    # A restarted engine's first reuse from fs against the same prefix from
    # kvtier's CPU tier, round by round in one engine (goal: 1.2x at most).
    restart = [
        f / c
        for f, c in zip(rows["kvtier-fs"]["ttft_s"], rows["kvtier-cpu"]["ttft_s"], strict=True)
    ]
    rows["kvtier-fs"]["vs_cpu_tier_same_round"] = restart
    return rows


def _aligned(size: int) -> mmap.mmap:
    """A page-aligned buffer, every page touched once (as the primary tier's are)."""
    buffer = mmap.mmap(-1, size)
    np.frombuffer(buffer, dtype=np.uint8)[:] = 1
    return buffer


def _read_files(files: list[Path], buffer: mmap.mmap, direct: bool) -> float:
    view = memoryview(buffer)
    size = files[0].stat().st_size
    began = time.perf_counter()
    for index, path in enumerate(files):
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
        try:
            done = os.preadv(fd, [view[index * size : (index + 1) * size]], 0)
        finally:
            os.close(fd)
        if done != size:
            raise SystemExit(f"{path}: read {done} of {size} bytes")
    return time.perf_counter() - began


def _floor(root: Path, chunks: int, tp: int, repeats: int) -> dict[str, Any]:
    """Read the chunk files of a prefix raw from the disk, and copy its bytes once."""
    files = sorted(root.glob("*/*/*.kvc"))
    if len(files) < chunks:
        raise SystemExit(f"{root}: {len(files)} chunk files, a prefix has {chunks}")
    size = files[0].stat().st_size
    buffer = _aligned(size * chunks)
    direct = True
    try:
        _read_files(files[:1], buffer, direct=True)
    except OSError:
        direct = False  # the filesystem refuses O_DIRECT; so does the fs tier
    groups = [files[i : i + chunks] for i in range(0, len(files) - chunks + 1, chunks)]
    reads = [_read_files(group, buffer, direct) for group in groups[:repeats]]
    payload = (size - TRAILER_BLOCK) * chunks
    share = payload // tp
    source = np.frombuffer(buffer, dtype=np.uint8)[:share]
    target = np.frombuffer(_aligned(share), dtype=np.uint8)
    copies = []
    for _ in range(max(3, repeats)):
        began = time.perf_counter()
        np.copyto(target, source)
        copies.append(time.perf_counter() - began)
    read_s, copy_s = statistics.median(reads), statistics.median(copies)
    return {
        "chunk_files": chunks,
        "file_bytes": size,
        "payload_bytes": payload,
        "direct_io": direct,
        "read_s": reads,
        "copy_s": copies,
        "floor_s": read_s + copy_s,
    }


def make_model(work: Path, layers: int, hidden: int) -> Path:
    """A small random model of ``layers`` and ``hidden`` size, saved under ``work``."""
    model = work / "model"
    command = [sys.executable, str(ENGINE), "--make-model", str(model), str(layers), str(hidden)]
    subprocess.run(command, check=True, capture_output=True)
    return model


def prompt_rounds(
    count: int, prefix_tokens: int, tail_tokens: int
) -> tuple[list[int], list[dict[str, list[int]]]]:
    """A warm-up prompt, and ``count`` rounds of four prompts (A to D) sharing
    one fresh prefix each, the same for every run (seeded)."""
    rng = random.Random(0)

    def words(n: int) -> list[int]:
        return [rng.randrange(4, 1024) for _ in range(n)]

    warmup = [1, *words(63)]
    rounds = []
    for _ in range(count):
        prefix = [1, *words(prefix_tokens - 1)]
        rounds.append({tail: prefix + words(tail_tokens) for tail in "ABCD"})
    return warmup, rounds


def _load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=int, default=3072, help="shared prefix tokens")
    parser.add_argument("--tail", type=int, default=64, help="distinct tail tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument(
        "--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to measure"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    with work_directory("kvtier-bench-vllm-") as work:
        result = _run(work, args)
    print(json.dumps(result, indent=1) if args.json else report(result))


def _run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every engine of one run under ``work``: the figures ``report`` takes."""
    model = make_model(work, args.layers, args.hidden)
    warmup, rounds = prompt_rounds(args.rounds, args.prefix, args.tail)
    common = {
        "model": str(model),
        "block_size": 128,
        "max_model_len": args.prefix + args.tail + 64,
        "multiprocessing": True,
        "ttft": True,
    }
    load_before = _load_average()
    figures: dict[str, Any] = {}
    for tp in args.tp:
        root = work / f"fs-tp{tp}"
        kvtier = {
            "kvtier": {
                "chunk_tokens": args.chunk_tokens,
                "cpu_bytes_to_use": "1GiB",
                "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
            },
        }
        rows = _measure(work, common, kvtier, warmup, rounds, tp)
        floor = _floor(root, args.prefix // args.chunk_tokens, tp, args.rounds)
        floor["kvtier_fs_minus_native_s"] = statistics.median(
            rows["kvtier-fs"]["extra_over_native_s"]
        )
        figures[f"tp{tp}"] = {"engines": rows, "floor": floor}
    return {
        "args": vars(args),
        "load_average": [load_before, _load_average()],
        "figures": figures,
    }


def report(result: dict[str, Any]) -> str:
    """The figures of one run (as ``--json`` prints them) as a table."""
    args, figures = result["args"], result["figures"]
    load_before, load_after = result["load_average"]
    lines = [
        f"prompt {args['prefix'] + args['tail']} tokens ({args['prefix']} shared), "
        f"{args['layers']} layers × hidden {args['hidden']}, chunk {args['chunk_tokens']}, "
        f"{args['rounds']} rounds; load average {load_before:.1f} before, {load_after:.1f} after",
        f"{'TP':<3} {'engine':<14} {'TTFT median':>11} {'(range)':<17} {'cached':>6} "
        f"{'vs vllm':>8} {'vs native (range)':>22}",
    ]
    for parallel, tables in figures.items():
        for name, row in tables["engines"].items():
            times = row["ttft_s"]
            spread = f"({min(times) * 1000:.1f}-{max(times) * 1000:.1f})"
            versus = f"{row['ttft_vs_native']:.2f}x"
            if "vs_native_same_round" in row:
                ratios = row["vs_native_same_round"]
                versus += f" ({min(ratios):.2f}-{max(ratios):.2f})"
            lines.append(
                f"{parallel[2:]:<3} {name:<14} {row['ttft_s_median'] * 1000:>9.1f}ms "
                f"{spread:<17} {min(row['cached_tokens']):>6} "
                f"{row['speedup_vs_vllm']:>7.2f}x {versus:>22}"
            )
        restart = tables["engines"]["kvtier-fs"]["vs_cpu_tier_same_round"]
        lines.append(
            f"TP={parallel[2:]} restart: kvtier-fs / kvtier-cpu of the same round "
            f"{statistics.median(restart):.2f}x (rounds {min(restart):.2f}-{max(restart):.2f})"
        )
        floor = tables["floor"]
        extra = tables["engines"]["kvtier-fs"]["extra_over_native_s"]
        lines.append(
            f"TP={parallel[2:]} floor of a fs hit: {floor['chunk_files']} chunk files "
            f"({floor['payload_bytes'] / 2**20:.1f} MiB) read "
            f"{'with O_DIRECT' if floor['direct_io'] else 'buffered'} "
            f"{statistics.median(floor['read_s']) * 1000:.1f}ms + copied "
            f"{statistics.median(floor['copy_s']) * 1000:.1f}ms = "
            f"{floor['floor_s'] * 1000:.1f}ms; kvtier-fs - native (same) "
            f"{floor['kvtier_fs_minus_native_s'] * 1000:.1f}ms "
            f"(rounds {min(extra) * 1000:.1f} to {max(extra) * 1000:.1f})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
