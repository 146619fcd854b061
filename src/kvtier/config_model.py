"""The validated configuration's types, apart from the loader that builds them.

:mod:`kvtier.config` (the loader) resolves tier, policy and spec classes, so
it imports the specs; the specs and the runtime import these types from here.
:mod:`kvtier.config` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, PrivateAttr

from kvtier.policies.base import CachePolicy
from kvtier.policies.factory import policy_registry
from kvtier.settings import BackpressureConfig, MetricsConfig, TraceRecordingConfig
from kvtier.tiers.base import SecondaryTier, TierOptions


@dataclass(frozen=True)
class TierConfig:
    """One validated ``secondary_tiers`` entry."""

    tier_type: str
    module_path: str | None
    tier_class: type[SecondaryTier]
    options: TierOptions

    def as_dict(self) -> dict[str, Any]:
        """The entry as a factory takes it (options in their validated form)."""
        entry: dict[str, Any] = {
            "type": self.tier_type,
            **self.options.model_dump(exclude_unset=True),
        }
        if self.module_path is not None:
            entry["module_path"] = self.module_path
        return entry


class KVTierConfig(BaseModel):
    """The whole kvtier configuration. Build it with :func:`load_config`."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, arbitrary_types_allowed=True, use_attribute_docstrings=True
    )

    chunk_tokens: int = Field(default=256, gt=0)
    """Tokens per chunk: the unit of storage, lookup and transfer."""

    cpu_bytes_to_use: ByteSize = Field(default=ByteSize(1 << 30), gt=0)
    """Size of the CPU primary tier (e.g. ``8GiB``); rounded down to whole chunks."""

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

    populate_primary: bool = True
    """Map all of the primary tier's memory at start, on a background thread,
    instead of on first use: promotions then read into slots already mapped
    (faulting them in on the I/O threads cut cold-prefix speed tenfold).
    ``false`` leaves memory the engine has not used yet uncommitted."""

    secondary_tiers: tuple[TierConfig, ...] = ()
    """Tiers behind the primary one, looked up in this order."""

    backpressure: BackpressureConfig = BackpressureConfig()
    """Per-tier store backpressure."""

    metrics: MetricsConfig = MetricsConfig()
    """Prometheus metrics and their optional HTTP endpoint."""

    trace_recording: TraceRecordingConfig = TraceRecordingConfig()
    """A trace of the requests' prefixes, off the request path (off by default)."""

    # Set by load_config, which resolves each class once; a configuration
    # built otherwise resolves on first use.
    _policy_class: type[CachePolicy] | None = PrivateAttr(default=None)
    _spec_class: type | None = PrivateAttr(default=None)

    def policy_class(self) -> type[CachePolicy]:
        """The ``eviction_policy`` class (looked up once per configuration)."""
        if self._policy_class is None:
            self._policy_class = policy_registry.resolve(
                self.eviction_policy, self.cache_policy_module_path, entry="eviction_policy"
            )
        return self._policy_class

    def resolved_spec_class(self) -> type | None:
        """The ``spec_name`` class :func:`~kvtier.config.load_config` resolved, if it did."""
        return self._spec_class

    def _resolved(self, policy: type[CachePolicy], spec: type) -> None:
        self._policy_class, self._spec_class = policy, spec
