"""kvtier's tiers inside vLLM's own tiering (``TieringOffloadingSpec``).

vLLM's ``SecondaryTierFactory`` imports a tier named by ``module_path``;
:class:`KVTierSecondaryTier` is that tier for every kvtier tier at once: the
``tier`` mapping of its entry is one kvtier ``secondary_tiers`` entry (``fs``,
``redis``, ``obj``, ``mooncake``, ``memory`` or your own), validated and
built by kvtier, with kvtier's checksums, bounds, breakers and deadlines.
vLLM keeps its GPU↔CPU path and its CPU primary tier; kvtier moves rows of
that primary tier to and from its tier. See docs/vllm-tiering.md.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult as VllmJobResult
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.base import TransferJob as VllmTransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm.row_layout import byte_rows, row_elements, tiering_layout
from kvtier.integrations.vllm.tiering_events import TierAnnouncements
from kvtier.integrations.vllm.tiering_options import TieringOptions, validate_entry
from kvtier.jobs import JobOutcome, RequestMisses, count_lookup, count_refused
from kvtier.keys import ChunkKey
from kvtier.layout import KEY_BYTES, KVLayout
from kvtier.tiers.base import JobResult, Lookup, LookupContext, SecondaryTier, TransferJob
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.tiers.remote import RemoteTierStats

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

#: Tiers that keep chunks in this process's memory; every other one is storage.
_CPU_TIERS = frozenset({"memory", "example"})


@dataclass(frozen=True)
class _Spec:
    """What a kvtier tier reads of its spec: the layout, for the namespace."""

    layout: KVLayout


@dataclass
class _Job:
    """A vLLM job on its way through the kvtier tier."""

    vllm_id: int
    request_id: str
    keys: list[OffloadKey]
    by_kvtier_key: dict[ChunkKey, OffloadKey]
    loading: bool


class KVTierSecondaryTier(SecondaryTierManager):
    """Any kvtier secondary tier, as a tier of vLLM's ``TieringOffloadingManager``.

    Every method runs on vLLM's scheduler thread and returns at once: lookups
    answer RETRY while kvtier's existence check runs, and copies between the
    primary rows and the tier run on the kvtier tier's own workers.
    """

    # vLLM's factory reads the class's; each instance then says where its own
    # kvtier tier keeps chunks.
    medium = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        entry = validate_entry(offloading_spec, options)
        path, settings, tier_config = entry.path, entry.settings, entry.tier
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        rows, row_bytes = byte_rows(primary_kv_view)
        self._layout = tiering_layout(offloading_spec.config, row_bytes, settings.model_id)
        self._label = f"{path}:{tier_config.tier_type}"
        self.tier: SecondaryTier = SecondaryTierFactory.build_secondary_tier(
            tier_config.tier_class,
            tier_config.tier_type,
            tier_config.options,
            rows,
            _Spec(self._layout),
            entry=f"{path}.tier",
            codec=tier_config.codec,
        )
        self.medium = Medium.CPU if tier_config.tier_type in _CPU_TIERS else Medium.STORAGE
        self.cache_hit_source = (
            CacheHitSource.HOST if self.medium is Medium.CPU else CacheHitSource.DISK
        )
        self.locality = None if settings.locality is None else Locality(settings.locality)
        self._events: TierAnnouncements | None = None
        if settings.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = TierAnnouncements(self.chunk_key, self.medium, self.locality)
                self.tier.removal_listeners.append(self._events.dropped)
            else:
                logger.warning(
                    "kvtier: enable_kv_events is set on %s but vLLM's KV cache events are "
                    "off; the tier announces nothing",
                    path,
                )
        self._jobs: dict[int, _Job] = {}
        self._failed: list[VllmJobResult] = []
        #: Per request, chunks that are misses for the rest of it: those the
        #: tier answered MISS for (vLLM's own tiers keep a lookup's verdict
        #: until the request ends; asked again, a remote tier would check
        #: again and answer RETRY meanwhile, a step more for the request) and
        #: those whose load failed.
        self._misses: RequestMisses[OffloadKey] = RequestMisses()
        self._tokens_per_chunk = int(offloading_spec.config.cache.tokens_per_hash) * int(
            offloading_spec.config.cache.blocks_per_chunk
        )
        self._reported: dict[str, int] = {}
        self._collect_failing = False
        logger.info(
            "kvtier: %s serves vLLM's tiering as %s (namespace %s)",
            path,
            self.tier,
            self._layout.namespace.hex()[:16],
        )

    # Keys ---------------------------------------------------------------------

    def chunk_key(self, key: OffloadKey) -> ChunkKey:
        """The key kvtier stores a vLLM chunk under: vLLM's key (a chained
        block hash and a group) hashed under this layout's namespace."""
        return ChunkKey(
            hashlib.blake2b(bytes(key), digest_size=KEY_BYTES, key=self._layout.namespace).digest()
        )

    def _context(self, key: OffloadKey, req_context: ReqContext) -> LookupContext:
        end = req_context.get_offload_key_position(key)
        index = max(0, end // self._tokens_per_chunk - 1) if end and self._tokens_per_chunk else 0
        return LookupContext(request_id=req_context.req_id, index=index)

    # vLLM's contract ------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._misses.of(req_context.req_id):
            return LookupResult.MISS  # a miss, or its load failed, earlier in this request
        try:
            found = self.tier.lookup(self.chunk_key(key), self._context(key, req_context))
        except Exception:
            logger.exception("kvtier: lookup on %s failed; a miss", self._label)
            count_lookup(self.tier, None)
            return LookupResult.MISS
        count_lookup(self.tier, found)
        if found is Lookup.PENDING:
            return LookupResult.RETRY
        if found is Lookup.MISS:
            self._misses.remember(req_context.req_id, (key,))
            self._forget([key])
            return LookupResult.MISS
        return LookupResult.HIT

    def submit_store(self, job_metadata: VllmTransferJob) -> None:
        self._submit(job_metadata, loading=False)

    def submit_load(self, job_metadata: VllmTransferJob) -> None:
        self._submit(job_metadata, loading=True)

    def _submit(self, job: VllmTransferJob, *, loading: bool) -> None:
        keys = list(job.keys)
        by_kvtier_key = {self.chunk_key(key): key for key in keys}
        slots = tuple(int(chunk) for chunk in np.asarray(job.chunk_ids).reshape(-1))
        kvtier_job = TransferJob(
            keys=tuple(by_kvtier_key), slots=slots, request_id=job.req_context.req_id
        )
        self._jobs[kvtier_job.job_id] = _Job(
            job.job_id, job.req_context.req_id, keys, by_kvtier_key, loading
        )
        try:
            if loading:
                self.tier.submit_load(kvtier_job)
            else:
                self.tier.submit_store(kvtier_job)
        except Exception:
            logger.exception("kvtier: %s refused job %d; it failed", self._label, job.job_id)
            del self._jobs[kvtier_job.job_id]
            count_refused(self.tier, len(keys), loading=loading)
            if loading:
                self._misses.remember(job.req_context.req_id, keys)
            self._failed.append(VllmJobResult(job_id=job.job_id, success=False))

    def get_finished_jobs(self) -> Iterable[VllmJobResult]:
        results, self._failed = self._failed, []
        try:
            finished = self.tier.get_finished_jobs()
        except Exception:
            if not self._collect_failing:
                logger.exception("kvtier: collecting %s's finished jobs failed", self._label)
            self._collect_failing = True
            return results
        self._collect_failing = False
        for result in finished:
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                results.append(self._translate(job, result))
        return results

    def _translate(self, job: _Job, result: JobResult) -> VllmJobResult:
        try:
            outcome = JobOutcome.of(job.by_kvtier_key, result)
        except (TypeError, ValueError):
            logger.exception("kvtier: %s reported a malformed result; job failed", self._label)
            result = JobResult(result.job_id, False, frozenset(), 0, 0.0)
            outcome = JobOutcome.of(job.by_kvtier_key, result)
        outcome.count_on(self.tier, loading=job.loading)
        good = [job.by_kvtier_key[own] for own in outcome.good]
        if job.loading:
            lost = [job.by_kvtier_key[own] for own in outcome.bad]
            self._forget(lost)
            self._misses.remember(job.request_id, lost)
            whole = result.success and not lost
            return VllmJobResult(
                job_id=job.vllm_id,
                success=whole,
                successful_keys=None if whole else tuple(good),
                transfer_time=outcome.seconds,
                transfer_bytes=outcome.nbytes,
            )
        self._announce(good)
        return VllmJobResult(
            job_id=job.vllm_id,
            success=result.success,
            transfer_time=outcome.seconds,
            transfer_bytes=outcome.nbytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._failed)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is not None:
            yield from self._events.take()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        try:
            self.tier.touch([self.chunk_key(key) for key in keys])
        except Exception:
            logger.exception("kvtier: touch on %s failed", self._label)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._misses.forget(req_context.req_id)
        try:
            self.tier.on_request_finished(req_context.req_id)
        except Exception:
            logger.exception("kvtier: on_request_finished on %s failed", self._label)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self.tier.on_step_end()
        except Exception:
            logger.exception("kvtier: on_step_end on %s failed", self._label)

    def drain_jobs(self) -> None:
        self.tier.drain()

    def shutdown(self) -> None:
        # Then the tier's views of the primary rows go, so that vLLM can unmap them.
        self.tier.shutdown()
        self.tier.release_view()

    # Events -------------------------------------------------------------------

    def _announce(self, keys: list[OffloadKey]) -> None:
        if self._events is not None:
            self._events.stored(keys)

    def _forget(self, keys: list[OffloadKey]) -> None:
        if self._events is not None:
            self._events.gone(keys)

    # Metrics ------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            _metric_name(name): OffloadingCounterMetadata(
                documentation=f"kvtier tier counter {name}, labelled by tier.",
                labelnames=("tier",),
            )
            for name in _COUNTED
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What the tier counted since the last call (vLLM sums the deltas)."""
        now = self.tier.stats.as_dict()
        stats = OffloadingConnectorStats()
        for name in _COUNTED:
            delta = now.get(name, 0) - self._reported.get(name, 0)
            if delta:
                stats.increase_counter(_metric_name(name), delta, (self._label,))
        self._reported = now
        return None if stats.is_empty() else stats


#: The counters every kvtier tier keeps, and those of its remote tiers.
_COUNTED = tuple(field.name for field in fields(RemoteTierStats))


def _metric_name(stat: str) -> str:
    return f"kvtier:tier_{stat}"


__all__ = ["KVTierSecondaryTier", "TieringOptions", "row_elements", "tiering_layout"]
