"""The lab's unshipped policies (benchmarks/policy_lab) keep the policy contract,
and its command regenerates the tables of docs/policies-and-specs.md."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kvtier.testing import PolicyContractTests  # noqa: E402


class TestSegmentedLRU(PolicyContractTests):
    policy_name = "SegmentedLRU"
    module_path = "policy_lab.classes"


class TestFrequencyClasses(PolicyContractTests):
    policy_name = "FrequencyClasses"
    module_path = "policy_lab.classes"


class TestLRFU(PolicyContractTests):
    policy_name = "LRFU"
    module_path = "policy_lab.recency"


class TestBimodalInsertion(PolicyContractTests):
    policy_name = "BimodalInsertion"
    module_path = "policy_lab.recency"


class TestChainBonus(PolicyContractTests):
    policy_name = "ChainBonus"
    module_path = "policy_lab.chains"


class TestSessionRoot(PolicyContractTests):
    policy_name = "SessionRoot"
    module_path = "policy_lab.chains"


class TestWTinyLFU(PolicyContractTests):
    policy_name = "WTinyLFU"
    module_path = "policy_lab.tinylfu"


class TestHitDensity(PolicyContractTests):
    policy_name = "HitDensity"
    module_path = "policy_lab.hit_density"


class TestHazardClasses(PolicyContractTests):
    policy_name = "HazardClasses"
    module_path = "policy_lab.hazard"


def test_the_lab_command_replays_every_experiment_on_small_traces() -> None:
    import os
    import subprocess

    from policy_lab.run import EXPERIMENTS

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "KVTIER_TRACES": str(ROOT / "none")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/policy_lab/run.py"), "--quick", "--batch", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Mooncake's synthetic trace not found" in done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| policy | chat 1 5 % | chat 1 10 % |"
    assert rows[1] == "| --- | --- | --- |"
    assert [row.split(" | ")[0][2:] for row in rows[2:]] == list(EXPERIMENTS)
    # Every cell a signed share of the gap.
    cells = [cell for row in rows[2:] for cell in row[2:-2].split(" | ")[1:]]
    assert len(cells) == 2 * len(EXPERIMENTS)
    assert all(cell[0] in "+−" and cell.endswith(" %") for cell in cells)
