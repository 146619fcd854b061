"""One ``KVCache`` shared by 1, 2, 4 and 8 threads: throughput as a ratio to one thread.

Each thread serves requests: a prompt of a shared prefix (Zipf popularity
over ``--prefixes`` prefixes) and a unique suffix. Per request it holds the
cached prefix (``with cache.lookup(tokens) as found``), loads it into an
engine-side buffer (``found.load``), and stores the prompt's new full chunks
(``cache.store``), exactly what an engine thread does. Two setups:

* ``cpu``: the CPU tier alone, about half the working set, so stores evict;
* ``cpu+fs``: a CPU tier of a quarter of the working set in front of an fs
  tier, so lookups promote from disk.

For each it prints requests per second and its ratio to one thread, the
requests per CPU-second of the process (what sharing costs in CPU, which
load from other processes does not blur) and its ratio, plus what the
manager's lock costs one uncontended call (a lookup of a 16-chunk prefix
with and without the lock). Every loaded byte is checked, so a race shows
up as a failure, not as a figure.

Run: ``python benchmarks/bench_threads.py [--seconds 2] [--rounds 3] [--chunk-kib 256] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtier import KVCache, KVLayout

THREADS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Workload:
    chunk_kib: int
    chunk_tokens: int = 16
    prefixes: int = 32
    prefix_chunks: int = 8
    suffix_chunks: int = 2

    @property
    def layout(self) -> KVLayout:
        # 2 layers x 2 heads x 2 (K, V) x chunk_tokens x head_dim x 2 bytes = chunk_kib KiB.
        head_dim = self.chunk_kib * 1024 // (2 * 2 * 2 * self.chunk_tokens * 2)
        return KVLayout("bench-threads", 2, 2, head_dim, "float16", self.chunk_tokens)

    @property
    def working_set_chunks(self) -> int:
        return self.prefixes * self.prefix_chunks


def chunk_bytes(key: bytes, slot_bytes: int) -> np.ndarray:
    """The one valid content of a chunk: its key, then its first byte repeated
    (cheap to make and to check in full, and unique per chunk)."""
    row = np.full(slot_bytes, key[0], dtype=np.uint8)
    row[: len(key)] = np.frombuffer(key, dtype=np.uint8)
    return row


def filler(keys: Sequence[bytes], slot_bytes: int) -> Callable[[int, np.ndarray], None]:
    def fill(index: int, slot: np.ndarray) -> None:
        slot[:] = chunk_bytes(keys[index], slot_bytes)

    return fill


@dataclass
class Run:
    setup: str
    threads: int
    requests: int
    seconds: float
    #: CPU seconds of the whole process (engine threads and tier workers).
    cpu_seconds: float
    loaded_chunks: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def requests_per_cpu_s(self) -> float:
        """What a request costs in CPU, whoever else uses the machine: sharing
        that cost nothing keeps this at the one-thread figure."""
        return self.requests / max(self.cpu_seconds, 1e-9)


def serve(cache: KVCache, workload: Workload, threads: int, seconds: float, seed: int) -> Run:
    """``threads`` engine threads serving requests for ``seconds``."""
    ct = workload.chunk_tokens
    prefixes = [
        [p * 1_000_000 + i for i in range(workload.prefix_chunks * ct)]
        for p in range(workload.prefixes)
    ]
    weights = [1 / (rank + 1) for rank in range(workload.prefixes)]
    slot_bytes = workload.layout.slot_bytes
    chunks = workload.prefix_chunks + workload.suffix_chunks
    stop = threading.Event()
    counts = [(0, 0)] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def engine(index: int) -> None:
        dice = random.Random(seed * 100 + index)
        out = np.empty((chunks, slot_bytes), dtype=np.uint8)
        requests = loaded = 0
        try:
            start.wait()
            while not stop.is_set():
                prefix = dice.choices(prefixes, weights)[0]
                suffix = [2**40 + dice.randrange(2**40) for _ in range(workload.suffix_chunks * ct)]
                tokens = prefix + suffix
                keys = cache.keys(tokens)
                with cache.lookup(tokens) as found:
                    got = found.load(out) // ct
                for key, row in zip(keys[:got], out[:got], strict=False):
                    if not np.array_equal(row, chunk_bytes(key, slot_bytes)):
                        raise AssertionError("a loaded chunk has the wrong bytes")
                cache.store(tokens, filler(keys, slot_bytes))
                requests += 1
                loaded += got
        except BaseException as error:
            errors.append(error)
        counts[index] = (requests, loaded)

    workers = [threading.Thread(target=engine, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began, cpu_began = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    if errors:
        raise errors[0]
    return Run(
        "",
        threads,
        sum(r for r, _ in counts),
        elapsed,
        cpu,
        sum(loaded for _, loaded in counts),
    )


def setups(workload: Workload, root: str) -> dict[str, Callable[[], dict[str, Any]]]:
    slot = workload.layout.slot_bytes
    ws = workload.working_set_chunks
    return {
        "cpu": lambda: {"chunk_tokens": workload.chunk_tokens, "cpu_bytes_to_use": ws // 2 * slot},
        "cpu+fs": lambda: {
            "chunk_tokens": workload.chunk_tokens,
            "cpu_bytes_to_use": ws // 4 * slot,
            "secondary_tiers": [
                {"type": "fs", "root_dir": os.path.join(root, f"fs-{time.monotonic_ns()}")}
            ],
        },
    }


def lock_cost(workload: Workload, calls: int = 2_000, rounds: int = 25) -> dict[str, float]:
    """Seconds per lookup of a 16-chunk ready prefix, with and without the manager's
    lock: this thread's CPU time, the best of ``rounds`` alternating rounds."""
    ct = workload.chunk_tokens
    tokens = list(range(16 * ct))
    config = {"chunk_tokens": ct, "cpu_bytes_to_use": 32 * workload.layout.slot_bytes}
    with KVCache(config, workload.layout) as cache:
        keys = cache.keys(tokens)
        cache.store(tokens, lambda i, slot: slot.fill(i))
        manager = cache.manager
        unlocked = type(manager).lookup.__wrapped__  # type: ignore[attr-defined]
        calls_of = {
            "locked": lambda: manager.lookup(keys),
            "unlocked": lambda: unlocked(manager, keys),
        }
        best = dict.fromkeys(calls_of, float("inf"))
        for _ in range(rounds):
            for name, call in calls_of.items():
                began = time.thread_time()  # CPU time: other processes' load stays out
                for _ in range(calls):
                    call()
                best[name] = min(best[name], (time.thread_time() - began) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per figure; the best counts")
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workload = Workload(chunk_kib=args.chunk_kib)
    best: dict[tuple[str, int], Run] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-threads-") as root:
        # Rounds go over every thread count in turn, so a burst of load from
        # elsewhere on the machine does not land on one count only.
        for _ in range(args.rounds):
            for setup, config in setups(workload, root).items():
                for threads in args.threads:
                    with KVCache(config(), workload.layout) as cache:
                        serve(cache, workload, threads, min(1.0, args.seconds), seed=1)  # warm
                        run = serve(cache, workload, threads, args.seconds, seed=2)
                    run.setup = setup
                    kept = best.get((setup, threads))
                    if kept is None or run.requests_per_s > kept.requests_per_s:
                        best[(setup, threads)] = run
    runs = list(best.values())
    lock = lock_cost(workload)
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "lock": lock}, indent=1))
        return
    print(
        f"cores: {os.cpu_count()}, chunk: {workload.chunk_kib} KiB, "
        f"best of {args.rounds} runs of {args.seconds:g} s"
    )
    print(
        f"{'setup':8} {'threads':>7} {'requests/s':>11} {'ratio':>6} "
        f"{'requests/cpu-s':>15} {'ratio':>6} {'chunks loaded/req':>18}"
    )
    for setup in dict.fromkeys(r.setup for r in runs):
        mine = [r for r in runs if r.setup == setup]
        base = mine[0]
        for run in mine:
            print(
                f"{setup:8} {run.threads:7d} {run.requests_per_s:11.0f} "
                f"{run.requests_per_s / base.requests_per_s:6.2f} "
                f"{run.requests_per_cpu_s:15.0f} "
                f"{run.requests_per_cpu_s / base.requests_per_cpu_s:6.2f} "
                f"{run.loaded_chunks / max(1, run.requests):18.1f}"
            )
    overhead = lock["locked"] - lock["unlocked"]
    print(
        f"manager lock, uncontended: {overhead * 1e9:.0f} ns per call "
        f"({overhead / lock['unlocked']:.1%} of a 16-chunk lookup, {lock['unlocked'] * 1e6:.1f} µs)"
    )


if __name__ == "__main__":
    main()
