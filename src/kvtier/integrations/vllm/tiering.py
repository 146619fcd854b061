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

import collections
import hashlib
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator
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

from kvtier.config import validate_options, validate_tier
from kvtier.errors import ConfigError
from kvtier.identity import declared_weights, identify_weights
from kvtier.jobs import FailedLoads, JobOutcome, count_lookup, count_refused
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
#: Chunks announced as stored whose removal kvtier still reports (a bound on memory).
_ANNOUNCED_LIMIT = 1 << 20
#: Keys of a ``secondary_tiers`` entry that vLLM's factory takes for itself.
_FACTORY_KEYS = frozenset({"type", "module_path", "backpressure"})

#: The float KV dtypes a row may be read as, and their widths in bytes.
_FLOAT_KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class TieringOptions(BaseModel):
    """What a ``secondary_tiers`` entry of vLLM's tiering gives this tier, beside
    ``type``, ``module_path`` and ``backpressure`` (which vLLM's factory takes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tier: dict[str, Any]
    """One kvtier secondary-tier entry: ``{type: fs, root_dir: ...}`` and its options."""

    enable_kv_events: bool = False
    """Announce chunks stored in and removed from the tier as vLLM KV events
    (when vLLM's own KV events are on)."""

    locality: str | None = None
    """Where the tier's storage is relative to this engine (``LOCAL`` or
    ``REMOTE``), for vLLM's per-request tier filters and KV events; unset, as
    with vLLM's own tiers, means unknown."""

    model_id: str | None = None
    """Declares the weights' identity instead of reading their files; whoever
    sets it must change it whenever the weights change."""

    @field_validator("locality")
    @classmethod
    def _known_locality(cls, value: str | None) -> str | None:
        if value is not None and value not in Locality.__members__:
            raise ValueError(f"Locality must be one of {list(Locality.__members__)}, got {value!r}")
        return value


@dataclass(frozen=True)
class _Spec:
    """What a kvtier tier reads of its spec: the layout, for the namespace."""

    layout: KVLayout


def tiering_layout(config: Any, row_bytes: int, model_id: str | None = None) -> KVLayout:
    """The kvtier layout of a row of vLLM's primary tier, from vLLM's
    ``OffloadingConfig``: every fact that changes a row's bytes feeds the
    namespace, so another model, dtype, block geometry, page format or
    parallel layout never finds these chunks.

    A row is described by its elements where :func:`row_elements` can tell
    them (float KV, so the lossy codecs group consecutive elements), else as
    one opaque ``uint8`` record of ``row_bytes``.
    """
    if row_bytes <= 0 or row_bytes % 2:
        raise ConfigError(
            [("cpu_bytes_to_use", f"vLLM's primary rows are {row_bytes} bytes: not a chunk")]
        )
    parallel = config.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    facts: dict[str, object] = {
        "engine": "vllm-tiering",
        "vllm": _vllm_version(),
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        # A row holds every worker's part (one, if they are all alike).
        "kv_bytes_per_block": int(config.worker_kv_bytes_per_block)
        * (1 if config.replicated_layout else int(parallel.world_size)),
        "groups": [
            {"tokens_per_block": int(g.tokens_per_block), "layers": list(g.layer_names)}
            for g in config.groups
        ],
        "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
        "canonical_layout": bool(getattr(config, "canonical_layout", False)),
        "replicated_layout": bool(config.replicated_layout),
        "parallel": "agnostic"
        if agnostic
        else {
            "tp": int(parallel.tp_size),
            "pp": int(parallel.pp_size),
            "pcp": int(parallel.pcp_size),
            "dcp": int(parallel.dcp_size),
        },
        "weights": _weights(str(config.model.name), model_id),
    }
    dtype, _ = row_elements(config)
    element_bytes = _FLOAT_KV_BYTES.get(dtype, 1)
    if row_bytes % (2 * element_bytes):
        raise ConfigError(
            [("cpu_bytes_to_use", f"vLLM's primary rows are {row_bytes} bytes: not {dtype} KV")]
        )
    return KVLayout(
        model_id=str(config.model.name),
        num_layers=1,
        num_kv_heads=1,
        head_dim=row_bytes // (2 * element_bytes),
        dtype=dtype,
        chunk_tokens=1,
        kv_order=f"vllm-offload-row[{row_bytes}]",
        extra=tuple(sorted((k, _text(v)) for k, v in facts.items())),
    )


def row_elements(config: Any) -> tuple[str, str | None]:
    """The element type of vLLM's offload rows and ``None``, or ``uint8`` and
    why kvtier cannot read them as float KV.

    A row is every worker's pages of a chunk, in the KV cache's dtype, then
    zeros up to a memory page. Only where vLLM itself certifies the direct
    layout parallelism-agnostic is it one plain full-attention group (not
    MLA, no scales per token and head); other groups may hold latents, Mamba
    state, scales or other layers' bytes, which kvtier cannot tell apart.
    """
    dtype = str(config.model.dtype)
    if dtype not in _FLOAT_KV_BYTES:
        return "uint8", f"vLLM's offload rows of a {dtype} KV cache are not float KV"
    parallel = config.parallel
    if config.canonical_layout or config.replicated_layout or not parallel.is_parallelism_agnostic:
        return "uint8", (
            "vLLM's offload rows hold elements whose type kvtier cannot tell (they are "
            "plain float KV only where vLLM finds one full-attention group without "
            "scales, its bytes parallelism-agnostic, in the direct layout)"
        )
    return dtype, None


def _text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _vllm_version() -> str:
    import vllm

    return ".".join(str(vllm.__version__).split(".")[:2])


def _weights(model: str, model_id: str | None) -> str:
    """The weights' identity: declared, read from a local directory or the
    Hugging Face cache, or (neither) the name alone, said once in the log."""
    if model_id is not None:
        return declared_weights(model_id)
    weights = identify_weights(model)
    if weights is not None:
        return weights.token
    logger.warning(
        "kvtier: the weights of %r are neither a local directory nor in the Hugging Face "
        "cache; chunks are told apart by the model's name only (set model_id to declare "
        "the weights' identity)",
        model,
    )
    return f"name:{model}"


def _entry_path(spec: Any, options: Mapping[str, Any]) -> str:
    """``secondary_tiers[i]``: the entry whose options vLLM's factory handed
    over (as the same objects), since it hands a tier its options, not its place."""
    configs = getattr(spec, "secondary_tier_configs", None)
    for index, entry in enumerate(configs if isinstance(configs, list) else ()):
        if not isinstance(entry, Mapping):
            continue
        own = {k: v for k, v in entry.items() if k not in _FACTORY_KEYS}
        if own.keys() == options.keys() and all(own[k] is options[k] for k in own):
            return f"secondary_tiers[{index}]"
    return "secondary_tiers[?]"


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
        path = _entry_path(offloading_spec, options)
        settings = cast(TieringOptions, validate_options(TieringOptions, options, path))
        tier_config = validate_tier(settings.tier, f"{path}.tier")
        if tier_config.tier_type == "p2p":
            raise ConfigError(
                [
                    (
                        f"{path}.tier.type",
                        "'p2p' serves chunks from kvtier's own CPU tier, which vLLM's "
                        "tiering replaces with its own; use kvtier's connector "
                        "(KVTierConnector) for p2p, or vLLM's own p2p tier here",
                    )
                ]
            )
        _, opaque = row_elements(offloading_spec.config)
        codec = tier_config.codec
        if opaque is not None and codec is not None and codec.codec_class.lossy:
            raise ConfigError(
                [
                    (
                        f"{path}.tier.codec",
                        f"{codec.codec_type!r} is lossy and encodes float KV only, "
                        f"but {opaque}; use codec none or lossless",
                    )
                ]
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        rows, row_bytes = _byte_rows(primary_kv_view)
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
        self._events: list[OffloadingEvent] | None = None
        if settings.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning(
                    "kvtier: enable_kv_events is set on %s but vLLM's KV cache events are "
                    "off; the tier announces nothing",
                    path,
                )
        #: Chunks announced as stored (kvtier's key to vLLM's), so that their
        #: removal is announced too.
        self._announced: collections.OrderedDict[ChunkKey, OffloadKey] = collections.OrderedDict()
        #: Chunks the tier dropped itself (evicted, deleted as corrupt), reported
        #: from its workers; announced at the next :meth:`take_events`.
        self._dropped: collections.deque[Sequence[ChunkKey]] = collections.deque()
        if self._events is not None:
            self.tier.removal_listeners.append(self._dropped.append)
        self._jobs: dict[int, _Job] = {}
        self._failed: list[VllmJobResult] = []
        #: Per request, chunks whose load failed: misses for the rest of it.
        self._failed_loads: FailedLoads[OffloadKey] = FailedLoads()
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
        if key in self._failed_loads.of(req_context.req_id):
            return LookupResult.MISS  # its load failed once for this request: recompute
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
                self._failed_loads.remember(job.req_context.req_id, keys)
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
            self._failed_loads.remember(job.request_id, lost)
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
        while self._dropped:
            self._forget_own(self._dropped.popleft())
        if self._events:
            events, self._events = self._events, []
            yield from events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        try:
            self.tier.touch([self.chunk_key(key) for key in keys])
        except Exception:
            logger.exception("kvtier: touch on %s failed", self._label)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._failed_loads.forget(req_context.req_id)
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

    def _announce(self, keys: Sequence[OffloadKey]) -> None:
        if self._events is None or not keys:
            return
        for key in keys:
            own = self.chunk_key(key)
            self._announced[own] = key
            self._announced.move_to_end(own)
        while len(self._announced) > _ANNOUNCED_LIMIT:
            self._announced.popitem(last=False)
        self._events.append(self._event(list(keys), removed=False))

    def _forget(self, keys: Sequence[OffloadKey]) -> None:
        """Announce as removed the chunks announced as stored that the tier no
        longer serves (found missing, or gone at their load)."""
        if self._events is not None:
            self._forget_own([self.chunk_key(key) for key in keys])

    def _forget_own(self, own_keys: Sequence[ChunkKey]) -> None:
        if self._events is None:
            return
        gone = [self._announced.pop(own) for own in own_keys if own in self._announced]
        if gone:
            self._events.append(self._event(gone, removed=True))

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        assert self.medium is not None
        return OffloadingEvent(
            keys=keys, medium=self.medium, removed=removed, locality=self.locality
        )

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


def _byte_rows(view: memoryview) -> tuple[memoryview, int]:
    """vLLM's primary view as 2-D bytes: one row per chunk, whatever its item format."""
    if view.ndim != 2 or view.strides is None or not view.c_contiguous:
        raise ValueError(
            f"vLLM's primary view must be a C-contiguous 2-D memoryview, got shape {view.shape}"
        )
    rows, row_bytes = int(view.shape[0]) if view.shape else 0, int(view.strides[0])
    return view.cast("B").cast("B", (rows, row_bytes)), row_bytes


__all__ = ["KVTierSecondaryTier", "TieringOptions", "row_elements", "tiering_layout"]
