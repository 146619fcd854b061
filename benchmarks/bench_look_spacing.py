"""A cold prefix from a remote tier with the look spacing capped, against uncapped.

A waiter for promotions sleeps ``LOOK_SPACING`` times as long as its last
look took, at most ``Progress.max_spacing_s`` (``UNANNOUNCED_S``). This
runs pairs of cold ``KVCache.load_prefix`` calls on one stored prefix, in
one process, on the tier's server on loopback (``bench_cold_remote``): one
with the cap, one with ``max_spacing_s`` infinite (the spacing before the
cap), back to back, in alternating order. Every byte is checked. It reports
the medians and, per pair, the uncapped time over the capped one (above 1:
the cap is faster).

Run: ``python benchmarks/bench_look_spacing.py --tier redis --chunk 256K
[--size 512MiB] [--pairs 10] [--json]``; ``--quick``: 8 MiB, two pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import numpy as np
from bench_cold import parse_size
from bench_cold_remote import REMOTE_TIERS, StoredPrefix, remote_server

from kvtier import KVCache

SPACINGS = {"capped": None, "uncapped": math.inf}


def timed_load(stored: StoredPrefix, seed: int, max_spacing_s: float | None) -> float:
    """Seconds of one cold ``load_prefix`` by a fresh cache, every byte checked."""
    layout, tokens, expected = stored.ensure(seed)
    out = np.ones_like(expected)
    with KVCache(stored.cache_config(), layout) as cache:
        if max_spacing_s is not None:
            cache.manager.progress.max_spacing_s = max_spacing_s
        cache.manager.primary.buffer.wait_populated()
        started = time.perf_counter()
        loaded = cache.load_prefix(tokens, out)
        seconds = time.perf_counter() - started
    if loaded != len(tokens) or not np.array_equal(out, expected):
        raise SystemExit(f"the prefix came back short or wrong: {loaded} of {len(tokens)} tokens")
    return seconds


def measure(args: argparse.Namespace) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {name: [] for name in SPACINGS}
    with remote_server(args.tier, args.threads, args.size) as (config, _):
        stored = StoredPrefix({**config, "io_threads": args.threads}, args.size, args.chunk)
        for pair in range(args.pairs):
            order = list(SPACINGS) if pair % 2 == 0 else list(reversed(SPACINGS))
            for name in order:
                seconds[name].append(timed_load(stored, args.seed, SPACINGS[name]))
        stored.discard()
    ratios = [u / c for u, c in zip(seconds["uncapped"], seconds["capped"], strict=True)]
    return {
        "tier": args.tier,
        "chunk": args.chunk,
        "size": args.size,
        "pairs": args.pairs,
        "seconds_p50": {name: statistics.median(values) for name, values in seconds.items()},
        "uncapped_over_capped": {
            "p50": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=REMOTE_TIERS, default="redis")
    parser.add_argument("--chunk", type=parse_size, default=parse_size("256KiB"))
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=4, help="the tier's io_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 MiB, two pairs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.size, args.pairs = 8 << 20, 2
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    p50 = result["seconds_p50"]
    ratio = result["uncapped_over_capped"]
    print(
        f"cold prefix of {args.size} bytes from {args.tier}, chunks of {args.chunk} B, "
        f"{args.pairs} pairs\n"
        f"  capped {p50['capped']:.3f} s, uncapped {p50['uncapped']:.3f} s (p50)\n"
        f"  uncapped / capped per pair: p50 {ratio['p50']:.3f}, "
        f"min {ratio['min']:.3f}, max {ratio['max']:.3f}"
    )


if __name__ == "__main__":
    main()
