"""Promotion from ``fs`` into a full CPU tier: time per chunk at 16, 64, 256 and 1024 chunks.

A prefix of N chunks is stored (written through to an ``fs`` tier), then
pushed out of the CPU tier by other chunks until the CPU tier is full and
holds none of it. ``cache.lookup`` of the prefix then finds every chunk
only in ``fs``: the manager reserves a slot for each (evicting one idle
chunk per slot, never one of the prefix), the fs tier loads them, and the
lookup holds all N. Every loaded byte is checked.

Two figures per size, each per chunk and as a ratio to the smallest size
(1.0 at every size: linear in the chain):

* ``lookup``: CPU time of the calling thread in the manager's lookups, the
  bookkeeping (reservations, evictions, protection of the chain), which the
  chain's length must not make quadratic; CPU time, so that other
  processes on a shared machine do not blur it;
* ``promotion``: the wall time of the whole ``cache.lookup``, disk reads
  included (noisier: the fs tier's threads and the disk take part).

Rounds alternate between the sizes; figures are medians over rounds.

Run: ``python benchmarks/bench_promotion.py [--sizes 16 64 256 1024] [--rounds 5] [--json]``;
``--quick`` runs tiny sizes once (a check of the driver, not a figure).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import KVCache, KVLayout

LAYOUT = KVLayout("bench-promotion", 2, 2, 16, "float16", 16)
SIZES = (16, 64, 256, 1024)
#: Fixed whatever the size, so that only the chain's length changes.
CPU_SLOTS = 2048


@dataclass
class Sample:
    chunks: int
    lookup_s: float
    promotion_s: float
    evictions: int


def chunk_bytes(tokens: np.ndarray) -> np.ndarray:
    """One row per chunk, derived from its tokens: a wrong chunk cannot pass."""
    per_chunk = tokens.reshape(-1, LAYOUT.chunk_tokens)
    return np.stack(
        [np.resize(row.astype("<i8").view(np.uint8), LAYOUT.slot_bytes) for row in per_chunk]
    )


def tokens_of(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**31, chunks * LAYOUT.chunk_tokens)


def fill_cpu_without(cache: KVCache, chain: Sequence[bytes], seed: int) -> None:
    """Store other chunks until the CPU tier is full and holds none of ``chain``."""
    primary = cache.manager.primary
    batch = min(128, primary.num_slots)
    for round_ in range(64 * primary.num_slots // batch):
        other = tokens_of(seed * 1_000_003 + round_, batch)
        cache.store(other, chunk_bytes(other))
        cache.drain()
        full = len(primary) == primary.num_slots
        if full and not any(primary.is_ready(key) for key in chain):  # type: ignore[arg-type]
            return
    raise RuntimeError("could not push the chain out of the CPU tier")


def measure_once(root: str, chunks: int, slots: int, seed: int) -> Sample:
    config = {
        "chunk_tokens": LAYOUT.chunk_tokens,
        "cpu_bytes_to_use": slots * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": root}],
    }
    tokens = tokens_of(seed, chunks)
    expected = chunk_bytes(tokens)
    with KVCache(config, LAYOUT) as cache:
        if cache.store(tokens, expected) != chunks:
            raise RuntimeError(f"could not store the {chunks}-chunk prefix")
        cache.drain()
        fill_cpu_without(cache, cache.keys(tokens), seed)
        manager = cache.manager
        evictions_before = manager.primary.evictions
        spent = [0.0]
        # KVCache.lookup enters the manager once, through lookup_pinned.
        real_lookup = manager.lookup_pinned

        def timed_lookup(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return real_lookup(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start

        manager.lookup_pinned = timed_lookup  # type: ignore[method-assign]
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        try:
            with cache.lookup(tokens, timeout=60) as found:
                promotion_s = time.perf_counter() - start
                out = np.zeros_like(expected)
                found.load(out)
        finally:
            gc.enable()
            del manager.lookup_pinned
        if found.num_chunks != chunks or not np.array_equal(out, expected):
            raise RuntimeError(f"promoted {found.num_chunks} of {chunks} chunks, or wrong bytes")
        return Sample(chunks, spent[0], promotion_s, manager.primary.evictions - evictions_before)


def measure(sizes: Sequence[int], slots: int, rounds: int) -> list[list[Sample]]:
    """``rounds`` samples per size, the sizes alternating within each round."""
    samples: list[list[Sample]] = [[] for _ in sizes]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-promotion-") as tmp:
        measure_once(f"{tmp}/warm-up", min(sizes), slots, seed=1)
        for round_ in range(rounds):
            for index, chunks in enumerate(sizes):
                root = f"{tmp}/r{round_}-{chunks}"
                samples[index].append(measure_once(root, chunks, slots, seed=2 + round_))
    return samples


def summarise(samples: list[list[Sample]]) -> list[dict[str, Any]]:
    rows = []
    for per_size in samples:
        chunks = per_size[0].chunks
        rows.append(
            {
                "chunks": chunks,
                "rounds": len(per_size),
                "lookup_us_per_chunk": statistics.median(s.lookup_s for s in per_size)
                / chunks
                * 1e6,
                "promotion_us_per_chunk": statistics.median(s.promotion_s for s in per_size)
                / chunks
                * 1e6,
                "evictions": per_size[0].evictions,
            }
        )
    for key in ("lookup", "promotion"):
        smallest = rows[0][f"{key}_us_per_chunk"]
        for row in rows:
            row[f"{key}_vs_smallest"] = row[f"{key}_us_per_chunk"] / smallest
    return rows


def report(rows: list[dict[str, Any]], slots: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"cpu_slots": slots, "results": rows}, indent=2))
        return
    print(
        f"prefix only in fs, CPU tier full ({slots} slots of {LAYOUT.slot_bytes} B); "
        f"medians of {rows[0]['rounds']} rounds; per chunk, and per chunk / smallest size"
    )
    header = f"{'chunks':>6} {'evicted':>7} {'lookup µs':>10} {'ratio':>6}"
    print(header + f" {'promote µs':>11} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['chunks']:>6} {row['evictions']:>7} {row['lookup_us_per_chunk']:>10.2f} "
            f"{row['lookup_vs_smallest']:>6.2f} {row['promotion_us_per_chunk']:>11.2f} "
            f"{row['promotion_vs_smallest']:>6.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--slots", type=int, default=CPU_SLOTS, help="CPU tier slots")
    parser.add_argument("--rounds", type=int, default=5, help="medians of this many rounds")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one round: checks the driver only"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sizes, slots, rounds = sorted(args.sizes), args.slots, args.rounds
    if args.quick:
        sizes, slots, rounds = [2, 4, 8], 16, 1
    if rounds < 1 or min(sizes) < 1 or max(sizes) > slots:
        parser.error(f"need rounds >= 1 and sizes from 1 to --slots ({slots}), got {args}")
    report(summarise(measure(sizes, slots, rounds)), slots, args.json)


if __name__ == "__main__":
    main()
