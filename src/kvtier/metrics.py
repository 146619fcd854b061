"""Prometheus metrics of a kvtier manager, labelled by tier: a collector reads
the stats the manager and tiers keep anyway, only when scraped.

See docs/metrics.md.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.config.sections import MetricsConfig
from kvtier.errors import ConfigError
from kvtier.manager import TieringManager
from kvtier.recording import TraceRecorder
from kvtier.tiers.base import JobResult, SecondaryTier, TierMetric

logger = logging.getLogger(__name__)

PREFIX = "kvtier"
TIER_LABELS = ("tier", "tier_type")

#: Help text of the built-in :class:`TierStats` counters; fields a tier adds
#: in a subclass get a generic one.
STAT_HELP = {
    "lookups": "Answers the tier gave to lookups, PENDING ones included (the hit rate: "
    "hits / (hits + misses)).",
    "hits": "Lookups the tier answered HIT.",
    "misses": "Lookups the tier answered MISS (or failed).",
    "pending": "Lookups the tier answered PENDING (check or transfer in flight); a waiting "
    "lookup asks again.",
    "chunks_stored": "Chunks written to the tier.",
    "chunks_loaded": "Chunks read from the tier into primary slots.",
    "bytes_stored": "Chunk bytes written to the tier.",
    "bytes_loaded": "Chunk bytes read from the tier.",
    "store_failures": "Chunks that failed to store.",
    "load_failures": "Chunks that failed to load (or lookups that raised).",
    "corrupt_chunks": "Stored chunks found corrupt, torn or foreign: never served, deleted.",
    "evictions": "Chunks the tier evicted to stay within its bounds.",
    "backpressure_drops": "Chunks not cascaded to the tier because it was falling behind.",
    "codec_bytes_in": "Chunk bytes the tier's codec encoded for stores (before encoding).",
    "codec_bytes_out": "Payload bytes the tier's codec made of them (their ratio: the codec's).",
    "codec_failures": "Chunks the tier's codec failed to encode (not stored) or decode (not "
    "served, deleted).",
    "codec_refused": "Chunks loaded that another codec or other codec parameters wrote: "
    "never served, deleted.",
    "codec_timeouts": "Chunks the tier's codec took longer on than codec_timeout_s (counted "
    "in codec_failures too): not stored or not served.",
}

#: Buckets of the transfer histograms, in seconds: 100 µs to 30 s.
TRANSFER_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

_METRIC_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def _labels(index: int, tier: SecondaryTier) -> list[str]:
    return [str(index), tier.tier_type]


class _ManagerCollector(Collector):
    """Reads a manager's counters and states when scraped."""

    def __init__(self, manager: TieringManager, trace_recorder: TraceRecorder | None) -> None:
        self.manager = manager
        self.trace_recorder = trace_recorder

    def describe(self) -> Iterable[Metric]:
        # Names vary with the tiers' own fields and metrics(): registered
        # without a description, so the registry never scrapes to describe.
        return []

    def collect(self) -> Iterator[Metric]:
        manager = self.manager
        yield from self._primary()
        families: dict[str, CounterMetricFamily] = {}
        for index, tier in enumerate(manager.tiers):
            for name, value in tier.stats.as_dict().items():
                family = families.get(name)
                if family is None:
                    family = families[name] = CounterMetricFamily(
                        f"{PREFIX}_tier_{name}",
                        STAT_HELP.get(name, f"Tier counter {name!r}."),
                        labels=TIER_LABELS,
                    )
                family.add_metric(_labels(index, tier), value)
        yield from families.values()

        inflight = GaugeMetricFamily(
            f"{PREFIX}_tier_stores_inflight",
            "Store jobs in flight to the tier.",
            labels=TIER_LABELS,
        )
        pressured = GaugeMetricFamily(
            f"{PREFIX}_tier_pressured",
            "1 while the tier is under store backpressure, else 0.",
            labels=TIER_LABELS,
        )
        for index, (tier, pressure) in enumerate(
            zip(manager.tiers, manager.backpressure, strict=True)
        ):
            inflight.add_metric(_labels(index, tier), pressure.inflight)
            pressured.add_metric(_labels(index, tier), float(pressure.pressured))
        yield inflight
        yield pressured
        yield from self._extra(families.keys())
        yield from self._trace()
        yield from self._attachments()

    def _attachments(self) -> Iterator[Metric]:
        for attachment in self.manager.attachments:
            try:
                values = list(attachment.metrics())
            except Exception:
                logger.exception("%s: metrics() raised; skipped", attachment.name)
                continue
            for metric in values:
                kind = CounterMetricFamily if metric.counter else GaugeMetricFamily
                name = f"{PREFIX}_{attachment.name}_{metric.name}"
                yield kind(name, metric.help, value=metric.value)

    def _trace(self) -> Iterator[Metric]:
        recorder = self.trace_recorder
        if recorder is None:
            return
        yield CounterMetricFamily(
            f"{PREFIX}_trace_requests_recorded",
            "Requests written to the trace (trace_recording).",
            value=recorder.written,
        )
        dropped = CounterMetricFamily(
            f"{PREFIX}_trace_requests_dropped",
            "Requests left out of the trace: the writer's queue was full, or the write failed.",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], recorder.dropped)
        dropped.add_metric(["write_failed"], recorder.failed_writes)
        yield dropped

    def _primary(self) -> Iterator[Metric]:
        primary = self.manager.primary
        slots = GaugeMetricFamily(
            f"{PREFIX}_primary_slots",
            "Primary tier slots by state: free, idle (evictable), pinned, writing, retired.",
            labels=["state"],
        )
        for state, count in primary.busy_counts().items():
            slots.add_metric([state], count)
        yield slots
        yield GaugeMetricFamily(
            f"{PREFIX}_primary_slot_bytes", "Bytes of one primary slot (one chunk).",
            value=primary.buffer.slot_bytes,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_primary_evictions",
            "Chunks the cache policy evicted from the primary tier.",
            value=primary.evictions,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_primary_hits",
            "Chunks that requests found ready in the primary (CPU) tier, once per request.",
            value=primary.hits,
        )

    def _extra(self, taken: Iterable[str]) -> Iterator[Metric]:
        """Families from the tiers' ``metrics()`` hooks, grouped by name."""
        reserved = {*taken, "stores_inflight", "pressured"}
        families: dict[str, tuple[bool, CounterMetricFamily | GaugeMetricFamily]] = {}
        for index, tier in enumerate(self.manager.tiers):
            try:
                extra: Iterable[TierMetric] = tier.metrics()
            except Exception:
                logger.exception("tier %s: metrics() raised; its extra metrics skipped", tier)
                continue
            for metric in extra:
                if not _METRIC_NAME.match(metric.name) or metric.name in reserved:
                    logger.warning("tier %s: metric name %r rejected", tier, metric.name)
                    continue
                known = families.get(metric.name)
                if known is None:
                    kind = CounterMetricFamily if metric.counter else GaugeMetricFamily
                    help_text = metric.help or f"Tier metric {metric.name!r}."
                    known = families[metric.name] = (
                        metric.counter,
                        kind(f"{PREFIX}_tier_{metric.name}", help_text, labels=TIER_LABELS),
                    )
                elif known[0] != metric.counter:
                    logger.warning(
                        "tier %s: metric %r is a counter for one tier, a gauge for another",
                        tier,
                        metric.name,
                    )
                    continue
                known[1].add_metric(_labels(index, tier), metric.value)
        for _, family in families.values():
            yield family


class KVTierMetrics:
    """The Prometheus view of one :class:`TieringManager`.

    ``registry=None`` builds a registry of its own; pass
    ``prometheus_client.REGISTRY`` (or set ``metrics.global_registry``) to
    join the process-wide one, which takes one kvtier cache per process.
    """

    def __init__(
        self,
        manager: TieringManager,
        registry: CollectorRegistry | None = None,
        trace_recorder: TraceRecorder | None = None,
    ) -> None:
        """``trace_recorder``: the recorder of the manager's requests, whose counts
        are exported too (if any)."""
        self.manager = manager
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = _ManagerCollector(manager, trace_recorder)
        self.transfer_seconds = Histogram(
            f"{PREFIX}_tier_transfer_seconds",
            "Seconds from submitting a job to the tier until it finished.",
            labelnames=[*TIER_LABELS, "direction"],
            buckets=TRANSFER_BUCKETS,
            registry=None,
        )
        self.jobs = Counter(
            f"{PREFIX}_tier_jobs",
            "Transfer jobs finished by the tier, by direction and outcome.",
            labelnames=[*TIER_LABELS, "direction", "outcome"],
            registry=None,
        )
        # Labelled children by (tier, loading, success): labels() costs a lock and a lookup.
        self._children: dict[tuple[int, bool, bool], tuple[Any, Any]] = {}
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._owned: list[Collector] = []
        for collector in (self._collector, self.transfer_seconds, self.jobs):
            try:
                self.registry.register(collector)
            except ValueError as exc:  # names taken: another cache in a shared registry
                self.close()
                raise ValueError(
                    "kvtier metrics are already registered in this registry (one kvtier "
                    "cache per registry: give each cache its own, or unset "
                    f"metrics.global_registry): {exc}"
                ) from exc
            self._owned.append(collector)
        manager.job_listeners.append(self._on_job)

    def _on_job(self, tier_index: int, loading: bool, result: JobResult) -> None:
        key = (tier_index, loading, result.success)
        children = self._children.get(key)
        if children is None:
            labels = (str(tier_index), self.manager.tiers[tier_index].tier_type)
            direction = "load" if loading else "store"
            children = self._children[key] = (
                self.transfer_seconds.labels(*labels, direction),
                self.jobs.labels(*labels, direction, "ok" if result.success else "failed"),
            )
        children[0].observe(result.seconds)
        children[1].inc()

    @property
    def port(self) -> int | None:
        """The port ``/metrics`` is served on, once :meth:`serve` ran."""
        return None if self._server is None else int(self._server.server_port)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (``0``: a free port); returns the port."""
        if self._server is not None:
            raise RuntimeError(f"metrics are already served on port {self.port}")
        self._server, self._server_thread = start_http_server(
            port, addr=host, registry=self.registry
        )
        logger.info("kvtier metrics served on http://%s:%d/metrics", host, self.port)
        return int(self._server.server_port)

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers for engines that keep statistics of their own.

        The hook for engine integrations (the vLLM connector reports these
        through vLLM's own KV-connector statistics): JSON-ready, cheap, and
        independent of Prometheus.
        """
        return {
            "primary": {
                **self.manager.primary.busy_counts(),
                "evictions": self.manager.primary.evictions,
                "hits": self.manager.primary.hits,
            },
            "tiers": [
                {"tier": index, "tier_type": tier.tier_type, **tier.stats.as_dict()}
                for index, tier in enumerate(self.manager.tiers)
            ],
        }

    def close(self) -> None:
        """Stop serving, unregister, and stop observing the manager. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._server_thread is not None:
                self._server_thread.join()
            self._server = self._server_thread = None
        for collector in self._owned:
            self.registry.unregister(collector)
        self._owned = []
        if self._on_job in self.manager.job_listeners:
            self.manager.job_listeners.remove(self._on_job)


def attach_metrics(
    manager: TieringManager,
    config: MetricsConfig | None = None,
    registry: CollectorRegistry | None = None,
    trace_recorder: TraceRecorder | None = None,
) -> KVTierMetrics:
    """Metrics for ``manager`` as ``config`` asks: registry choice and HTTP server."""
    config = config or MetricsConfig()
    if registry is None and config.global_registry:
        registry = REGISTRY
    metrics = KVTierMetrics(manager, registry, trace_recorder)
    if config.port is not None:
        try:
            metrics.serve(config.port, config.host)
        except OSError as error:  # the port is taken, or the host is not this machine's
            metrics.close()
            key = "metrics.port" if error.errno == errno.EADDRINUSE else "metrics.host"
            problem = f"cannot serve /metrics on {config.host}:{config.port}: {error.strerror}"
            raise ConfigError([(key, problem)]) from error
        except BaseException:
            metrics.close()
            raise
    return metrics


__all__ = ["STAT_HELP", "TRANSFER_BUCKETS", "KVTierMetrics", "attach_metrics"]
