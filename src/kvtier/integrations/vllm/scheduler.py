"""The scheduler half of the connector: lookups, load and store plans.

Runs in vLLM's engine-core process and owns the :class:`~kvtier.KVCache`. Chunk keys
are kvtier's own prefix chain over the prompt's token ids, rooted at the
layout's namespace (see :func:`request_keys`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier import LookupResult
from kvtier.errors import ClosedError
from kvtier.facade import KVCache
from kvtier.identity import AdapterIdentities
from kvtier.inputs import token_bytes
from kvtier.keys import ChunkKey, keys_of_token_bytes
from kvtier.layout import KVLayout

from .engine_config import VllmGeometry
from .events import TierEvents
from .metadata import (
    KVTierConnectorMetadata,
    KVTierHandshake,
    KVTierWorkerMetadata,
    PageCopies,
    SharedBuffer,
    StepResult,
)
from .shared_memory import NameGuard

logger = logging.getLogger(__name__)


def request_keys(
    namespace: bytes, request: Any, chunk_tokens: int, adapters: AdapterIdentities
) -> list[ChunkKey] | None:
    """Keys of the full chunks of a request's prompt, or ``None`` if kvtier must not serve it.

    The chain hashes the token ids themselves from the layout's namespace, so
    keys depend on nothing but the model, the page format and the tokens: not
    on vLLM's hash algorithm setting or ``PYTHONHASHSEED``, and not on the
    block size (chunks are whole blocks, but keys are per chunk). A LoRA
    adapter (by its files, see :class:`AdapterIdentities`) and a cache salt
    change what a prefix means, so they are mixed into the first chunk's key;
    a request whose adapter cannot be identified, and prompts with
    multimodal inputs or embeddings (not token-addressable) are left to vLLM.
    A prompt mixing token ids and embeddings has placeholder ids where its
    embeddings go, so its ids do not tell its KV apart either.
    """
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens is None or getattr(request, "mm_features", None):
        return None
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    salt = b""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        adapter = adapters.token(
            str(getattr(lora, "lora_name", "")),
            int(getattr(lora, "lora_int_id", 0)),
            str(getattr(lora, "lora_path", "") or ""),
            reload=bool(getattr(lora, "load_inplace", False)),
        )
        if adapter is None:
            return None
        salt += b"lora\0" + adapter.encode() + b"\0"
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        salt += b"salt\0" + str(cache_salt).encode() + b"\0"
    count = len(tokens) // chunk_tokens
    extras = [salt] + [b""] * (count - 1) if salt and count else None
    # Packed by struct, about twice as fast as numpy for a list of ids.
    data = token_bytes(tokens, "prompt_token_ids")
    return keys_of_token_bytes(namespace, data, chunk_tokens, extras)


@dataclass
class _Request:
    request: Any
    keys: list[ChunkKey] | None
    #: vLLM's local prefix-cache hit when kvtier last answered (block-aligned).
    local_hit: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: Chunks already offered to the store path.
    chunks_seen: int = 0
    waiting_since: float | None = None


@dataclass
class _StepWork:
    loads: list[ChunkKey] = field(default_factory=list)
    stores: list[ChunkKey] = field(default_factory=list)
    #: What the ranks that reported so far said.
    result: StepResult | None = None


@dataclass
class ConnectorCounters:
    """Totals since the engine started (written to ``kvtier_stats_file``)."""

    lookups: int = 0
    hit_tokens: int = 0
    chunks_loaded: int = 0
    chunks_stored: int = 0
    store_drops: int = 0
    load_failures: int = 0
    store_failures: int = 0
    promotion_timeouts: int = 0


class SchedulerSide:
    """Answers vLLM's scheduler from a :class:`KVCache` and plans page copies,
    which vLLM's workers make through the cache's slots in shared memory."""

    def __init__(
        self,
        cache: KVCache,
        shape: VllmGeometry,
        *,
        lookup_timeout_s: float,
        idle_wait_s: float = 0.05,
        poll_s: float = 0.0005,
        stats_file: str | None = None,
        events: TierEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        #: vLLM KV-cache events of kvtier's tiers, when vLLM publishes events.
        self.events = events
        if events is not None:
            cache.watch_residency(events.changed)
        self.layout: KVLayout = cache.layout
        self.shape = shape
        self.lookup_timeout_s = lookup_timeout_s
        self.idle_wait_s = idle_wait_s
        self.poll_s = poll_s
        self.stats_file = stats_file
        self.clock = clock
        self.counters = ConnectorCounters()
        name = cache.shared_memory_name
        if name is None:
            raise ValueError("the vLLM connector needs the primary tier in shared memory")
        primary = cache.status.primary
        self.buffer = SharedBuffer(name, primary.num_slots, primary.slot_bytes)
        # Until the name goes, it marks this engine as alive to stale-name cleanup.
        self._name_guard = NameGuard(name)
        self._requests: dict[str, _Request] = {}
        self._adapters = AdapterIdentities()
        self._next_step = 0
        self._loads = PageCopies()
        self._load_keys: list[ChunkKey] = []
        self._failed_block_ids: list[int] = []
        self._in_flight: dict[int, _StepWork] = {}
        self._attached: set[int] = set()
        self._name_released = False
        self._closed = False

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    # vLLM scheduler hooks -----------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if not state.keys:
            return 0, False
        # Leave at least the last prompt token to compute: vLLM needs its logits.
        usable = min(len(state.keys), (request.num_tokens - 1) // self.chunk_tokens)
        first = num_computed_tokens // self.chunk_tokens
        if first >= usable:
            return 0, False
        self.counters.lookups += 1
        if state.waiting_since is not None:
            # Asked again for chunks being promoted: take the promotions that
            # ended since the last step now, not a step later.
            self._safely(self.cache.collect)
        try:
            result = self.cache.probe(state.keys[first:usable], request_id=request.request_id)
        except Exception:
            logger.exception("kvtier lookup failed for request %s; recomputing", request.request_id)
            return 0, False
        if result.pending:
            since = state.waiting_since
            if since is None:
                since = state.waiting_since = self.clock()
                if self.events is not None:  # promotions: their stores will be announced
                    first_pending = first + result.hit_chunks
                    self.events.remember(state.request, range(first_pending, usable), state.keys)
            # Never past the request's own timeout.
            wait = min(self.idle_wait_s, self.lookup_timeout_s - (self.clock() - since))
            if wait > 0 and self._requests.keys() == {request.request_id}:
                result = self._await_promotions(
                    state.keys[first:usable], request.request_id, result, wait
                )
            if result.pending:
                if self.clock() - since < self.lookup_timeout_s:
                    return None, False  # promotions in flight: vLLM asks again next step
                self.counters.promotion_timeouts += 1
        state.waiting_since = None
        external = (first + result.hit_chunks) * self.chunk_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        state.local_hit = num_computed_tokens
        return external, False

    def _await_promotions(
        self, keys: list[ChunkKey], request_id: str, result: LookupResult, wait_s: float
    ) -> LookupResult:
        """Wait here, up to ``wait_s``, for the promotions of a request the
        engine has nothing else to run beside.

        Answering "ask again" would cost the request at least one more engine
        step after its chunks land: an empty step (a round trip to every
        worker) at a time, each spent in Python beside the tier's I/O threads.
        With no other request known to the scheduler, no one else waits on
        this one; the bound keeps a request that arrives meanwhile from
        waiting longer than that. The wait sleeps until a tier announces a
        finished job (``poll_s`` only paces tiers that announce nothing).
        """
        try:
            return self.cache.wait_for_promotions(
                keys, request_id=request_id, timeout=wait_s, poll_s=self.poll_s
            )
        except ClosedError:  # the engine is shutting down
            return result
        except Exception:
            logger.exception("kvtier: waiting for promotions of %s failed", request_id)
            return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._state(request)
        block_ids = blocks.get_block_ids()[0]
        bpc, size = self.shape.blocks_per_chunk, self.shape.block_size
        first_block = state.local_hit // size
        last_block = first_block + num_external_tokens // size  # exclusive
        wanted = range(first_block, last_block)
        first_chunk, last_chunk = first_block // bpc, (last_block - 1) // bpc
        keys = (state.keys or [])[first_chunk : last_chunk + 1]
        try:
            slots = self.cache.pin(keys)
        except KeyError:
            # Evicted since the lookup (cannot happen within one scheduler pass,
            # but never copy from a slot that is not pinned).
            logger.warning("kvtier: chunks of request %s vanished; recomputing", request.request_id)
            self.counters.load_failures += len(keys)
            self._failed_block_ids.extend(block_ids[b] for b in wanted)
            return
        # The wanted blocks, chunk by chunk (a slot for every chunk, or this raises).
        for chunk, slot in zip(range(first_chunk, last_chunk + 1), slots, strict=True):
            start, end = max(first_block, chunk * bpc), min(last_block, (chunk + 1) * bpc)
            self._loads.add_run(slot, start - chunk * bpc, block_ids[start:end])
        self._load_keys.extend(keys)
        self.counters.hit_tokens += num_external_tokens
        self.counters.chunks_loaded += len(keys)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        self._safely(self.cache.step)
        step = self._next_step
        self._next_step += 1
        meta = KVTierConnectorMetadata(
            step, self.buffer, loads=self._loads, failed_block_ids=self._failed_block_ids
        )
        work = _StepWork(loads=self._load_keys)
        self._loads, self._load_keys, self._failed_block_ids = PageCopies(), [], []

        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                done = new.num_computed_tokens + scheduled[new.req_id]
                self._plan_stores(state, done, meta, work)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[index]
            if req_id in resumed:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            # Past its prompt's chunks (decoding), a request has nothing to store.
            if state.keys and state.chunks_seen < len(state.keys):
                done = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
                self._plan_stores(state, done, meta, work)
        if work.loads or work.stores:
            self._in_flight[step] = work
        return meta

    def _plan_stores(
        self, state: _Request, computed: int, meta: KVTierConnectorMetadata, work: _StepWork
    ) -> None:
        """Reserve slots for prompt chunks whose KV is complete once this step runs."""
        if not state.keys:
            return
        bpc = self.shape.blocks_per_chunk
        full = min(
            len(state.keys),
            min(computed, state.request.num_prompt_tokens) // self.chunk_tokens,
            len(state.block_ids) // bpc,
        )
        if full <= state.chunks_seen:
            return
        chunks = range(state.chunks_seen, full)
        state.chunks_seen = full
        keys = [state.keys[c] for c in chunks]
        try:
            reserved = self.cache.reserve(keys)
        except Exception:
            logger.exception("kvtier prepare_store failed; chunks not offloaded")
            reserved = None
        if reserved is None:
            self.counters.store_drops += len(keys)
            return
        if self.events is not None:
            new = [chunk for chunk, key in zip(chunks, keys, strict=True) if key in reserved]
            self.events.remember(state.request, new, state.keys)
        for chunk, key in zip(chunks, keys, strict=True):
            slot = reserved.get(key)
            if slot is None:
                continue  # already resident (or being written by another request)
            meta.stores.add_run(slot, 0, state.block_ids[chunk * bpc : (chunk + 1) * bpc])
            work.stores.append(key)

    def update_connector_output(self, connector_output: Any) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, KVTierWorkerMetadata):
            return
        self._workers_attached(report.attached)
        for step, result in report.finished.items():
            work = self._in_flight.get(step)
            if work is None:
                continue
            work.result = result if work.result is None else work.result.merge(result)
            # A chunk is whole only once every rank copied its part.
            if work.result.ranks >= self.shape.num_ranks:
                del self._in_flight[step]
                self._finish(work, work.result.loads_ok, work.result.stores_ok)

    def workers_started(self, handshakes: Iterable[object]) -> None:
        """The workers' start-up answers: those that mapped the slots already."""
        self._workers_attached(
            h.rank
            for h in handshakes
            if isinstance(h, KVTierHandshake) and h.buffer_name == self.buffer.name
        )

    def _workers_attached(self, ranks: Iterable[int]) -> None:
        self._attached.update(ranks)
        if len(self._attached) >= self.shape.num_ranks:
            self._release_name()

    def _finish(self, work: _StepWork, loads_ok: bool, stores_ok: bool) -> None:
        if work.loads:
            self._safely(self.cache.unpin, work.loads)
            if not loads_ok:
                self.counters.load_failures += len(work.loads)
        if work.stores:
            self._safely(self.cache.commit, work.stores, stores_ok)
            if stores_ok:
                self.counters.chunks_stored += len(work.stores)
            else:
                self.counters.store_failures += len(work.stores)

    def take_events(self) -> list[Any]:
        """vLLM KV-cache events of what kvtier's tiers stored or dropped since the last call."""
        return self.events.take() if self.events is not None else []

    def request_finished(self, request: Any) -> None:
        if self._requests.pop(request.request_id, None) is not None:
            self._safely(self.cache.end_request, request.request_id)

    def reset_cache(self) -> bool:
        """Empty the CPU primary tier (secondary tiers keep their chunks); False if busy."""
        if self._in_flight or self._load_keys:
            return False
        try:
            self.cache.reset()
        except RuntimeError:
            return False
        return True

    def shutdown(self) -> None:
        """Drain every tier (so what was stored survives the engine), then release all."""
        if self._closed:
            return
        self._closed = True
        for work in self._in_flight.values():
            # Steps the worker never reported: their pages may be incomplete.
            self._finish(work, loads_ok=False, stores_ok=False)
        self._in_flight.clear()
        self._safely(self.cache.close)
        self._name_guard.release()
        self._write_stats()

    # Helpers --------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            keys = request_keys(self.layout.namespace, request, self.chunk_tokens, self._adapters)
            state = self._requests[request.request_id] = _Request(request, keys)
            if keys is not None:  # recorded once a request
                self.cache.record_request(keys, len(request.prompt_token_ids))
        return state

    def _release_name(self) -> None:
        """Once every worker mapped the slots, drop their name: a killed engine leaks nothing."""
        if self._name_released:
            return
        self._name_released = True
        self.cache.unlink_shared_memory()
        self._name_guard.release()

    def stats(self) -> dict[str, object]:
        primary = self.cache.status.primary
        return {
            "shared_memory_name": self.buffer.name,
            "connector": vars(self.counters).copy(),
            "primary": {
                "free": primary.free,
                "idle": primary.idle,
                "pinned": primary.pinned,
                "writing": primary.writing,
                "hits": primary.hits,
                "evictions": primary.evictions,
            },
            "tiers": [
                {"type": tier_type, **stats} for tier_type, stats in self.cache.status.tier_stats()
            ],
            "kv_events": vars(self.events.counters).copy() if self.events is not None else None,
        }

    def _write_stats(self) -> None:
        if self.stats_file is None:
            return
        # Written beside the target and renamed: an engine killed mid-write
        # leaves the previous file (or none), never a torn one.
        partial = f"{self.stats_file}.{os.getpid()}.tmp"
        try:
            with open(partial, "w") as out:
                json.dump(self.stats(), out, indent=1)
            os.replace(partial, self.stats_file)
        except OSError:
            logger.exception("kvtier: cannot write stats to %s", self.stats_file)
            with contextlib.suppress(OSError):
                os.unlink(partial)

    @staticmethod
    def _safely(method: Callable[..., object], *args: object) -> None:
        try:
            method(*args)
        except Exception:
            logger.exception("kvtier: %s failed", getattr(method, "__name__", method))
