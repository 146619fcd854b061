"""The "÷ seed" column of docs/tuning.md: bench_primary.py's comparison with the
seed's CPUOffloadingManager, run in vLLM's environment (its quick mode: the
drivers and their counts, not a figure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_primary_measures_the_seed_beside_kvtier() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_primary.py"),
            "--quick",
            "--json",
            "--seed-venv",
            sys.prefix,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "seed: vllm " in out["note"], out["note"]
    rows = {(row["system"], row["policy"]): row for row in out["results"]}
    assert {("seed", "lru"), ("seed", "arc")} <= set(rows)
    for (system, _), row in rows.items():
        if system == "seed":
            assert row["vs_seed"] is None and row["ops_per_s"] > 0
        else:
            assert row["vs_seed"] is not None and row["vs_seed"] > 0
        assert 0 < row["hit_chunks"] <= row["lookup_chunks"]
    # Every system, the seed's included, replayed the same trace: the same chunks in all.
    assert len({round(row["hit_chunks"] / row["hit_rate"]) for row in rows.values()}) == 1
