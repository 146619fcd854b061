"""What ``max_bytes`` costs the ``fs`` tier: the shared index's price per chunk.

In one run, on one root, the same stream of chunks goes through three
configurations of the tier, taking turns round after round:

* ``unbounded``: no ``max_bytes``, so no shared index (the raw-disk path);
* ``bounded``: ``max_bytes`` far above the data, so every store pays the
  index (reserve, commit) but never evicts;
* ``evicting``: ``max_bytes`` of a quarter of the data, so at steady state
  every store also evicts one chunk (unlink plus rows) in its transaction.

Each round stores ``--chunks`` chunks one job of ``--job-chunks`` at a time,
then loads them back (every load records a use stamp), and reports the
median over rounds of microseconds per chunk for each direction. Small chunks
and buffered I/O on a page-cached root keep the disk out of the figure, so
what differs between the configurations is the index's own work.

    python benchmarks/bench_fs_bound.py --root /tmp/bench-bound --rounds 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from kvtier.keys import chunk_keys
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.fs.io import TRAILER_BLOCK


def _round(root: Path, name: str, max_bytes: int | None, args: argparse.Namespace) -> list[float]:
    layout = small_layout(chunk_tokens=args.chunk_tokens)
    config: dict[str, object] = {
        "type": "fs",
        "root_dir": str(root / name),
        "direct_io": "off",
        "io_threads": args.io_threads,
        "shared": False,
    }
    if max_bytes is not None:
        config["max_bytes"] = max_bytes
    harness = TierHarness(config, layout, num_slots=args.job_chunks)
    try:
        harness.tier.wait_index(60)  # type: ignore[attr-defined]
        rng = np.random.default_rng(len(name))
        tokens = rng.integers(0, 2**31, args.chunks * layout.chunk_tokens)
        keys = chunk_keys(layout.namespace, tokens, layout.chunk_tokens)
        harness.fill(range(args.job_chunks))
        slots = list(range(args.job_chunks))
        started = time.perf_counter()
        for start in range(0, len(keys), args.job_chunks):
            part = keys[start : start + args.job_chunks]
            assert harness.store(part, slots[: len(part)]).success
        stored = time.perf_counter() - started
        present = [key for key in keys if harness.lookup(key).name == "HIT"]
        started = time.perf_counter()
        for start in range(0, len(present), args.job_chunks):
            part = present[start : start + args.job_chunks]
            assert harness.load(part, slots[: len(part)]).success
        loaded = time.perf_counter() - started
        return [stored / len(keys) * 1e6, loaded / max(1, len(present)) * 1e6]
    finally:
        harness.close()
        shutil.rmtree(root / name, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--job-chunks", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=16, help="16: 8 KiB chunks")
    parser.add_argument("--io-threads", type=int, default=4)
    args = parser.parse_args()
    file_bytes = small_layout(chunk_tokens=args.chunk_tokens).slot_bytes + TRAILER_BLOCK
    configs: dict[str, int | None] = {
        "unbounded": None,
        "bounded": 1000 * args.chunks * file_bytes,
        "evicting": args.chunks // 4 * file_bytes,
    }
    figures: dict[str, list[list[float]]] = {name: [] for name in configs}
    names = list(configs)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            figures[name].append(_round(args.root, name, configs[name], args))
    base_store = statistics.median(f[0] for f in figures["unbounded"])
    base_load = statistics.median(f[1] for f in figures["unbounded"])
    print(
        f"{args.chunks} chunks of {file_bytes} bytes per round, {args.rounds} rounds, "
        f"{args.io_threads} I/O threads, jobs of {args.job_chunks}; median µs per chunk"
    )
    print(f"{'config':<10} {'store':>8} {'load':>8} {'store +µs':>10} {'load +µs':>9}")
    for name in names:
        store = statistics.median(f[0] for f in figures[name])
        load = statistics.median(f[1] for f in figures[name])
        print(
            f"{name:<10} {store:8.1f} {load:8.1f} {store - base_store:10.1f} "
            f"{load - base_load:9.1f}"
        )


if __name__ == "__main__":
    main()
