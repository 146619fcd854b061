"""Time to first token in vLLM on the CPU for a prompt with a long shared prefix.

For each tensor-parallel size asked for, four engines, each in its own
process, serve the same prompts: a short warm-up, then rounds of two prompts
that share a long prefix (a fresh prefix each round) and differ in a short
tail. Measured: the second prompt of each round.

* ``vllm``: no connector, vLLM's prefix cache emptied after every prompt;
  the whole prompt is prefilled.
* ``vllm-native``: no connector, vLLM's own prefix cache kept: the second
  prompt hits it (the best an in-engine cache can do).
* ``kvtier-cpu``: kvtier with a CPU primary tier and an ``fs`` tier, vLLM's
  cache emptied after every prompt; the first prompt of the round offloaded
  the prefix, the second loads it from the CPU tier.
* ``kvtier-fs``: a fresh engine on the same ``fs`` directory serves only the
  second prompts: the prefix is promoted from ``fs`` and loaded.

All engines of one parallel size must produce the same first token. Ratios
are measured in the same run (medians over rounds): ``vs vllm`` is the
speed-up over prefilling, ``vs native`` the TTFT over vLLM's own prefix-cache
hit (1.00x is level with it).

Run (in the environment built by ``scripts/test-vllm.sh``)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--prefix 3072] [--rounds 3] [--tp 1 2]

TP=2 on vLLM's CPU build binds one worker per core; on a 2-core machine the
benchmark sets ``VLLM_CPU_OMP_THREADS_BIND='0|1' VLLM_CPU_NUM_OF_RESERVED_CPU=0``
unless the environment already sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm_engine.py"


def _engine(work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_file, result_file = work / f"{name}.json", work / f"{name}-result.json"
    spec_file.write_text(json.dumps(spec))
    with (work / f"{name}.log").open("w") as log:
        subprocess.run(
            [sys.executable, str(ENGINE), str(spec_file), str(result_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            env=_environment(spec.get("tensor_parallel_size", 1)),
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


def _measure(
    work: Path,
    common: dict[str, Any],
    kvtier: dict[str, Any],
    prompts: tuple[list[list[int]], list[list[int]]],
    tp: int,
) -> dict[str, dict[str, Any]]:
    """TTFT figures of the four engines at one tensor-parallel size."""
    both, seconds = prompts
    common = {**common, "tensor_parallel_size": tp}
    plain = {**common, "extra_config": None}
    runs = {
        "vllm": _engine(work, f"vllm-tp{tp}", {**plain, "prompts": both}),
        "vllm-native": _engine(
            work, f"vllm-native-tp{tp}", {**plain, "prompts": both, "reset_prefix_cache": False}
        ),
        "kvtier-cpu": _engine(
            work, f"kvtier-cpu-tp{tp}", {**common, "prompts": both, "extra_config": kvtier}
        ),
        "kvtier-fs": _engine(
            work, f"kvtier-fs-tp{tp}", {**common, "prompts": seconds, "extra_config": kvtier}
        ),
    }
    measured = {name: run["ttft_s"][2::2] for name, run in runs.items()}
    cached = {name: run["cached"][2::2] for name, run in runs.items()}
    # The fs engine served the second prompts only.
    measured["kvtier-fs"] = runs["kvtier-fs"]["ttft_s"][1:]
    cached["kvtier-fs"] = runs["kvtier-fs"]["cached"][1:]
    firsts = {name: runs[name]["tokens"][-1] for name in runs}
    if len({json.dumps(t) for t in firsts.values()}) != 1:
        raise SystemExit(f"TP={tp}: first tokens differ between engines: {firsts}")
    baseline = statistics.median(measured["vllm"])
    native = statistics.median(measured["vllm-native"])
    return {
        name: {
            "ttft_s_median": statistics.median(times),
            "ttft_s": times,
            "cached_tokens": cached[name],
            "speedup_vs_vllm": baseline / statistics.median(times),
            "ttft_vs_native": statistics.median(times) / native,
        }
        for name, times in measured.items()
    }


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

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    model = work / "model"
    subprocess.run(
        [
            sys.executable,
            str(ENGINE),
            "--make-model",
            str(model),
            str(args.layers),
            str(args.hidden),
        ],
        check=True,
        capture_output=True,
    )
    rng = random.Random(0)

    def words(n: int) -> list[int]:
        return [rng.randrange(4, 1024) for _ in range(n)]

    warmup = [1, *words(63)]
    rounds = []
    for _ in range(args.rounds):
        prefix = [1, *words(args.prefix - 1)]
        rounds.append((prefix + words(args.tail), prefix + words(args.tail)))
    both = [warmup] + [p for pair in rounds for p in pair]
    seconds = [warmup] + [second for _, second in rounds]

    common = {
        "model": str(model),
        "block_size": 128,
        "max_model_len": args.prefix + args.tail + 64,
        "multiprocessing": True,
        "ttft": True,
    }
    figures = {}
    for tp in args.tp:
        kvtier = {
            "kvtier": {
                "chunk_tokens": args.chunk_tokens,
                "cpu_bytes_to_use": "1GiB",
                "secondary_tiers": [{"type": "fs", "root_dir": str(work / f"fs-tp{tp}")}],
            },
        }
        figures[f"tp{tp}"] = _measure(work, common, kvtier, (both, seconds), tp)
    if args.json:
        print(json.dumps({"args": vars(args), "figures": figures}, indent=1))
        return
    print(
        f"prompt {args.prefix + args.tail} tokens ({args.prefix} shared), "
        f"{args.layers} layers × hidden {args.hidden}, chunk {args.chunk_tokens}, "
        f"{args.rounds} rounds"
    )
    print(
        f"{'TP':<3} {'engine':<12} {'TTFT median':>12} {'cached tokens':>14} "
        f"{'vs vllm':>8} {'vs native':>10}"
    )
    for parallel, rows in figures.items():
        for name, row in rows.items():
            print(
                f"{parallel[2:]:<3} {name:<12} {row['ttft_s_median'] * 1000:>10.1f}ms "
                f"{min(row['cached_tokens']):>14} {row['speedup_vs_vllm']:>7.2f}x "
                f"{row['ttft_vs_native']:>9.2f}x"
            )


if __name__ == "__main__":
    main()
