"""The typed configuration model: what the loader builds and the runtime reads.

The loader (:mod:`kvtier.config.loader`) resolves tier, policy and spec
classes, so it imports the specs; the specs and the runtime import these
types from here, never the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ByteSize, ConfigDict, Field, field_validator

from kvtier.codecs import CodecConfig
from kvtier.config.sections import BackpressureConfig, MetricsConfig, TraceRecordingConfig
from kvtier.fleet.base import ClusterIndex, IndexOptions
from kvtier.options import Options
from kvtier.policies.base import CachePolicy
from kvtier.policies.factory import policy_registry
from kvtier.primary.buffer import shared_name_problem
from kvtier.tiers.base import SecondaryTier, TierOptions


@dataclass(frozen=True)
class TierConfig:
    """One validated ``secondary_tiers`` entry."""

    tier_type: str
    module_path: str | None
    tier_class: type[SecondaryTier]
    options: TierOptions
    #: The entry's ``codec``; ``None``: chunks stored as they are (``none``).
    codec: CodecConfig | None = None

    def as_dict(self) -> dict[str, Any]:
        """The entry as a factory takes it (options in their validated form)."""
        entry: dict[str, Any] = {
            "type": self.tier_type,
            **self.options.model_dump(exclude_unset=True),
        }
        if self.module_path is not None:
            entry["module_path"] = self.module_path
        if self.codec is not None:
            entry["codec"] = self.codec.as_dict()
        return entry


@dataclass(frozen=True)
class IndexConfig:
    """The validated ``index`` section: the cluster index this node publishes to."""

    index_type: str
    module_path: str | None
    index_class: type[ClusterIndex]
    options: IndexOptions


class KVTierConfig(Options):
    """The whole kvtier configuration. Build it with :func:`load_config`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    chunk_tokens: int = Field(default=256, gt=0)
    """Tokens per chunk: the unit of storage, lookup and transfer."""

    cpu_bytes_to_use: ByteSize = Field(default=ByteSize(1 << 30), gt=0)
    """Size of the CPU primary tier (e.g. ``8GiB``); rounded down to whole chunks.
    More than the machine (or its container) has available when the cache
    starts, or than ``/dev/shm`` has free for ``shared_memory_name``, fails then."""

    eviction_policy: str = "leaf-lru"
    """Cache policy of the primary tier: ``leaf-lru``, ``lru``, ``arc``, ``s3fifo`` or an
    out-of-tree name."""

    cache_policy_module_path: str | None = None
    """Module to import an out-of-tree ``eviction_policy`` class from (trusted input)."""

    spec_name: str = "tiering"
    """Offloading spec that wires the tiers together."""

    spec_module_path: str | None = None
    """Module to import an out-of-tree ``spec_name`` class from (trusted input)."""

    shared_memory_name: str | None = None
    """Put the primary tier in ``/dev/shm/NAME`` so another process can map its slots."""

    @field_validator("shared_memory_name")
    @classmethod
    def _a_file_name(cls, name: str | None) -> str | None:
        problem = None if name is None else shared_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name

    populate_primary: bool = True
    """Map all of the primary tier's memory at start, on a background thread,
    instead of on first use: promotions then read into slots already mapped
    (faulting them in on the I/O threads cut cold-prefix speed tenfold).
    ``false`` leaves memory the engine has not used yet uncommitted."""

    warm_start_bytes: ByteSize = Field(default=ByteSize(0), ge=0)
    """At start, promote up to this many bytes of the chunks the secondary
    tiers used most recently (``fs`` knows them) into free slots of the CPU
    tier, in the background and evicting nothing, so that a restarted
    engine's first requests find their prefixes in memory. ``0``: off; less
    than one chunk fails at start."""

    secondary_tiers: tuple[TierConfig, ...] = ()
    """Tiers behind the primary one, looked up in this order."""

    index: IndexConfig | None = None
    """The cluster index (``type: redis`` or an out-of-tree ``type`` +
    ``module_path``): the node publishes which chunks it holds there, routers
    and the ``p2p`` tier read it. Unset: no index."""

    backpressure: BackpressureConfig = BackpressureConfig()
    """Per-tier store backpressure."""

    metrics: MetricsConfig = MetricsConfig()
    """Prometheus metrics and their optional HTTP endpoint."""

    trace_recording: TraceRecordingConfig = TraceRecordingConfig()
    """A trace of the requests' prefixes, off the request path (off by default)."""

    def problems(self) -> list[tuple[str, str]]:
        """What the configuration gets wrong across its fields, which no field's
        own check sees, as ``(field, problem)``."""
        return self._warm_start_problems() + self._shared_store_problems()

    def _shared_store_problems(self) -> list[tuple[str, str]]:
        """Two tiers over one store: see :meth:`TierOptions.store_location`."""
        problems = []
        first: dict[str, int] = {}
        for index, tier in enumerate(self.secondary_tiers):
            location = tier.options.store_location()
            if location is None:
                continue
            earlier = first.setdefault(location, index)
            if earlier != index:
                problems.append(
                    (
                        f"secondary_tiers[{index}]",
                        f"keeps its chunks where secondary_tiers[{earlier}] does ({location}): "
                        "each chunk would be held, counted and evicted twice; give each "
                        "tier a place of its own, or keep one of the two entries",
                    )
                )
        return problems

    def _warm_start_problems(self) -> list[tuple[str, str]]:
        """What keeps ``warm_start_bytes`` from working: it needs room to fill
        and a tier that knows what it held."""
        wanted = int(self.warm_start_bytes)
        if not wanted:
            return []
        problems = []
        if wanted > int(self.cpu_bytes_to_use):
            problems.append(
                (
                    "warm_start_bytes",
                    f"{wanted} bytes exceed cpu_bytes_to_use ({int(self.cpu_bytes_to_use)}): "
                    "a warm start fills the CPU tier at most",
                )
            )
        if not any(tier.tier_class.knows_recent_use for tier in self.secondary_tiers):
            problems.append(
                (
                    "warm_start_bytes",
                    "no secondary tier can name the chunks it held before a restart "
                    "(fs can): there is nothing to warm from",
                )
            )
        return problems

    def policy_class(self) -> type[CachePolicy]:
        """The ``eviction_policy`` class (the registry resolves it once)."""
        return policy_registry.resolve(
            self.eviction_policy, self.cache_policy_module_path, entry="eviction_policy"
        )
