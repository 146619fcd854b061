"""The configuration's plain runtime sections: no plugin classes in them.

The runtime (the manager, backpressure, metrics, trace recording) imports
these, never the loader, which resolves tier and policy classes and so sits
above the runtime.
"""

from __future__ import annotations

from pydantic import ByteSize, Field, model_validator

from kvtier.options import Options


class BackpressureConfig(Options):
    """When a secondary tier falls behind, new stores to it are dropped (and
    counted) until it catches up; loads always go on."""

    max_inflight_stores: int = Field(default=16, ge=1)
    """Store jobs a tier may have in flight before further stores are dropped."""

    high_latency_s: float = Field(default=2.0, gt=0)
    """Average seconds per stored chunk above which a tier counts as pressured."""

    low_latency_s: float = Field(default=0.5, gt=0)
    """Average seconds per stored chunk below which a pressured tier recovers."""

    smoothing: float = Field(default=0.2, gt=0, le=1)
    """Weight of the newest job in the moving average of store latency."""

    @model_validator(mode="after")
    def _recovers_below_where_it_is_pressured(self) -> BackpressureConfig:
        if self.low_latency_s > self.high_latency_s:
            raise ValueError(
                f"low_latency_s ({self.low_latency_s}) is above high_latency_s "
                f"({self.high_latency_s}): a tier would recover at latencies that "
                "pressure it, flapping between the two"
            )
        return self


class MetricsConfig(Options):
    """Prometheus metrics of the tiers and the primary tier."""

    port: int | None = Field(default=None, ge=0, le=65535)
    """Serve ``/metrics`` over HTTP on this port (``0``: any free port); unset: no server."""

    host: str = "127.0.0.1"
    """Address the metrics server listens on; loopback unless you mean to expose it."""

    global_registry: bool = False
    """Register in prometheus_client's process-wide registry (one kvtier cache per
    process) instead of a registry of the cache's own."""


class TraceRecordingConfig(Options):
    """Recording each request's chunk keys, anonymised, for ``kvtier simulate``."""

    path: str | None = None
    """Append one JSON line per request to this file; unset: nothing is recorded."""

    max_bytes: ByteSize = Field(default=ByteSize(1 << 30), gt=0)
    """Size at which the file is rotated to ``PATH.1`` (the previous ``.1`` is dropped)."""

    queue_size: int = Field(default=4096, ge=1)
    """Requests waiting for the writer thread; past it, requests are dropped and counted."""
