"""``KVCache``: kvtier for a single-process engine in a handful of calls.

    cache = KVCache(config, layout)
    hit = cache.cached_prefix(tokens)          # tokens served from kvtier
    cache.load(tokens, hit, out)               # copy them into the engine
    ... prefill tokens[hit:] ...
    cache.store(tokens, src)                   # offload the new full chunks

Chunks travel as ``uint8`` arrays of ``layout.slot_bytes`` bytes; the
integrations turn them into and out of the engine's own tensors.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig, load_config
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.layout import KVLayout
from kvtier.manager import LookupResult, TieringManager
from kvtier.metrics import KVTierMetrics, attach_metrics
from kvtier.specs.factory import OffloadingSpecFactory

#: Fills (for stores) or reads (for loads) one chunk: ``fn(chunk_index, slot_bytes_array)``.
ChunkCopier = Callable[[int, np.ndarray], None]


class KVCache:
    """A kvtier manager plus the key bookkeeping a simple engine needs."""

    def __init__(
        self,
        config: KVTierConfig | Mapping[str, Any] | str | Path | None,
        layout: KVLayout,
        *,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        """``metrics_registry``: where the metrics go (default: per the ``metrics``
        section, a registry of this cache's own)."""
        self.config = load_config(config)
        self.layout = layout
        self.spec = OffloadingSpecFactory.create_spec(self.config, layout)
        self.manager: TieringManager = self.spec.build_manager()
        try:
            self.metrics: KVTierMetrics = attach_metrics(
                self.manager, self.config.metrics, metrics_registry
            )
        except BaseException:
            self.manager.shutdown()
            raise

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[ChunkKey]:
        """Keys of the full chunks of ``tokens``."""
        return chunk_keys(self.layout.namespace, tokens, self.chunk_tokens)

    def lookup(
        self, tokens: Sequence[int] | np.ndarray, request_id: str | None = None
    ) -> LookupResult:
        """Non-blocking: leading chunks ready now, and whether more are on their way."""
        return self.manager.lookup(self.keys(tokens), request_id)

    def cached_prefix(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        request_id: str | None = None,
        timeout: float = 30.0,
        poll_s: float = 0.0005,
    ) -> int:
        """Tokens of ``tokens`` that can be loaded, after waiting for promotions.

        Stops waiting after ``timeout`` seconds and reports what is ready.
        A chunk whose promotion failed is not retried within the call.
        """
        keys = self.keys(tokens)
        owned = request_id is None
        request = f"kvtier-{uuid.uuid4().hex}" if request_id is None else request_id
        deadline = time.monotonic() + timeout
        try:
            while True:
                result = self.manager.lookup(keys, request)
                if not result.pending or time.monotonic() >= deadline:
                    return result.hit_chunks * self.chunk_tokens
                self.manager.step()
                time.sleep(poll_s)
        finally:
            if owned:
                self.manager.on_request_finished(request)

    def load(
        self,
        tokens: Sequence[int] | np.ndarray,
        num_tokens: int,
        out: np.ndarray | ChunkCopier,
    ) -> None:
        """Copy the first ``num_tokens`` tokens' chunks out of kvtier.

        ``out`` is an array of shape ``(chunks, slot_bytes)`` (or larger) to
        copy into, or a function called as ``out(index, chunk)`` per chunk
        while the chunk is pinned.
        """
        if num_tokens % self.chunk_tokens:
            raise ValueError(f"num_tokens={num_tokens} is not a multiple of {self.chunk_tokens}")
        keys = self.keys(tokens)[: num_tokens // self.chunk_tokens]
        slots = self.manager.prepare_load(keys)
        try:
            for index, slot in enumerate(slots):
                chunk = self.manager.primary.buffer.slot(slot)
                if callable(out):
                    out(index, chunk)
                else:
                    out.reshape(out.shape[0], -1).view(np.uint8)[index] = chunk
        finally:
            self.manager.complete_load(keys)

    def store(
        self,
        tokens: Sequence[int] | np.ndarray,
        src: np.ndarray | ChunkCopier,
        *,
        num_chunks: int | None = None,
    ) -> int:
        """Offload the full chunks of ``tokens`` that kvtier does not hold yet.

        ``src`` is an array whose row ``i`` holds chunk ``i``'s bytes, or a
        function called as ``src(index, slot)`` to fill a slot. Returns the
        number of chunks written; ``0`` when they were all present or the
        primary tier had no room. At most as many chunks as the primary tier
        has slots are stored, from the start.
        """
        # Leading chunks only, and no more than the primary tier holds: a
        # prefix is only worth its first chunks.
        limit = self.manager.primary.num_slots
        keys = self.keys(tokens)[: limit if num_chunks is None else min(limit, num_chunks)]
        reserved = self.manager.prepare_store(keys)
        if not reserved:
            return 0
        written: list[ChunkKey] = []
        try:
            for index, key in enumerate(keys):
                slot = reserved.get(key)
                if slot is None:
                    continue
                chunk = self.manager.primary.buffer.slot(slot)
                if callable(src):
                    src(index, chunk)
                else:
                    chunk[:] = np.asarray(src[index]).reshape(-1).view(np.uint8)
                written.append(key)
        except BaseException:
            self.manager.complete_store(list(reserved), success=False)
            raise
        self.manager.complete_store(written, success=True)
        return len(written)

    def step(self) -> None:
        """Drive pending work: collect finished transfers, submit promotions."""
        self.manager.step()

    def drain(self) -> None:
        """Wait until every transfer in flight has ended."""
        self.manager.drain()

    def close(self) -> None:
        self.metrics.close()
        self.manager.shutdown()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
