"""What kvtier's metrics cost an engine: a KVCache workload with and without them.

The baseline is the same workload, in the same run, on a cache whose metrics
are detached (``cache.metrics.close()``): the tiers' own counters still run
(they always do), the job listener and histograms do not. Also times one
scrape of the registry. Run::

    python benchmarks/metrics_overhead.py [--rounds 300] [--repeats 5]

Measured on the 2-core CI machine with ``--repeats 10``: 2651.5 µs per round
with metrics, 2652.0 µs without (ratio 1.000; run-to-run noise is about
±15 %, so the listener's direct cost is printed too): 3 jobs per round,
5.0 µs per job in the listener, 1.17 ms per scrape of two tiers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from prometheus_client import generate_latest

from kvtier import KVCache
from kvtier.testing import small_layout
from kvtier.tiers import JobResult

CHUNK_TOKENS = 16
LAYOUT = small_layout(chunk_tokens=CHUNK_TOKENS)


def workload(cache: KVCache, rounds: int, data: np.ndarray) -> float:
    """Store a fresh 4-chunk prefix, evict the primary copy, promote it back, load it."""
    out = np.empty_like(data)
    started = time.perf_counter()
    for index in range(rounds):
        tokens = list(range(index * 1000, index * 1000 + 4 * CHUNK_TOKENS))
        cache.store(tokens, data)
        cache.drain()
        cache.manager.reset()
        hit = cache.cached_prefix(tokens)
        cache.load(tokens, hit, out)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = {
        "chunk_tokens": CHUNK_TOKENS,
        "cpu_bytes_to_use": 16 * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "memory"}, {"type": "memory"}],
    }
    data = np.random.default_rng(0).integers(0, 256, (4, LAYOUT.slot_bytes), dtype=np.uint8)
    with KVCache(config, LAYOUT) as measured, KVCache(config, LAYOUT) as baseline:
        baseline.metrics.close()
        workload(measured, 20, data)  # warm up both
        workload(baseline, 20, data)
        with_metrics: list[float] = []
        without: list[float] = []
        for repeat in range(args.repeats):
            # Interleaved, alternating which goes first, so drift hits both alike.
            runs = [(measured, with_metrics), (baseline, without)]
            for cache, times in runs if repeat % 2 == 0 else runs[::-1]:
                times.append(workload(cache, args.rounds, data))
        jobs = sum(
            measured.metrics.registry.get_sample_value(
                "kvtier_tier_jobs_total",
                {"tier": str(t), "tier_type": "memory", "direction": d, "outcome": "ok"},
            )
            or 0
            for t in (0, 1)
            for d in ("store", "load")
        )
        result = JobResult(1, True, frozenset(), LAYOUT.slot_bytes, 0.001)
        calls = 20000
        started = time.perf_counter()
        for _ in range(calls):
            measured.metrics._on_job(0, True, result)
        per_job = (time.perf_counter() - started) / calls
        scrapes = []
        for _ in range(50):
            started = time.perf_counter()
            generate_latest(measured.metrics.registry)
            scrapes.append(time.perf_counter() - started)
    per_round = statistics.median(with_metrics) / args.rounds * 1e6
    base_round = statistics.median(without) / args.rounds * 1e6
    print(f"rounds={args.rounds} repeats={args.repeats} tiers=2 chunk={LAYOUT.slot_bytes} B")
    print(f"with metrics:    {per_round:8.1f} µs per round (median)")
    print(f"without metrics: {base_round:8.1f} µs per round (median)")
    print(f"ratio with/without: {per_round / base_round:.3f}")
    rounds_run = args.rounds * args.repeats + 20
    print(f"jobs per round: {jobs / rounds_run:.1f}; listener cost per job: {per_job * 1e6:.1f} µs")
    print(f"listener cost per round: {jobs / rounds_run * per_job * 1e6:.1f} µs")
    print(f"one scrape: {statistics.median(scrapes) * 1e3:.2f} ms (median of 50)")


if __name__ == "__main__":
    main()
