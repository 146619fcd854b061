"""``KVTierConnector``: the class vLLM instantiates, once per role.

vLLM builds one instance in its scheduler (engine-core process) and one in
each worker; they share nothing but the per-step metadata, the worker's
report, and the primary tier's slots in named shared memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.facade import KVCache

from .engine_config import (
    check_stats_file,
    connector_options,
    geometry,
    kv_layout,
    kvtier_config,
    with_shared_memory,
)
from .events import tier_events
from .logs import follow_vllm_logging
from .metadata import KVTierConnectorMetadata, KVTierHandshake
from .scheduler import SchedulerSide
from .shared_memory import remove_stale_buffers
from .stats import KVTierConnectorStats, StatsDeltas, totals
from .worker import WorkerSide

logger = logging.getLogger(__name__)


class KVTierConnector(KVConnectorBase_V1):
    """kvtier as a vLLM KV connector, configured by ``kv_connector_extra_config``.

    ``{"kvtier": {...}}`` holds a kvtier configuration inline, or
    ``{"kvtier_config_file": "kvtier.yaml"}`` names one; see
    :class:`~kvtier.integrations.vllm.engine_config.ConnectorOptions` for the
    other keys.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        follow_vllm_logging()
        transfer = self._kv_transfer_config
        options = connector_options(transfer.kv_connector_extra_config)
        config = kvtier_config(options)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._deltas = StatsDeltas()
        if role == KVConnectorRole.SCHEDULER:
            check_stats_file(options)
            layout, shape = kv_layout(
                vllm_config,
                kv_cache_config,
                config.chunk_tokens,
                options.kvtier_model_id,
                full_read=options.kvtier_weights_identity == "full",
            )
            # Before any tier starts: a misnamed medium is a start-up error.
            events = tier_events(options, config, vllm_config, kv_cache_config, shape)
            remove_stale_buffers()
            config = with_shared_memory(config, transfer.engine_id)
            # KVCache builds the tiers and kvtier's own Prometheus metrics
            # (served when ``metrics.port`` is set), releasing the tiers and the
            # shared memory if the metrics cannot start; closing it stops both.
            self._scheduler = SchedulerSide(
                KVCache(config, layout),
                shape,
                lookup_timeout_s=options.kvtier_lookup_timeout_s,
                idle_wait_s=options.kvtier_idle_wait_s,
                stats_file=options.kvtier_stats_file,
                events=events,
            )
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvtier: kv_load_failure_policy=%r fails a request whose pages could "
                    "not be copied; set it to 'recompute' to recompute them instead",
                    transfer.kv_load_failure_policy,
                )
            logger.info(
                "kvtier connector: %d-token chunks (%d blocks) over %d worker(s) "
                "(tensor_parallel_size=%d), namespace %s, primary slots in shared memory %r",
                layout.chunk_tokens,
                shape.blocks_per_chunk,
                shape.num_ranks,
                shape.tensor_parallel_size,
                layout.namespace.hex()[:16],
                config.shared_memory_name,
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            self._worker = WorkerSide(
                geometry(vllm_config, kv_cache_config, config.chunk_tokens),
                pp_rank=get_pp_group().rank_in_group,
                tp_rank=get_tp_group().rank_in_group,
                # With a configured name, the scheduler's name is known outright.
                engine_id=transfer.engine_id,
                buffer_name=config.shared_memory_name,
            )

    # Scheduler side ---------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("called a scheduler-side method on a worker-side KVTierConnector")
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Pages are copied within the step that computed them, so vLLM may
        # free the blocks right away.
        self._sched().request_finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What kvtier's tiers stored or dropped since the last step.

        vLLM's scheduler calls it once per step and publishes the events with
        its own (see docs/vllm.md). Every change happens on the scheduler
        side, so the workers' ``get_kv_connector_kv_cache_events`` has none.
        """
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What kvtier counted since the last call, for vLLM's own stats logging."""
        if self._scheduler is None:
            return None
        scheduler = self._scheduler
        return self._deltas.take(totals(vars(scheduler.counters), scheduler.cache.status))

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    def reset_cache(self) -> bool | None:
        """``LLM.reset_prefix_cache(reset_connector=True)``: empty kvtier's CPU tier."""
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # Worker side --------------------------------------------------------------

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("called a worker-side method on a scheduler-side KVTierConnector")
        return self._worker

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierConnectorMetadata):
            raise TypeError(f"expected KVTierConnectorMetadata, got {type(meta).__name__}")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv`, before the forward pass."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Pages are saved whole in :meth:`wait_for_save`, after every layer ran."""

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_handshake_metadata(self) -> KVTierHandshake:
        """Called once every worker and the scheduler exist: map the slots now."""
        return self._work().handshake()

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's start-up answer: once all mapped the slots, their name goes."""
        self._sched().workers_started(metadata.values())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().build_worker_meta()

    # Both -------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
