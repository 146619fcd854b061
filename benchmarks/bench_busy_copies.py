"""A prefix copied into and out of kvtier's CPU tier, alone and beside a
thread that runs Python without pause (an engine's busy loop, say).

Per kvtier (``--baseline-src`` runs an older kvtier's src alike, the two
taking turns going first), each in a process of its own per pair, the
median over ``--rounds`` of:

* ``store``: :meth:`KVCache.store` of a ``--size`` prefix from an array
  (chunks of ``--chunk``) into free CPU slots;
* ``load``: :meth:`KVCache.load_prefix` of the same prefix, all CPU hits,
  into an array;
* ``fs``: the same once the CPU tier was emptied, every chunk promoted from
  an ``fs`` tier in a temporary directory (its files in the page cache):
  the tier's workers give up the lock once a chunk file too;
* ``raw``: one numpy copy of as many bytes, the floor of all three;

each ``alone`` and ``busy``: beside a thread counting in a Python loop.
The busy figures show what a copy that gives up the interpreter lock once
per chunk pays: it waits for the lock to come back, up to the switch
interval (5 ms), at every chunk. Reports seconds (medians over pairs),
kvtier ÷ raw, and with a baseline, baseline ÷ kvtier per pair (above 1:
this one is faster).

Run: ``python benchmarks/bench_busy_copies.py [--size 256MiB] [--chunk 1MiB]
[--pairs 3] [--baseline-src DIR] [--json]``; ``--quick``: 8 MiB, one pair.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench_cold import parse_size
from paired import add_options, baseline_over_kvtier, medians, print_ratios, serve, take_turns

MOVES = ("store", "load", "fs", "raw")
FIGURES = tuple(f"{move}_{when}_s" for move in MOVES for when in ("alone", "busy"))


@contextmanager
def busy(on: bool) -> Iterator[None]:
    """A thread that runs Python without pause while the block runs (``on``)."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, daemon=True)
    if on:
        thread.start()
        time.sleep(0.01)  # running before the timed part starts
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def timed(
    call: Callable[[], object],
    rounds: int,
    busy_thread: bool,
    before: Callable[[], object] = lambda: None,
) -> float:
    """Median seconds of ``call`` (``before`` it, untimed) over ``rounds``,
    with or without a busy thread."""
    seconds = []
    with busy(busy_thread):
        for _ in range(rounds):
            before()
            started = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def child(args: argparse.Namespace) -> dict[str, float]:
    """This kvtier's figures, in this process."""
    import tempfile

    import numpy as np

    from kvtier import KVCache, KVLayout

    chunks = args.size // args.chunk
    # One token a chunk, of the chunk's bytes: fp16 K and V, one layer, one head.
    layout = KVLayout(
        model_id="bench-busy-copies",
        num_layers=1,
        num_kv_heads=1,
        head_dim=args.chunk // 4,
        dtype="float16",
        chunk_tokens=1,
    )
    rows = np.random.default_rng(7).integers(0, 256, (chunks, layout.slot_bytes), dtype=np.uint8)
    out = np.ones_like(rows)
    tokens = list(range(chunks))
    config = {"chunk_tokens": 1, "cpu_bytes_to_use": 2 * args.size}
    figures: dict[str, float] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-busy-") as root,
        KVCache(config, layout) as cache,
        KVCache({**config, "secondary_tiers": [{"type": "fs", "root_dir": root}]}, layout) as fs,
    ):
        cache.manager.primary.buffer.wait_populated()
        fs.manager.primary.buffer.wait_populated()
        fs.store(tokens, rows)
        fs.drain()  # every chunk in the fs tier too

        def store() -> None:
            if cache.store(tokens, rows) != chunks:
                raise SystemExit("the prefix was not stored whole")

        def load(source: Any = cache) -> None:
            if source.load_prefix(tokens, out) != chunks:
                raise SystemExit("the prefix was not loaded whole")

        def cleared(empty: Any = None) -> Callable[[], None]:
            """Before a load: ``out`` zeroed (and ``empty``'s CPU tier emptied)."""

            def clear() -> None:
                out[:] = 0
                if empty is not None:
                    empty.reset()

            return clear

        def checked(figure: float) -> float:
            """``figure``, once the last load's bytes are the stored ones."""
            if not np.array_equal(out, rows):
                raise SystemExit("a loaded byte differs from the stored one")
            return figure

        def raw() -> None:
            np.copyto(out, rows)

        for when in ("alone", "busy"):
            busy_now = when == "busy"
            figures[f"store_{when}_s"] = timed(store, args.rounds, busy_now, cache.reset)
            figures[f"load_{when}_s"] = checked(timed(load, args.rounds, busy_now, cleared()))
            figures[f"fs_{when}_s"] = checked(
                timed(lambda: load(fs), args.rounds, busy_now, cleared(fs))
            )
            figures[f"raw_{when}_s"] = timed(raw, args.rounds, busy_now)
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    options = {o: getattr(args, o) for o in ("size", "chunk", "rounds")}
    runs = take_turns(__file__, args.baseline_src, args.pairs, options)
    p50 = medians(runs, FIGURES)
    report: dict[str, Any] = {
        "size": args.size,
        "chunk": args.chunk,
        "pairs": args.pairs,
        "p50": p50,
        "over_raw": {
            name: {
                f"{move}_{when}": figures[f"{move}_{when}_s"] / figures[f"raw_{when}_s"]
                for move in ("store", "load", "fs")
                for when in ("alone", "busy")
            }
            for name, figures in p50.items()
        },
    }
    if "baseline" in runs:
        copies = [f for f in FIGURES if not f.startswith("raw")]
        report["baseline_over_kvtier"] = baseline_over_kvtier(runs, copies)
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"a prefix of {report['size']} bytes in chunks of {report['chunk']}, "
        f"to and from the CPU tier; seconds, medians of {report['pairs']} pairs of processes"
    )
    print(f"{'':10} " + " ".join(f"{f[:-2]:>11}" for f in FIGURES))
    for name, figures in report["p50"].items():
        print(f"{name:10} " + " ".join(f"{figures[f]:>11.4f}" for f in FIGURES))
    for name, ratios in report["over_raw"].items():
        print(f"{name} ÷ raw: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print_ratios(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20, help="the prefix's bytes")
    parser.add_argument("--chunk", type=parse_size, default=1 << 20, help="a chunk's bytes")
    parser.add_argument("--rounds", type=int, default=5, help="times each figure is taken")
    parser.add_argument("--quick", action="store_true", help="8 MiB, one pair")
    add_options(parser)
    args = parser.parse_args()
    if args.quick:
        args.size, args.pairs, args.rounds = 8 << 20, 1, 2
    serve(args, child, measure, print_table)


if __name__ == "__main__":
    main()
