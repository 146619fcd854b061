"""kvtier: tiered KV-cache offloading for LLM inference engines."""

from kvtier.config import KVTierConfig, TierConfig, load_config
from kvtier.errors import (
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
from kvtier.facade import KVCache
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.layout import FORMAT_VERSION, KVLayout
from kvtier.manager import LookupResult, TieringManager
from kvtier.policies import CachePolicy, CachePolicyFactory, register_policy
from kvtier.specs import OffloadingSpec, OffloadingSpecFactory, register_spec
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
    "ChunkKey",
    "ConfigError",
    "CorruptChunkError",
    "JobResult",
    "KVCache",
    "KVLayout",
    "KVTierConfig",
    "KVTierError",
    "LayoutMismatchError",
    "Lookup",
    "LookupContext",
    "LookupResult",
    "MissingDependencyError",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "PluginLoadError",
    "PluginTypeError",
    "SecondaryTier",
    "SecondaryTierFactory",
    "ThreadedTier",
    "TierConfig",
    "TierOptions",
    "TieringManager",
    "TransferJob",
    "UnknownPluginError",
    "UntrustedModuleError",
    "chunk_keys",
    "load_config",
    "register_policy",
    "register_spec",
    "register_tier",
]
