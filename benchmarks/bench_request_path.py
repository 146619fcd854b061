"""Requests per second through :class:`kvtier.KVCache` against a minimal cache.

Per request, what an engine does with a single-process cache: look up the
cached prefix of its tokens and hold it, load it, release it, then store the
full chunks it lacked::

    with cache.lookup(tokens) as found:
        found.load(copy_out)
    cache.store(tokens, copy_in)

CPU tier only, chunks of a few bytes and copiers that copy nothing: what is
measured is the request path's own work (keys, bookkeeping, locks), never a
copy. The trace: requests sharing a few long prefixes chosen with Zipf
popularity, each with a unique suffix; the primary tier is small, so most
stores evict.

The baseline, ``minimal``, does the same work in the fewest Python steps:
BLAKE2b chain keys computed once per request, an ``OrderedDict`` LRU of
slots, one lock per request. Both must find the same hits on the same trace
(checked). Rounds alternate between the two, so load from elsewhere on the
machine hits both alike; the ratio is the median of the per-round ratios.

Run: ``python benchmarks/bench_request_path.py [--rounds N] [--json]``;
``--quick`` replays a tiny trace once (a check of the drivers, not a figure);
``--profile`` prints cProfile's top functions of one kvtier replay instead;
``--record`` has kvtier record each request's keys to a trace file
(``trace_recording``); ``--prefix-chunks``, ``--chunk-tokens``, ``--prefixes``
and ``--slots`` change the trace's shape.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_primary import TraceSpec as ChainSpec  # beside this script

from kvtier import KVCache, KVLayout

WARMUP_REQUESTS = 200


@dataclass(frozen=True)
class TraceSpec(ChainSpec):
    """The primary-tier benchmark's trace shape, as token ids: shorter prompts,
    ``chunk_tokens`` tokens a chunk."""

    requests: int = 4_000
    prefix_chunks: int = 32
    chunk_tokens: int = 16


def bench_layout(spec: TraceSpec) -> KVLayout:
    """Chunks of a few bytes: copying them costs next to nothing."""
    return KVLayout("bench", 1, 1, 1, "uint8", spec.chunk_tokens)


def make_trace(spec: TraceSpec) -> list[list[int]]:
    """Token id lists, one per request; deterministic in ``spec``."""
    rng = random.Random(spec.rng_seed)

    def tokens(chunks: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(chunks * spec.chunk_tokens)]

    prefixes = [tokens(spec.prefix_chunks) for _ in range(spec.prefixes)]
    weights = [1 / (rank + 1) ** spec.zipf_s for rank in range(spec.prefixes)]
    return [
        rng.choices(prefixes, weights)[0]
        + tokens(rng.randint(spec.min_suffix_chunks, spec.max_suffix_chunks))
        for _ in range(spec.requests)
    ]


def _no_copy(index: int, chunk: np.ndarray) -> None:
    """The copier of both systems: the bytes are not what is measured."""


class MinimalCache:
    """The least a correct single-process prefix cache does per request.

    Chain keys hashed once, an LRU of ``{key: slot}`` in an ``OrderedDict``,
    one lock around the bookkeeping. A store never evicts a chunk of its own
    request; loads hand each slot to the copier, as ``KVCache`` does.
    """

    def __init__(self, layout: KVLayout, slots: int) -> None:
        self.layout = layout
        self.lock = threading.Lock()
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(slots))
        self.buffer = np.zeros((slots, layout.slot_bytes), np.uint8)
        self.hasher = hashlib.blake2b(digest_size=32, person=b"kvtier-chunk")

    def request(self, tokens: list[int]) -> int:
        """Look up, load and store one request; returns the chunks it found."""
        step = self.layout.chunk_tokens * 8
        data = np.asarray(tokens, dtype="<i8").tobytes()
        view = memoryview(data)
        keys: list[bytes] = []
        append, copy = keys.append, self.hasher.copy  # as tight as kvtier's own loop
        parent = self.layout.namespace
        for start in range(0, len(data) - step + 1, step):
            digest = copy()
            digest.update(parent)
            digest.update(view[start : start + step])
            parent = digest.digest()
            append(parent)
        with self.lock:
            lru = self.lru
            hits = 0
            for key in keys:
                if key not in lru:
                    break
                lru.move_to_end(key)
                hits += 1
            for index in range(hits):
                _no_copy(index, self.buffer[lru[keys[index]]])
            own = set(keys)
            for index in range(hits, len(keys)):
                key = keys[index]
                if key in lru:
                    continue
                if not self.free:
                    victim = next((k for k in lru if k not in own), None)
                    if victim is None:
                        break
                    self.free.append(lru.pop(victim))
                slot = self.free.pop()
                _no_copy(index, self.buffer[slot])
                lru[key] = slot
        return hits


def kvtier_cache(spec: TraceSpec, record_to: Path | None = None) -> KVCache:
    """``record_to``: a file each request's keys are recorded to (``trace_recording``)."""
    layout = bench_layout(spec)
    config: dict[str, Any] = {
        "chunk_tokens": spec.chunk_tokens,
        "cpu_bytes_to_use": spec.slots * layout.slot_bytes,
        "eviction_policy": "lru",
    }
    if record_to is not None:
        config["trace_recording"] = {"path": str(record_to)}
    return KVCache(config, layout)


def replay_kvtier(trace: list[list[int]], cache: KVCache) -> int:
    """Each call takes the token ids, the same list: checked and keyed once."""
    hits = 0
    for tokens in trace:
        with cache.lookup(tokens) as found:
            found.load(_no_copy)
            hits += found.num_chunks
        cache.store(tokens, _no_copy)
    return hits


def replay_kvtier_keyed(trace: list[list[int]], cache: KVCache) -> int:
    """The token ids checked and keyed once per request (``KVCache.keyed``)."""
    hits = 0
    for tokens in trace:
        keyed = cache.keyed(tokens)
        with cache.lookup(keyed) as found:
            found.load(_no_copy)
            hits += found.num_chunks
        cache.store(keyed, _no_copy)
    return hits


REPLAYS = {"kvtier": replay_kvtier, "kvtier-keyed": replay_kvtier_keyed}
if not hasattr(KVCache, "keyed"):  # a kvtier from before it, measured for comparison
    del REPLAYS["kvtier-keyed"]


def replay_minimal(trace: list[list[int]], cache: MinimalCache) -> int:
    return sum(cache.request(tokens) for tokens in trace)


Runner = tuple[str, Callable[[], tuple[float, int]]]


def runners(spec: TraceSpec, trace: list[list[int]], record_to: Path | None = None) -> list[Runner]:
    """Each replays the trace from an empty cache built outside the timing, and
    returns the CPU seconds of this thread the replay took (GC paused) and its hits."""
    layout = bench_layout(spec)

    def kvtier(
        replay: Callable[[list[list[int]], KVCache], int],
    ) -> Callable[[], tuple[float, int]]:
        def run() -> tuple[float, int]:
            with kvtier_cache(spec, record_to) as cache:
                return timed(lambda: replay(trace, cache))

        return run

    def minimal() -> tuple[float, int]:
        cache = MinimalCache(layout, spec.slots)
        return timed(lambda: replay_minimal(trace, cache))

    return [("minimal", minimal)] + [(name, kvtier(replay)) for name, replay in REPLAYS.items()]


def timed(replay: Callable[[], int]) -> tuple[float, int]:
    gc.collect()
    gc.disable()
    start = time.thread_time()
    try:
        hits = replay()
    finally:
        seconds = time.thread_time() - start
        gc.enable()
    return seconds, hits


def measure(spec: TraceSpec, rounds: int, record_to: Path | None = None) -> dict[str, Any]:
    trace = make_trace(spec)
    for _, warm_up in runners(spec, trace[:WARMUP_REQUESTS], record_to):
        warm_up()
    measured = [
        {system: run() for system, run in runners(spec, trace, record_to)} for _ in range(rounds)
    ]
    hits = {system: result[1] for system, result in measured[0].items()}
    if len(set(hits.values())) != 1:
        raise RuntimeError(f"the systems found different hits on the same trace: {hits}")
    rows = []
    for system in measured[0]:
        seconds = statistics.median(r[system][0] for r in measured)
        # Per round, the minimal cache's time over this system's: its speed relative to it.
        ratios = [r["minimal"][0] / r[system][0] for r in measured]
        rows.append(
            {
                "system": system,
                "seconds": seconds,
                "requests_per_s": spec.requests / seconds,
                "us_per_request": seconds / spec.requests * 1e6,
                "vs_minimal": statistics.median(ratios),
                "vs_minimal_range": [min(ratios), max(ratios)],
            }
        )
    return {
        "trace": asdict(spec),
        "rounds": rounds,
        "hit_chunks": hits["minimal"],
        "chunks": sum(len(t) // spec.chunk_tokens for t in trace),
        "results": rows,
    }


def profile(spec: TraceSpec, top: int) -> None:
    trace = make_trace(spec)
    replay_kvtier(trace[:WARMUP_REQUESTS], kvtier_cache(spec))
    with kvtier_cache(spec) as cache:
        profiler = cProfile.Profile()
        profiler.runcall(replay_kvtier, trace, cache)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=TraceSpec.requests)
    # Other trace shapes: shorter or longer shared prefixes, chunk sizes, room.
    parser.add_argument("--prefix-chunks", type=int, default=TraceSpec.prefix_chunks)
    parser.add_argument("--chunk-tokens", type=int, default=TraceSpec.chunk_tokens)
    parser.add_argument("--prefixes", type=int, default=TraceSpec.prefixes)
    parser.add_argument("--slots", type=int, default=TraceSpec.slots)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quick", action="store_true", help="a tiny trace, once")
    parser.add_argument("--profile", type=int, metavar="TOP", help="profile one kvtier replay")
    parser.add_argument(
        "--record", action="store_true", help="kvtier records each request's keys (a trace file)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    spec = TraceSpec(
        requests=args.requests,
        prefix_chunks=args.prefix_chunks,
        chunk_tokens=args.chunk_tokens,
        prefixes=args.prefixes,
        slots=args.slots,
    )
    if args.quick:
        spec, args.rounds = TraceSpec(requests=300, prefixes=4, slots=64), 1
    if args.profile:
        profile(spec, args.profile)
        return
    with tempfile.TemporaryDirectory() as scratch:
        out = measure(spec, args.rounds, Path(scratch) / "trace.jsonl" if args.record else None)
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return
    print(f"trace: {out['trace']}, hit chunks {out['hit_chunks']} of {out['chunks']}")
    print(f"speed relative to minimal: median of {out['rounds']} rounds (lowest..highest)")
    for row in out["results"]:
        low, high = row["vs_minimal_range"]
        print(
            f"{row['system']:>13}: {row['requests_per_s']:>7.0f} requests/s"
            f" {row['us_per_request']:>6.1f} us/request"
            f"  {row['vs_minimal']:.2f}x ({low:.2f}..{high:.2f})"
        )


if __name__ == "__main__":
    main()
