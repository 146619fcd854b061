"""Secondary tiers and their factory."""

from kvtier.tiers.base import (
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    TierOptions,
    TierStats,
    TransferJob,
)
from kvtier.tiers.factory import SecondaryTierFactory, register_tier, tier_registry
from kvtier.tiers.threaded import ThreadedTier, ThreadedTierOptions

__all__ = [
    "JobResult",
    "Lookup",
    "LookupContext",
    "SecondaryTier",
    "SecondaryTierFactory",
    "ThreadedTier",
    "ThreadedTierOptions",
    "TierOptions",
    "TierStats",
    "TransferJob",
    "register_tier",
    "tier_registry",
]
