"""Bookkeeping cost of each eviction policy, on the calls a trace makes of it.

Each policy first replays the trace through the simulator (as ``kvtier
simulate`` does) with its calls recorded; then a fresh instance replays just
those calls, timed (CPU time of the thread), in a tight loop with nothing
else in it. A policy is timed on its own call sequence (its evictions decide
its later inserts), and all policies run interleaved in the same rounds.

    python benchmarks/bench_policies.py TRACE [--capacity 5%] [--rounds 5] [--limit N]

Prints, per policy, chunk operations per second (a touch of k keys, an
insert and an eviction of k victims count k, 1 and k) by median round, and
the median over rounds of its time per chunk operation over lru's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvtier.cli.simulate import parse_capacity
from kvtier.policies import CachePolicy, CachePolicyFactory
from kvtier.sim.replay import PrimaryReplay
from kvtier.sim.trace import Request, distinct_blocks, read_trace

Call = tuple[str, Any, Any]


class _Recorder:
    """Wraps a policy, recording every call the replay makes of it."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.capacity = policy.capacity
        self.calls: list[Call] = []

    def touch(self, keys: list[Any]) -> None:
        self.calls.append(("touch", list(keys), None))
        self.policy.touch(keys)

    def insert(self, key: Any) -> None:
        self.calls.append(("insert", key, None))
        self.policy.insert(key)

    def evict(self, n: int, protected: set[Any]) -> list[Any] | None:
        self.calls.append(("evict", n, set(protected)))
        return self.policy.evict(n, protected)


def record(requests: list[Request], name: str, capacity: int) -> list[Call]:
    recorder = _Recorder(CachePolicyFactory.create_cache_policy(name, capacity))
    primary = PrimaryReplay(recorder)  # type: ignore[arg-type]
    for request in requests:
        primary.request(request.blocks)
    return recorder.calls


def timed(calls: list[Call], name: str, capacity: int) -> float:
    policy = CachePolicyFactory.create_cache_policy(name, capacity)
    touch, insert, evict = policy.touch, policy.insert, policy.evict
    # CPU time of this thread: what other processes of a shared machine take
    # does not count, as in bench_primary.py.
    started = time.thread_time()
    for op, first, second in calls:
        if op == "touch":
            touch(first)
        elif op == "insert":
            insert(first)
        else:
            evict(first, second)
    return time.thread_time() - started


def chunk_ops(calls: list[Call]) -> int:
    return sum(
        len(first) if op == "touch" else first if op == "evict" else 1 for op, first, _ in calls
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--capacity", default="5%")
    parser.add_argument("--policies", default="lru,leaf-lru,arc,s3fifo")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=int)
    args = parser.parse_args()
    requests = read_trace(args.trace, limit=args.limit)
    capacity = parse_capacity(args.capacity, distinct_blocks(requests))
    names = args.policies.split(",")
    calls = {name: record(requests, name, capacity) for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            seconds[name].append(timed(calls[name], name, capacity))
    per_op = {name: [s / chunk_ops(calls[name]) for s in seconds[name]] for name in names}
    base = per_op.get("lru")
    print(f"{len(requests)} requests, {capacity} slots, median of {args.rounds} rounds")
    for name in names:
        # The ratio per round, then its median: both ran under the same load.
        ratio = statistics.median(
            mine / lru for mine, lru in zip(per_op[name], base or per_op[name], strict=True)
        )
        print(
            f"{name:10s} {1 / statistics.median(per_op[name]) / 1e6:6.2f} M chunk ops/s"
            f"   {ratio:.2f}x lru's time per op"
        )


if __name__ == "__main__":
    main()
