"""Every experiment of the lab on the traces, as the share of the LRU-to-MIN gap it closes.

    python benchmarks/policy_lab/run.py [--trace FILE] [--batch 1 --batch 16] [--quick]

Each policy (with its parameters) is replayed as ``kvtier simulate``
replays (``kvtier.sim.replay.replay``), with ``lru`` and Belady's MIN from
the same run, at 5 % and 10 % of each trace's distinct chunks, one request
at a time and in engine steps of 16 (vLLM's scheduler: 16 lookups, then 16
stores). Traces: Mooncake's synthetic trace (``--trace``, by default found
as ``benchmarks/traces.py`` finds it; left out, with a note, when absent)
and the generated chat of seeds 1-3. Prints one Markdown table per step
size; ``--quick``: small traces, for tests.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from traces import mooncake_trace

from kvtier.policies import CachePolicy, CachePolicyFactory
from kvtier.sim.replay import belady_min, replay
from kvtier.sim.synthetic import ChatShape, chat_trace
from kvtier.sim.trace import Request, distinct_blocks, parse_records, read_trace
from policy_lab.chains import ChainBonus, SessionRoot
from policy_lab.classes import FrequencyClasses, SegmentedLRU
from policy_lab.hazard import HazardClasses
from policy_lab.hit_density import HitDensity
from policy_lab.recency import LRFU, BimodalInsertion
from policy_lab.tinylfu import WTinyLFU

Build = Callable[[int], CachePolicy]


def _shipped(name: str) -> Build:
    return lambda capacity: CachePolicyFactory.create_cache_policy(name, capacity)


def _seeded(cls: Any, **params: Any) -> Build:
    return lambda capacity: cls(capacity, rng=random.Random(0), **params)


#: Name (with parameters) -> how to build it at a capacity.
EXPERIMENTS: dict[str, Build] = {
    "leaf-lru (shipped)": _shipped("leaf-lru"),
    "segmented LRU, 80 % protected, ghosts = slots": _seeded(SegmentedLRU),
    "frequency classes 1 / 2 / 3+": _seeded(FrequencyClasses, classes=3),
    "LRFU, λ = 0.01 a request": _seeded(LRFU, lam=0.01),
    "LRFU, λ = 0.1 a request": _seeded(LRFU, lam=0.1),
    "bimodal insertion per request, 1/32 at MRU": _seeded(BimodalInsertion),
    "bonus for fan-out ≥ 2, 200 requests": _seeded(ChainBonus, bonus="fan-out", requests=200),
    "bonus for an extended chain, 50 requests": _seeded(ChainBonus, bonus="extension", requests=50),
    "bonus for shallowness, 100 / (1 + depth) requests": _seeded(
        ChainBonus, bonus="shallow", requests=100
    ),
    "session root seen before, kept longer": _seeded(SessionRoot),
    "hit density by class and age (LHD-like), 64 samples": _seeded(HitDensity),
    "hazard by use class, ghosts = slots": _seeded(HazardClasses),
    "W-TinyLFU, window 1 %": _seeded(WTinyLFU, window_share=0.01),
    "W-TinyLFU, window 20 %": _seeded(WTinyLFU, window_share=0.2),
}

CAPACITIES = (0.05, 0.10)


@dataclass(frozen=True)
class Trace:
    name: str
    requests: list[Request]


def traces(path: Path | None, quick: bool) -> tuple[list[Trace], list[str]]:
    """The traces to replay, and notes on any left out."""
    notes: list[str] = []
    chosen: list[Trace] = []
    found = path if path is not None else mooncake_trace()
    if found is None:
        notes.append("Mooncake's synthetic trace not found: left out (see benchmarks/traces.py)")
    else:
        limit = 800 if quick else None
        chosen.append(Trace("Mooncake", read_trace(found, limit=limit)))
    shape = ChatShape(conversations=150) if quick else ChatShape()
    for seed in (1,) if quick else (1, 2, 3):
        records = chat_trace(seed, shape)
        chosen.append(Trace(f"chat {seed}", parse_records(enumerate(records, 1), "chat")))
    return chosen, notes


def gap_table(trace_list: list[Trace], batch: int) -> tuple[list[str], dict[str, list[float]]]:
    """Per experiment, per trace and capacity: the share of the LRU-to-MIN gap closed."""
    columns: list[str] = []
    closed: dict[str, list[float]] = {name: [] for name in EXPERIMENTS}
    for trace in trace_list:
        distinct = distinct_blocks(trace.requests)
        for share in CAPACITIES:
            slots = max(1, int(share * distinct))
            columns.append(f"{trace.name} {100 * share:.0f} %")
            optimum = belady_min(trace.requests, slots, batch=batch).hit_ratio
            lru = replay(trace.requests, _shipped("lru")(slots), "lru", batch=batch).hit_ratio
            for name, build in EXPERIMENTS.items():
                ratio = replay(trace.requests, build(slots), name, batch=batch).hit_ratio
                closed[name].append((ratio - lru) / (optimum - lru))
    return columns, closed


def markdown(columns: list[str], closed: dict[str, list[float]]) -> str:
    lines = [
        "| policy | " + " | ".join(columns) + " |",
        "| --- |" + " --- |" * len(columns),
    ]
    for name, values in closed.items():
        cells = (f"{100 * v:+.1f} %".replace("-", "−") for v in values)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="Mooncake's synthetic trace")
    parser.add_argument("--batch", type=int, action="append", help="steps of N (repeatable)")
    parser.add_argument("--quick", action="store_true", help="small traces, for tests")
    args = parser.parse_args()
    trace_list, notes = traces(args.trace, args.quick)
    for note in notes:
        print(note, file=sys.stderr)
    for batch in args.batch or [1, 16]:
        print(f"\nShare of the LRU-to-MIN gap closed, {batch} request(s) a step:\n")
        print(markdown(*gap_table(trace_list, batch)))


if __name__ == "__main__":
    main()
