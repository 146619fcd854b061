"""Time to first token on the demo model: full prefill vs a CPU-tier hit vs a secondary-tier hit.

The prompt is a 2,048-token shared prefix (the demo's system prompt) plus a
short suffix (a user turn). Three ways to its first token, measured in the
same run, interleaved round by round so that machine noise hits all three:

* ``full prefill``: the model computes every token (no kvtier);
* ``CPU-tier hit``: kvtier holds the prefix in its CPU tier; the model
  prefills only the suffix;
* ``<tier>-tier hit``: the CPU tier is emptied first (untimed), so the prefix
  is promoted from the secondary tier, then loaded.

Each kvtier time covers the lookup, any promotion, the copy into the model's
cache and the suffix prefill. Reported: medians and the speed-up of each
path over full prefill. Targets: CPU-tier hit >= 8x, secondary-tier hit >= 4x.

Run: ``python benchmarks/bench_ttft.py [--tier fs|memory] [--rounds N] [--threads N] [--json]``
(needs ``pip install 'kvtier[transformers]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvtier.demo.model import SIZES, ByteTokenizer, build_demo_model
from kvtier.demo.workload import chat_workload
from kvtier.integrations.transformers import PrefixCache, greedy_generate

PREFIX_TOKENS = 2048
TARGETS = {"CPU": 8.0, "secondary": 4.0}


def tier_config(tier: str, root: Path, chunk_tokens: int) -> dict[str, Any]:
    secondary: dict[str, Any] = {"type": tier, "max_bytes": "1GiB"}
    if tier == "fs":
        secondary["root_dir"] = str(root)
    return {
        "chunk_tokens": chunk_tokens,
        "cpu_bytes_to_use": "256MiB",
        "secondary_tiers": [secondary],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="fs", help="secondary tier type: fs (default) or memory")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per path")
    parser.add_argument("--chunk-tokens", type=int, default=SIZES["default"].chunk_tokens)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    size = SIZES["default"]
    model = build_demo_model(size)
    workload = chat_workload(
        ByteTokenizer(), system_tokens=PREFIX_TOKENS, conversations=1, turns=1, new_tokens=1
    )
    prompt = workload.system + workload.user_turns[0][0]
    times: dict[str, list[float]] = {"full": [], "CPU": [], "secondary": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as root:
        config = tier_config(args.tier, Path(root), args.chunk_tokens)
        with PrefixCache(model, config, model_id="kvtier-demo-llama-default") as kv:
            # Untimed: warm the kernels, and store the shared prefix alone (in the CPU tier
            # and, behind it, the secondary tier) as the first request of a chat would.
            expected = greedy_generate(model, prompt, 1).tokens
            kv.generate(workload.system, 1)
            kv.kv.drain()
            for _ in range(args.rounds):
                full = greedy_generate(model, prompt, 1)
                times["full"].append(full.ttft_s)
                hit = kv.generate(prompt, 1, store=False)
                times["CPU"].append(hit.ttft_s)
                _expect(hit.reused_tokens == PREFIX_TOKENS, "the CPU tier missed the prefix")
                kv.kv.reset()
                fetched = kv.generate(prompt, 1, store=False)
                times["secondary"].append(fetched.ttft_s)
                _expect(
                    fetched.reused_tokens == PREFIX_TOKENS and any(fetched.promoted_chunks),
                    f"the {args.tier} tier did not serve the prefix",
                )
                _expect(
                    full.tokens == hit.tokens == fetched.tokens == expected,
                    "first tokens differ between paths",
                )
    medians = {name: statistics.median(values) for name, values in times.items()}
    best = {name: min(values) for name, values in times.items()}
    speedups = {name: medians["full"] / medians[name] for name in TARGETS}
    best_speedups = {name: best["full"] / best[name] for name in TARGETS}
    result = {
        "prompt_tokens": len(prompt),
        "prefix_tokens": PREFIX_TOKENS,
        "chunk_tokens": args.chunk_tokens,
        "tier": args.tier,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "median_ttft_s": medians,
        "best_ttft_s": best,
        "speedup_of_medians": speedups,
        "speedup_of_bests": best_speedups,
        "targets": TARGETS,
        "met": {name: speedups[name] >= TARGETS[name] for name in TARGETS},
        "all_ttft_s": times,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"demo model ({size.num_layers} layers, hidden {size.hidden_size}), "
        f"{len(prompt)}-token prompt = {PREFIX_TOKENS}-token shared prefix + "
        f"{len(prompt) - PREFIX_TOKENS}-token suffix; {args.rounds} rounds, "
        f"{torch.get_num_threads()} threads"
    )
    labels = {"full": "full prefill", "CPU": "CPU-tier hit", "secondary": f"{args.tier}-tier hit"}
    print(f"  {'time to first token':<20} {'median':>10} {'best':>10}   speed-up (median, best)")
    for name, label in labels.items():
        line = f"  {label:<20} {medians[name] * 1000:7.1f} ms {best[name] * 1000:7.1f} ms"
        if name in TARGETS:
            verdict = "met" if speedups[name] >= TARGETS[name] else "MISSED"
            line += (
                f"   {speedups[name]:5.1f}x, {best_speedups[name]:5.1f}x"
                f"   (target {TARGETS[name]:.0f}x: {verdict})"
            )
        print(line)


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise RuntimeError(f"benchmark invalid: {problem}")


if __name__ == "__main__":
    main()
