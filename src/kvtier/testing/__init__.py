"""Contract test-suites that ship with kvtier, for its own tiers, policies and
codecs and for yours; every call they make is bounded by a hang guard.
Requires pytest.

See docs/out-of-tree-tier.md, 'Test it in one line'.
"""

from kvtier.testing.codec_suite import CodecContractTests
from kvtier.testing.faults import FaultyTier
from kvtier.testing.hang_guard import HangGuard
from kvtier.testing.policy_suite import PolicyContractTests
from kvtier.testing.registry import restore_registries
from kvtier.testing.tier_suite import TierContractTests, TierHarness, small_layout

__all__ = [
    "CodecContractTests",
    "FaultyTier",
    "HangGuard",
    "PolicyContractTests",
    "TierContractTests",
    "TierHarness",
    "restore_registries",
    "small_layout",
]
