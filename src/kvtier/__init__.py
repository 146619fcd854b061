"""kvtier: tiered KV-cache offloading for LLM inference engines."""

from kvtier.config import KVTierConfig, TierConfig, load_config
from kvtier.errors import (
    ClosedError,
    ConfigError,
    CorruptChunkError,
    KVTierError,
    LayoutMismatchError,
    MissingDependencyError,
    PluginLoadError,
    PluginTypeError,
    UnknownPluginError,
    UntrustedModuleError,
)
from kvtier.facade import HeldPrefix, KVCache
from kvtier.keys import ChunkKey, KeyedTokens, chain_key, chunk_keys
from kvtier.layout import FORMAT_VERSION, KVLayout
from kvtier.manager import LookupResult, TieringManager
from kvtier.policies import CachePolicy, CachePolicyFactory, register_policy
from kvtier.residency import PRIMARY_TIER_NAME, ResidencyListener, tier_names
from kvtier.specs import OffloadingSpec, OffloadingSpecFactory, register_spec
from kvtier.status import CacheStatus, PrimaryStatus, TierStatus
from kvtier.tiers import (
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    SecondaryTierFactory,
    ThreadedTier,
    TierOptions,
    TransferJob,
    register_tier,
)

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "CachePolicy",
    "CachePolicyFactory",
    "CacheStatus",
    "ChunkKey",
    "ClosedError",
    "ConfigError",
    "CorruptChunkError",
    "HeldPrefix",
    "JobResult",
    "KVCache",
    "KVLayout",
    "KVTierConfig",
    "KVTierError",
    "KeyedTokens",
    "LayoutMismatchError",
    "Lookup",
    "LookupContext",
    "LookupResult",
    "MissingDependencyError",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "PRIMARY_TIER_NAME",
    "PrimaryStatus",
    "PluginLoadError",
    "PluginTypeError",
    "ResidencyListener",
    "SecondaryTier",
    "SecondaryTierFactory",
    "ThreadedTier",
    "TierConfig",
    "TierOptions",
    "TierStatus",
    "TieringManager",
    "TransferJob",
    "UnknownPluginError",
    "UntrustedModuleError",
    "chain_key",
    "chunk_keys",
    "load_config",
    "register_policy",
    "register_spec",
    "register_tier",
    "tier_names",
]
