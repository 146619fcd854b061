"""What mapping the primary buffer ahead costs the rest of the process.

A fresh private :class:`~kvtier.primary.SlotBuffer` of ``--size`` (``--named``:
one in ``/dev/shm``, as vLLM's engine has) is mapped
ahead on its own thread (``populate_in_background``, as ``KVCache`` does)
while the main thread maps, writes and unmaps 1 MiB in a loop: as a new
thread's stack or an allocator's arena would. Per kvtier (``--baseline-src``
runs an older kvtier's src alike, the two taking turns going first), each in
a process of its own per pair, beside ``--busy`` processes that keep the
cores busy:

* ``map_s``: how long the buffer took to map (at most ``--window`` s);
* ``p50_ms``, ``p99_ms``, ``max_ms``: the loop's ``mmap`` + write + ``munmap``;
* ``stalled_s``: the loop's time in calls over 1 ms;
* ``*_alone``: the same loop for as long again with no buffer being mapped:
  the machine's own stalls, the floor of the figures above.

Reports medians over pairs, and with a baseline, baseline ÷ kvtier per
pair (above 1: this one stalls less or maps faster).

Run: ``python benchmarks/bench_map_ahead.py [--size 2GiB] [--busy 0]
[--named] [--window 20] [--pairs 3] [--baseline-src DIR] [--json]``; ``--quick``:
64 MiB, a 2 s window, one pair.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_cold import parse_size
from paired import add_options, baseline_over_kvtier, medians, print_ratios, serve, take_turns

LOOP = ("p50_ms", "p99_ms", "max_ms", "stalled_s")
FIGURES = ("map_s", *LOOP, *(f"{figure}_alone" for figure in LOOP))
#: A call of the loop longer than this is a stall.
STALL_S = 1e-3


def mapping_loop(until: Any, window_s: float) -> tuple[list[float], float]:
    """Map, write and unmap 1 MiB until ``until()`` or ``window_s`` ran out:
    each round's seconds, and the time taken."""
    rounds: list[float] = []
    start = time.perf_counter()
    while not until() and time.perf_counter() - start < window_s:
        began = time.perf_counter()
        region = mmap.mmap(-1, 1 << 20)
        region[0] = 1
        region.close()
        rounds.append(time.perf_counter() - began)
    return rounds, time.perf_counter() - start


def loop_figures(rounds: list[float], suffix: str = "") -> dict[str, float]:
    ordered = sorted(rounds) or [0.0]
    return {
        f"p50_ms{suffix}": 1e3 * statistics.median(ordered),
        f"p99_ms{suffix}": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        f"max_ms{suffix}": 1e3 * ordered[-1],
        f"stalled_s{suffix}": sum(r for r in ordered if r > STALL_S),
    }


def child(args: argparse.Namespace) -> dict[str, float]:
    from kvtier.primary import SlotBuffer

    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
    ]
    try:
        time.sleep(0.2 if spinners else 0)
        slot = 2 << 20
        name = f"kvtier-bench-map-{os.getpid()}" if args.named else None
        buffer = SlotBuffer(max(1, parse_size(args.size) // slot), slot, shared_name=name)
        try:
            buffer.populate_in_background()
            rounds, took = mapping_loop(lambda: buffer.wait_populated(0), args.window)
        finally:
            buffer.close()
        alone, _ = mapping_loop(lambda: False, max(took, 1.0))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return {"map_s": took, **loop_figures(rounds), **loop_figures(alone, "_alone")}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.size, args.window, args.pairs = "64MiB", 2.0, 1
    options = {"size": args.size, "busy": args.busy, "window": args.window, "named": args.named}
    runs = take_turns(__file__, args.baseline_src, args.pairs, options)
    return {
        "size": parse_size(args.size),
        "busy": args.busy,
        "named": args.named,
        "pairs": args.pairs,
        "medians": medians(runs, FIGURES),
        "baseline_over_kvtier": baseline_over_kvtier(runs, ("map_s", "p50_ms", "max_ms")),
    }


def print_table(report: dict[str, Any]) -> None:
    kind = "named" if report["named"] else "private"
    print(
        f"a {report['size'] >> 20} MiB {kind} buffer mapped ahead beside {report['busy']} busy "
        f"processes, medians of {report['pairs']} pairs"
    )
    print(f"{'':10}" + "".join(f"{figure:>16}" for figure in FIGURES[:5]))
    for name, figures in report["medians"].items():
        print(f"{name:10}" + "".join(f"{figures[f]:16.3f}" for f in FIGURES[:5]))
        alone = ", ".join(f"{f} {figures[f + '_alone']:.3f}" for f in LOOP)
        print(f"{'':10}with nothing mapped: {alone}")
    print_ratios(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--busy", type=int, default=0, help="processes keeping the cores busy")
    parser.add_argument("--named", action="store_true", help="in /dev/shm, as vLLM's")
    parser.add_argument("--window", type=float, default=20.0, help="most seconds to map for")
    parser.add_argument("--quick", action="store_true")
    add_options(parser)
    serve(parser.parse_args(), child, measure, print_table)


if __name__ == "__main__":
    main()
