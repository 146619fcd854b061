"""The measured tables of docs/, regenerated from the traces by the code that made them.

    python benchmarks/doc_tables.py NAME       # print one table
    python benchmarks/doc_tables.py --check    # every quick table in docs/ as printed now?
    python benchmarks/doc_tables.py --write    # rewrite them (--all: the slow ones too)

A table in docs/ made here follows a line ``<!-- table: NAME -->``; ``--check``
exits 1 naming each one that differs from what NAME prints now. Tables on
Mooncake's trace need it (see benchmarks/traces.py); without it they are
skipped, with a note. Quick tables take seconds; slow ones (the policy lab's)
minutes, and are checked only with ``--all``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from traces import ROOT, mooncake_trace

from kvtier.cli.policy_report import run
from kvtier.sim.synthetic import ChatShape, chat_trace
from kvtier.sim.trace import Request, distinct_blocks, parse_records, read_trace

MARKER = re.compile(r"^<!-- table: ([a-z0-9-]+) -->$")
#: The vLLM-like step the policy tables show beside one request at a time.
ENGINE_STEP = 16
POLICIES = ("lru", "leaf-lru", "arc", "s3fifo")
DEFAULT_CHAT = ChatShape()


class TraceMissing(Exception):
    """A table's trace is not here."""


def mooncake() -> list[Request]:
    path = mooncake_trace()
    if path is None:
        raise TraceMissing("Mooncake's synthetic trace (see benchmarks/traces.py)")
    return read_trace(path)


def chat(seed: int, shape: ChatShape = DEFAULT_CHAT) -> list[Request]:
    return parse_records(enumerate(chat_trace(seed, shape), 1), f"chat seed {seed}")


def slots_of(requests: list[Request], percents: tuple[int, ...]) -> list[int]:
    distinct = distinct_blocks(requests)
    return [max(1, int(p / 100 * distinct)) for p in percents]


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    text = f"{100 * value:+.1f} %"
    return text.replace("-", "−")


def policy_rows(
    requests: list[Request], percents: tuple[int, ...], lead: list[str]
) -> list[list[str]]:
    """Per step size and capacity: each policy's hit ratio, MIN's, and the gap closed."""
    rows = []
    for batch in (1, ENGINE_STEP):
        report = run(requests, POLICIES, slots_of(requests, percents), progress=False, batch=batch)
        for percent, cell in zip(percents, report["capacities"], strict=True):
            entries = cell["policies"]
            closed = " / ".join(_pct(entries[name]["gap_closed"]) for name in POLICIES[1:])
            rows.append(
                [
                    *lead,
                    str(batch),
                    f"{percent} %",
                    *(f"{entries[name]['hit_ratio']:.3f}" for name in POLICIES),
                    f"{cell['min_hit_ratio']:.3f}",
                    closed,
                ]
            )
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


POLICY_HEADER = ["batch", "capacity", *POLICIES, "MIN", "gap closed"]


def simulate_mooncake() -> str:
    return markdown(POLICY_HEADER, policy_rows(mooncake(), (5, 10, 20, 50), []))


def simulate_chat() -> str:
    rows = [row for seed in (1, 2, 3) for row in policy_rows(chat(seed), (5, 10, 20), [str(seed)])]
    return markdown(["seed", *POLICY_HEADER], rows)


def simulate_secondary() -> str:
    rows = []
    cases: list[tuple[str, list[Request], tuple[int, ...], int, tuple[str, ...]]] = [
        ("Mooncake", mooncake(), (5, 10, 20), 50, ("lru", "leaf-lru", "arc")),
        ("chat, seed 1", chat(1), (5, 10), 30, ("lru", "leaf-lru")),
    ]
    for name, requests, percents, secondary, policies in cases:
        distinct = distinct_blocks(requests)
        report = run(
            requests,
            policies,
            slots_of(requests, percents),
            progress=False,
            secondary=int(secondary / 100 * distinct),
        )
        for percent, cell in zip(percents, report["capacities"], strict=True):
            tiers = [cell["policies"][p]["with_secondary"] for p in policies]

            def joined(field: str, tiers: list[dict[str, Any]] = tiers) -> str:
                values = [f"{tier[field]:.3f}" for tier in tiers]
                return values[0] if len(set(values)) == 1 else " / ".join(values)

            rows.append(
                [
                    name,
                    f"{percent} %",
                    f"{secondary} %",
                    " / ".join(policies),
                    joined("primary_hit_ratio"),
                    joined("secondary_hit_ratio"),
                    joined("hit_ratio"),
                ]
            )
    header = ["trace", "primary", "secondary", "policy", "CPU hits", "secondary hits", "both"]
    return markdown(header, rows)


def reuse_by_age() -> str:
    """P(reused within the next 100 requests | not reused for ``a`` requests)."""
    ages = (0, 100, 200, 400, 800, 1600)
    rows = []
    for name, requests in (
        ("Mooncake", mooncake()),
        ("chat, seed 1", chat(1)),
        ("chat, seed 3", chat(3)),
    ):
        rows.append([name, *(f"{p:.3f}" for p in reuse_chances(requests, ages, 100))])
    return markdown(["trace", *(f"a = {a:,}" if a else "a = 0" for a in ages)], rows)


def reuse_chances(requests: list[Request], ages: tuple[int, ...], window: int) -> list[float]:
    """For each age ``a``: of the chunks last used ``a`` requests ago (and not since),
    the share used again within the next ``window`` requests. A chunk's use is a
    request that holds it; only ages whose window ends inside the trace count."""
    last_seen: dict[int, int] = {}
    gaps: list[tuple[int, int]] = []  # (request of a use, requests until the next or None)
    for index, request in enumerate(requests):
        for block in set(request.blocks):
            if block in last_seen:
                gaps.append((last_seen[block], index - last_seen[block]))
            last_seen[block] = index
    end = len(requests)
    gaps += [(at, end + window + max(ages)) for at in last_seen.values()]  # never again
    chances = []
    for age in ages:
        # Idle for ``age`` requests after a use at ``at``: the next use is past at + age.
        alive = [gap for at, gap in gaps if gap > age and at + age + window < end]
        chances.append(sum(1 for gap in alive if gap <= age + window) / len(alive))
    return chances


def fleet_routing() -> str:
    """Each router's hit ratio and load across replicas of 1 % of the distinct
    chunks each (``kvtier simulate -c 1% -r N``), as docs/fleet.md shows them."""
    from kvtier.cli.routing_report import run_routing

    cases: list[tuple[str, list[Request], tuple[int, ...]]] = [
        ("Mooncake", mooncake(), (4, 8, 32)),
        ("chat, seed 1", chat(1), (4, 8, 32)),
        ("chat, seed 2", chat(2), (4, 32)),
    ]
    rows = []
    for name, requests, counts in cases:
        slots = slots_of(requests, (1,))[0]
        results = run_routing(requests, "lru", slots, counts, progress=False)["results"]
        if name == "Mooncake":  # a looser load cap closes hashing's lead at 32
            loose = run_routing(
                requests, "lru", slots, (32,), ("kvtier",), slack=1.0, progress=False
            )
            results += [{**row, "router": "kvtier, `--slack 1`"} for row in loose["results"]]
        shown: set[int] = set()
        for index, row in enumerate(results):
            rows.append(
                [
                    "" if index else name,
                    "" if row["replicas"] in shown else str(row["replicas"]),
                    row["router"],
                    f"{row['hit_ratio']:.3f}",
                    f"{row['request_peak']:.2f}",
                    f"{row['prefill_peak']:.2f}",
                ]
            )
            shown.add(row["replicas"])
    header = ["trace", "replicas", "router", "hit ratio", "busiest/mean requests"]
    return markdown([*header, "busiest/mean prefill"], rows)


#: Chat shapes leaf-lru was never tuned on.
CHAT_VARIANTS = {
    "chat": DEFAULT_CHAT,
    "chat, long conversations (mean_turns=12)": ChatShape(mean_turns=12.0),
    "chat, short ones, many prompts (mean_turns=2, system_prompts=64)": ChatShape(
        mean_turns=2.0, system_prompts=64
    ),
    "chat, prompts under a block (system_tokens=50-200)": ChatShape(system_tokens=(50, 200)),
}


def leaf_against_lru() -> str:
    """leaf-lru against lru on traces and shapes it was never tuned on, at five
    capacities, one request at a time and in engine steps."""
    percents = (5, 10, 20, 30, 50)
    variants: list[tuple[str, list[list[Request]]]] = []
    whole = mooncake()
    half = len(whole) // 2
    variants.append(("Mooncake, first half", [whole[:half]]))
    variants.append(("Mooncake, second half", [whole[half:]]))
    for name, shape in CHAT_VARIANTS.items():
        variants.append((f"{name}, seeds 1-3", [chat(seed, shape) for seed in (1, 2, 3)]))
    rows = []
    for name, traces in variants:
        for batch in (1, ENGINE_STEP):
            differences, closed = [], []
            for requests in traces:
                report = run(
                    requests,
                    ("lru", "leaf-lru"),
                    slots_of(requests, percents),
                    progress=False,
                    batch=batch,
                )
                for cell in report["capacities"]:
                    lru, leaf = (cell["policies"][p] for p in ("lru", "leaf-lru"))
                    differences.append(leaf["hit_ratio"] - lru["hit_ratio"])
                    if leaf["gap_closed"] is not None:
                        closed.append(leaf["gap_closed"])
            rows.append(
                [
                    name,
                    str(batch),
                    f"{min(differences):+.4f}".replace("-", "−"),
                    f"{_pct(min(closed))} to {_pct(max(closed))}",
                ]
            )
    header = ["trace", "batch", "leaf-lru − lru, least", "gap closed"]
    return markdown(header, rows)


def policy_lab(batch: int) -> Callable[[], str]:
    def table() -> str:
        from policy_lab.run import gap_table, traces
        from policy_lab.run import markdown as lab_markdown

        found, notes = traces(None, quick=False)
        if notes:
            raise TraceMissing("; ".join(notes))
        return lab_markdown(*gap_table(found, batch))

    return table


@dataclass(frozen=True)
class Table:
    make: Callable[[], str]
    quick: bool


TABLES: dict[str, Table] = {
    "simulate-mooncake": Table(simulate_mooncake, True),
    "simulate-chat": Table(simulate_chat, True),
    "simulate-secondary": Table(simulate_secondary, True),
    "reuse-by-age": Table(reuse_by_age, True),
    "fleet-routing": Table(fleet_routing, True),
    "leaf-against-lru": Table(leaf_against_lru, False),
    "policy-lab-1": Table(policy_lab(1), False),
    f"policy-lab-{ENGINE_STEP}": Table(policy_lab(ENGINE_STEP), False),
}


@dataclass
class Placed:
    """A generated table in a page: its name and the line span it fills."""

    page: Path
    name: str
    start: int
    end: int


def placed_tables(pages: list[Path] | None = None) -> list[Placed]:
    found = []
    for page in pages or sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            match = MARKER.match(line)
            if match is None:
                continue
            start = number + 1
            while start < len(lines) and not lines[start].strip():
                start += 1
            end = start
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            found.append(Placed(page, match[1], start, end))
    return found


def current(placed: Placed) -> str:
    return "\n".join(placed.page.read_text().splitlines()[placed.start : placed.end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", choices=sorted(TABLES))
    parser.add_argument("--check", action="store_true", help="compare docs/ with the tables now")
    parser.add_argument("--write", action="store_true", help="rewrite the tables in docs/")
    parser.add_argument("--all", action="store_true", help="the slow tables too")
    args = parser.parse_args()
    if args.name:
        print(TABLES[args.name].make())
        return
    if not (args.check or args.write):
        parser.error("give a table NAME, --check or --write")
    drifted = []
    for index in range(len(placed_tables())):
        placed = placed_tables()[index]  # found again: a rewrite above may move it
        table = TABLES.get(placed.name)
        if table is None:
            sys.exit(f"{placed.page.name}: unknown table {placed.name!r}")
        if not (table.quick or args.all):
            continue
        try:
            made = table.make()
        except TraceMissing as missing:
            print(f"{placed.name}: skipped, {missing} not found", file=sys.stderr)
            continue
        placed = placed_tables()[index]  # where it is now, after the minutes it may take
        if made == current(placed):
            continue
        drifted.append(f"{placed.page.relative_to(ROOT)}: {placed.name}")
        if args.write:
            lines = placed.page.read_text().splitlines()
            lines[placed.start : placed.end] = made.splitlines()
            placed.page.write_text("\n".join(lines) + "\n")
    if drifted and not args.write:
        sys.exit("tables that differ from what they print now: " + ", ".join(drifted))
    for name in drifted:
        print(f"rewrote {name}")


if __name__ == "__main__":
    main()
