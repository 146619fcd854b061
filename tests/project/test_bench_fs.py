"""``benchmarks/bench_fs.py`` in its quick mode: the driver, not the figures.

Nothing here asserts a speed (CI machines are shared and noisy): only that
every system stores and loads every chunk (the driver checks each byte and
exits non-zero otherwise) and that the report is consistent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fs_quick_moves_every_chunk_through_raw_and_kvtier(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    root = tmp_path / "bench"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_fs.py"),
            "--quick",
            "--threads",
            "4",
            "--root",
            str(root),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["volume"] == 8 << 20
    assert set(report["sizes"]) == {str(2 << 20), str(256 << 10)}
    for entry in report["sizes"].values():
        assert entry["raw"]["checksum"] == "none"
        assert entry["kvtier"]["checksum"] == "xxh3-128"
        assert entry["raw"]["io"] == entry["kvtier"]["io"]  # same O_DIRECT choice
        for system in ("raw", "kvtier"):
            assert len(entry[system]["store_gbps"]) == len(entry[system]["load_gbps"]) == 1
            assert min(entry[system]["store_gbps"] + entry[system]["load_gbps"]) > 0
            assert entry[system]["store_cpu_us_per_chunk"] >= 0
            assert entry[system]["load_cpu_us_per_chunk"] >= 0
        ratio = entry["kvtier_vs_raw"]
        for phase in ("store", "load"):
            low, high = ratio[f"{phase}_range"]
            assert 0 < low <= ratio[phase] <= high
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []  # rounds clean up
