"""The lab's unshipped policies (benchmarks/policy_lab) keep the policy contract,
and its command regenerates the tables of docs/policies-and-specs.md."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
