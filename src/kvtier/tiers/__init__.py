"""Secondary tiers and their factory."""

from kvtier.tiers.backend import Backend, BackendRuntime, RemoteTierOptions
from kvtier.tiers.base import (
    HealthCheck,
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    TierMetric,
    TierOptions,
    TierStats,
    TransferJob,
)
from kvtier.tiers.factory import SecondaryTierFactory, register_tier, tier_registry
from kvtier.tiers.threaded import ThreadedTier, ThreadedTierOptions

__all__ = [
    "Backend",
    "BackendRuntime",
    "HealthCheck",
    "JobResult",
    "Lookup",
    "LookupContext",
    "RemoteTierOptions",
    "SecondaryTier",
    "SecondaryTierFactory",
    "ThreadedTier",
    "ThreadedTierOptions",
    "TierMetric",
    "TierOptions",
    "TierStats",
    "TransferJob",
    "register_tier",
    "tier_registry",
]
