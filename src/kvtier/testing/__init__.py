"""Contract test-suites that ship with kvtier, for its own tiers and yours.

Test an out-of-tree tier with one line::

    from kvtier.testing import TierContractTests

    class TestAcmeTier(TierContractTests):
        tier_config = {"type": "AcmeTier", "module_path": "acme_kv.tiers", "bucket": "kv"}

``TierContractTests[AcmeTier]`` also checks that the entry builds an
``AcmeTier`` and types the suite's harness as one over it. Test
a cache policy likewise with :class:`PolicyContractTests`, and a chunk codec
with :class:`CodecContractTests`. Requires pytest.
Every call the suites make into a tier or policy is bounded by a
:class:`HangGuard` (``call_timeout_s``), so a hang fails the test instead of
hanging the run.
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
