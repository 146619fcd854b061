"""vLLM's own tiering with one kvtier tier, driven as vLLM's offloading
connector drives it: a real ``OffloadingConfig``, ``TieringOffloadingSpec``,
``get_manager()``, and chunk bytes written to and read from the primary rows
as vLLM's worker would."""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.integrations.vllm.tiering import KVTierSecondaryTier

#: vLLM's bytes of one block of one worker; two blocks make a chunk (a row).
BLOCK_BYTES = 8192
ROW_BYTES = 2 * BLOCK_BYTES
#: A bound on how long a settling loop waits, not a test of speed.
PATIENCE_S = 60.0
_engines = itertools.count()


def offload_keys(count: int, *, start: int = 0, tag: bytes = b"p") -> list[OffloadKey]:
    """Keys of a prefix's chunks, as vLLM's chained block hashes would be."""
    keys, parent = [], tag
    for index in range(start + count):
        parent = hashlib.sha256(parent + index.to_bytes(4, "big")).digest()
        if index >= start:
            keys.append(make_offload_key(parent, 0))
    return keys


def payload(key: OffloadKey) -> np.ndarray:
    """The bytes vLLM's worker would have written for ``key``: made from the key alone."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, ROW_BYTES, dtype=np.uint8)


def float_payload(key: OffloadKey) -> np.ndarray:
    """A row of bf16 KV values (as its bytes), made from the key alone."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    values = np.random.default_rng(seed).normal(0.0, 2.0, ROW_BYTES // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def bf16_values(row: np.ndarray) -> np.ndarray:
    """The float32 values of a row of bf16 bytes."""
    return (row.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def tiering_config(
    entry: dict[str, Any],
    *,
    model: str = "kvtier-test/model",
    dtype: str = "bfloat16",
    chunks: int = 8,
    events: bool = False,
    tp_size: int = 1,
    agnostic: bool = False,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES // tp_size,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * ROW_BYTES, "secondary_tiers": [entry]},
        engine_id=f"kvtier-test-{uuid.uuid4().hex[:8]}-{next(_engines)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
    )


def kvtier_entry(tier: dict[str, Any], **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry of vLLM's tiering naming a kvtier tier."""
    return {
        "type": "KVTierSecondaryTier",
        "module_path": "kvtier.integrations.vllm.tiering",
        "tier": tier,
        **options,
    }


def primary_rows(spec: LoadStoreSpec) -> np.ndarray:
    """The rows of vLLM's CPU primary tier a load or store spec names."""
    assert isinstance(spec, CPULoadStoreSpec), spec
    return spec.chunk_ids


class Engine:
    """The scheduler side of one vLLM engine using native tiering and a kvtier tier."""

    def __init__(self, tier: dict[str, Any], **config: Any) -> None:
        options = config.pop("options", {})
        self.spec = TieringOffloadingSpec(tiering_config(kvtier_entry(tier, **options), **config))
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        adapter = manager.secondary_tiers[0]
        assert isinstance(adapter, KVTierSecondaryTier)
        self.adapter = adapter
        self.events: list[OffloadingEvent] = []

    def row(self, chunk: int) -> np.ndarray:
        view = self.manager.primary_tier.get_kv_memoryview()
        return np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)[chunk]

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self.events.extend(self.manager.take_events())

    def settle(self) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + PATIENCE_S
        while True:
            self.step()
            if not self.manager.has_pending_work():
                return
            assert time.monotonic() < deadline, "transfers still in flight"
            time.sleep(0.002)

    def store(
        self, keys: Sequence[OffloadKey], fill: Callable[[OffloadKey], np.ndarray] = payload
    ) -> list[OffloadKey]:
        """Store ``keys``' chunks (``fill``'s bytes of each) and let them cascade."""
        ctx = ReqContext(req_id=f"store-{uuid.uuid4().hex[:8]}")
        self.manager.on_new_request(ctx)
        prepared = self.manager.prepare_store(list(keys), ctx)
        assert prepared is not None, "the primary tier refused the store"
        for key, chunk in zip(
            prepared.keys_to_store, primary_rows(prepared.store_spec), strict=True
        ):
            self.row(int(chunk))[:] = fill(key)
        self.manager.complete_store(prepared.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return list(prepared.keys_to_store)

    def cached(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> int:
        """Leading chunks ready in the primary tier, stepping while lookups
        answer RETRY or HIT_PENDING (promotions in flight)."""
        deadline = time.monotonic() + PATIENCE_S
        while True:
            count, waiting = 0, False
            for key in keys:
                found = self.manager.lookup(key, ctx)
                if found is LookupResult.HIT:
                    count += 1
                    continue
                waiting = found is not LookupResult.MISS
                break
            if not waiting:
                return count
            assert time.monotonic() < deadline, "lookups still pending"
            self.step()
            time.sleep(0.002)

    def load(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, np.ndarray]:
        """Look the prefix up and load what is cached: each chunk's bytes."""
        ctx = ReqContext(req_id=f"load-{uuid.uuid4().hex[:8]}")
        self.manager.on_new_request(ctx)
        hits = list(keys[: self.cached(keys, ctx)])
        loaded: dict[OffloadKey, np.ndarray] = {}
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            rows = primary_rows(spec)
            loaded = {k: self.row(int(c)).copy() for k, c in zip(hits, rows, strict=True)}
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return loaded

    def evict_primary(self) -> None:
        """Fill the primary tier with other chunks, so that later loads come from the tier."""
        rows = self.manager.primary_tier.get_kv_memoryview().shape[0]
        self.store(offload_keys(rows, tag=uuid.uuid4().bytes))

    def close(self) -> None:
        self.manager.shutdown()
