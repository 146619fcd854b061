"""This kvtier against an older one (``--baseline-src``), each in processes of
its own, the two taking turns going first: what load from elsewhere on a
shared machine does to one side it does to the other."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"

#: Per kvtier (``kvtier``, ``baseline``), its figures from each pair.
Runs = dict[str, list[dict[str, float]]]


def run_child(script: str, src: Path, options: dict[str, Any]) -> dict[str, float]:
    """The figures ``script --child`` prints as JSON, run with the kvtier under
    ``src`` and ``--name value`` for each of ``options`` (a flag: ``--name``
    alone where its value is ``True``, nothing where ``False``)."""
    command = [sys.executable, str(Path(script).resolve()), "--child"]
    for name, value in options.items():
        if value is not False:
            command += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run of {src} failed:\n{done.stderr}")
    figures: dict[str, float] = json.loads(done.stdout)
    return figures


def take_turns(script: str, baseline_src: Path | None, pairs: int, options: dict[str, Any]) -> Runs:
    """:func:`run_child` of this kvtier, and of ``baseline_src`` when given,
    ``pairs`` times, the first to go alternating."""
    sources = {"kvtier": SRC}
    if baseline_src is not None:
        sources["baseline"] = baseline_src.resolve()
    runs: Runs = {name: [] for name in sources}
    for pair in range(pairs):
        order = list(sources) if pair % 2 == 0 else list(reversed(sources))
        for name in order:
            runs[name].append(run_child(script, sources[name], options))
    return runs


def medians(runs: Runs, figures: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per kvtier, each figure's median over the pairs."""
    return {
        name: {f: statistics.median(run[f] for run in taken) for f in figures}
        for name, taken in runs.items()
    }


def baseline_over_kvtier(runs: Runs, figures: Sequence[str]) -> dict[str, list[float]]:
    """Per figure, the baseline's ÷ this kvtier's, pair by pair (none without a baseline)."""
    if "baseline" not in runs:
        return {}
    return {
        f: [b[f] / k[f] for b, k in zip(runs["baseline"], runs["kvtier"], strict=True)]
        for f in figures
    }


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--pairs``, ``--baseline-src``, ``--json`` and the children's ``--child``."""
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--baseline-src", type=Path, help="an older kvtier's src, run alike")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def serve(
    args: argparse.Namespace,
    child: Callable[[argparse.Namespace], dict[str, float]],
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
) -> None:
    """A child's figures as JSON, or the pairs' report (JSON with ``--json``)."""
    if args.child:
        print(json.dumps(child(args)))
        return
    report = measure(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


def print_ratios(report: dict[str, Any]) -> None:
    """The report's ``baseline_over_kvtier``, a line per figure."""
    ratios = report.get("baseline_over_kvtier")
    if ratios:
        print("baseline ÷ kvtier, per pair:")
        for figure, values in ratios.items():
            print(f"  {figure:18} " + ", ".join(f"{v:.2f}" for v in values))
