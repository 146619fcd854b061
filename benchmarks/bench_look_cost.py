"""What looking up a long prefix costs the caller, for this kvtier and an older one.

Three figures, each from a process of its own per kvtier and pair
(``--baseline-src`` runs an older kvtier's src alike, the two taking turns
going first), on a ``redis-server`` on loopback (``bench_cold_remote``):

* ``look``: CPU time of the calling thread per key of one manager look
  (``lookup_pinned``) over ``--keys`` chunks whose existence checks the
  tier holds back: what a request waiting on a long cold prefix pays at
  every look;
* ``lookup``: CPU time per key of a tier's own ``lookup`` of one key (what
  vLLM's own tiering calls), from ``memory``'s index and from redis's
  checks;
* ``prefix``: the wall time of a cold ``load_prefix`` of a stored redis
  prefix (``--size``, chunks of ``--chunk``, every byte checked), the median
  of ``--prefixes`` in the process.

Per figure: the medians over pairs and, with a baseline, baseline ÷ this
kvtier per pair (above 1: this one costs less).

Run: ``python benchmarks/bench_look_cost.py [--keys 2048] [--pairs 3]
[--baseline-src DIR] [--json]``; ``--quick``: 64 keys, 8 MiB, one pair.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from bench_cold import parse_size
from paired import add_options, baseline_over_kvtier, medians, print_ratios, serve, take_turns

FIGURES = ("look_us", "lookup_memory_us", "lookup_redis_us", "prefix_s")
#: Times each per-key figure is taken; its median is reported.
ROUNDS = 15


def per_key_cpu_us(call: Any, keys: int) -> float:
    """Median CPU time of the calling thread per key, over :data:`ROUNDS` calls."""
    times = []
    for _ in range(ROUNDS):
        started = time.thread_time()
        call()
        times.append(time.thread_time() - started)
    return statistics.median(times) / keys * 1e6


def held_checks(tier: Any) -> threading.Event:
    """Hold the tier's existence checks back until the event is set."""
    held = threading.Event()
    real = tier.store.contains_many

    def contains_many(keys: Any) -> Any:
        held.wait(60)
        return real(keys)

    tier.store.contains_many = contains_many
    return held


def lookup_costs(redis: dict[str, Any], count: int) -> dict[str, float]:
    """``look_us``, ``lookup_memory_us`` and ``lookup_redis_us`` (see the module)."""
    return {**tier_costs("memory", {"type": "memory"}, count), **tier_costs("redis", redis, count)}


def tier_costs(name: str, entry: dict[str, Any], count: int) -> dict[str, float]:
    """One tier's lookup of one key, and with its checks held (redis) a manager look."""
    from kvtier import KVCache
    from kvtier.testing import small_layout
    from kvtier.tiers.base import LookupContext

    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": (count + 8) * layout.slot_bytes,
        "secondary_tiers": [entry],
    }
    with KVCache(config, layout) as cache:
        tier, manager = cache.manager.tiers[0], cache.manager
        held = held_checks(tier) if name == "redis" else None
        keys = cache.keys(list(range(count * 4)))
        ctx = LookupContext("one-key", 0)
        costs = {
            f"lookup_{name}_us": per_key_cpu_us(
                lambda: [tier.lookup(key, ctx) for key in keys], count
            )
        }
        if held is not None:
            manager.lookup_pinned(keys, "waiting")
            manager.step()  # the checks sent, and held
            costs["look_us"] = per_key_cpu_us(lambda: manager.lookup_pinned(keys, "waiting"), count)
            held.set()
    return costs


def child(args: argparse.Namespace) -> dict[str, float]:
    """One kvtier's figures, in this process."""
    from bench_cold_remote import StoredPrefix, remote_server
    from bench_look_spacing import timed_load

    with remote_server("redis", args.threads, args.size) as (config, _):
        figures = lookup_costs({**config, "io_threads": args.threads}, args.keys)
        stored = StoredPrefix({**config, "io_threads": args.threads}, args.size, args.chunk)
        seconds = [timed_load(stored, 1, None) for _ in range(args.prefixes)]
        stored.discard()
    return {**figures, "prefix_s": statistics.median(seconds)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    options = {o: getattr(args, o) for o in ("keys", "size", "chunk", "prefixes", "threads")}
    runs = take_turns(__file__, args.baseline_src, args.pairs, options)
    report: dict[str, Any] = {
        "keys": args.keys,
        "size": args.size,
        "chunk": args.chunk,
        "pairs": args.pairs,
        "p50": medians(runs, FIGURES),
    }
    if "baseline" in runs:
        report["baseline_over_kvtier"] = baseline_over_kvtier(runs, FIGURES)
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['keys']} keys; redis prefix of {report['size']} bytes in chunks of "
        f"{report['chunk']}; medians of {report['pairs']} pairs of processes"
    )
    print(f"{'':10} {'look µs/key':>12} {'memory µs':>10} {'redis µs':>9} {'prefix s':>9}")
    for name, figures in report["p50"].items():
        print(
            f"{name:10} "
            + " ".join(
                f"{figures[f]:>{w}.3f}" for f, w in zip(FIGURES, (12, 10, 9, 9), strict=True)
            )
        )
    print_ratios(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2048, help="chunks of the looked-up prefix")
    parser.add_argument("--size", type=parse_size, default=512 << 20, help="the redis prefix")
    parser.add_argument("--chunk", type=parse_size, default=256 << 10)
    parser.add_argument("--prefixes", type=int, default=8, help="cold prefixes per process")
    parser.add_argument("--threads", type=int, default=4, help="the redis tier's io_threads")
    parser.add_argument("--quick", action="store_true", help="64 keys, 8 MiB, one pair")
    add_options(parser)
    args = parser.parse_args()
    if args.quick:
        args.keys, args.size, args.prefixes, args.pairs = 64, 8 << 20, 2, 1
    serve(args, child, measure, print_table)


if __name__ == "__main__":
    main()
