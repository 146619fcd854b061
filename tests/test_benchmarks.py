"""The benchmarks' drivers, run in their quick modes: sane output, not figures.

Nothing here asserts a time or a speed (CI machines are shared and noisy);
only that each driver runs end to end and reports consistent counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_quick(script: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("KVTIER_SEED_VENV", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_bench_primary_replays_the_same_trace_through_every_system() -> None:
    out = run_quick("bench_primary.py")
    rows = {(row["system"], row["policy"]): row for row in out["results"]}
    policies = {"lru", "arc", "s3fifo", "leaf-lru"}
    assert set(rows) == {("dict-lru", "lru")} | {("kvtier", p) for p in policies}
    assert "seed not measured" in out["note"]
    trace = out["trace"]
    for row in rows.values():
        assert row["seconds"] > 0 and row["ops_per_s"] > 0
        assert 0 < row["hit_chunks"] <= row["lookup_chunks"]
        assert 0 < row["hit_rate"] < 1
        # Every request looks up at least one chunk and at most all of them.
        assert trace["requests"] <= row["lookup_chunks"] <= row["chunk_ops"]
        assert row["vs_dict_lru"] > 0 and row["vs_seed"] is None
        low, high = row["vs_dict_lru_range"]
        assert low <= row["vs_dict_lru"] <= high
    # Every system saw the same trace: the same chunks in all.
    assert len({round(row["hit_chunks"] / row["hit_rate"]) for row in rows.values()}) == 1
    assert rows[("dict-lru", "lru")]["vs_dict_lru"] == pytest.approx(1.0)


def test_bench_primary_times_each_policy_alone_on_the_calls_it_got() -> None:
    out = run_quick("bench_primary.py", "--policy-cost")
    assert set(out["policy_seconds"]) == {"lru", "arc", "s3fifo", "leaf-lru"}
    assert all(seconds > 0 for seconds in out["policy_seconds"].values())


def test_bench_primary_refuses_zero_rounds() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_primary.py"), "--rounds", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr


def test_bench_promotion_promotes_every_chunk_of_each_size() -> None:
    out = run_quick("bench_promotion.py")
    rows = out["results"]
    assert [row["chunks"] for row in rows] == [2, 4, 8]
    for row in rows:
        # A full CPU tier: one idle chunk gives way for each promoted one.
        assert row["evictions"] == row["chunks"]
        assert row["lookup_us_per_chunk"] > 0 and row["promotion_us_per_chunk"] > 0
    assert rows[0]["lookup_vs_smallest"] == pytest.approx(1.0)
    assert rows[0]["promotion_vs_smallest"] == pytest.approx(1.0)
