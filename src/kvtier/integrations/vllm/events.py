"""kvtier's tiers in vLLM's KV-cache event stream, for KV-aware routers.

Every chunk a tier stores or drops becomes a ``BlockStored`` or
``BlockRemoved`` whose ``medium`` names the tier (``kvtier:cpu``,
``kvtier:fs``...), carrying the block hashes vLLM's own prefix cache gives
those tokens: a router that indexes vLLM's events indexes kvtier's tiers
without knowing kvtier. kvtier keys chunks by its own chain, so it remembers,
for a bounded number of chunks, which vLLM blocks a chunk holds (recorded
while the request is at hand) to announce the chunk's stores and removals.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    ExternalBlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvtier import PRIMARY_TIER_NAME, tier_names
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey

from .engine_config import ConnectorOptions, VllmGeometry

logger = logging.getLogger(__name__)

#: What a tier's medium is called unless configured: ``kvtier:<tier name>``.
MEDIUM_PREFIX = "kvtier:"


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """What vLLM's ``BlockStored`` says about the blocks of one kvtier chunk."""

    #: Packed where vLLM's event hashes are 64-bit ints (its default).
    block_hashes: Sequence[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    #: The chunk's token ids, packed (a list of ints takes nine times the room).
    token_ids: array[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None

    def stored(self, medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=list(self.block_hashes),
            parent_block_hash=self.parent_block_hash,
            token_ids=self.token_ids.tolist(),
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=medium,
            lora_name=self.lora_name,
            extra_keys=self.extra_keys,
            group_idx=0,  # kvtier serves models with one KV cache group
        )


def chunk_blocks(
    request: Any, chunk: int, blocks_per_chunk: int, block_size: int, hash_block_size: int
) -> ChunkBlocks | None:
    """Chunk ``chunk`` of ``request`` as vLLM's events name its blocks, or
    ``None`` if vLLM has not hashed them (prefix caching off)."""
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
    first, end = chunk * blocks_per_chunk, (chunk + 1) * blocks_per_chunk
    if len(hashes) < end:
        return None
    start_token, end_token = first * block_size, end * block_size
    # vLLM's own BlockStored lists each block's extra keys (LoRA name, cache
    # salt), computed by the same function.
    extra: list[tuple[Any, ...] | None] = []
    mm_index = 0
    for block in range(first, end):
        keys, mm_index = generate_block_hash_extra_keys(
            request, block * block_size, (block + 1) * block_size, mm_index
        )
        extra.append(keys)
    lora = request.lora_request
    return ChunkBlocks(
        block_hashes=_packed([maybe_convert_block_hash(hashes[b]) for b in range(first, end)]),
        parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
        token_ids=array("i", request.all_token_ids[start_token:end_token]),
        block_size=block_size,
        lora_id=lora.adapter_id if lora is not None else None,
        lora_name=lora.name if lora is not None else None,
        extra_keys=to_event_extra_keys(extra),
    )


def _packed(hashes: list[ExternalBlockHash]) -> Sequence[ExternalBlockHash]:
    """Ints in an array (8 bytes each, not 40), bytes as they are."""
    if all(isinstance(h, int) for h in hashes):
        return array("Q", cast(list[int], hashes))
    return tuple(hashes)


@dataclass(slots=True)
class _Tracked:
    blocks: ChunkBlocks
    #: The media (tiers) the chunk was announced in and not removed from since
    #: (a few: a list takes a quarter of a set's room).
    media: list[str] = field(default_factory=list)


@dataclass
class EventCounters:
    """Totals since the engine started."""

    #: Events handed to vLLM.
    published: int = 0
    #: Tier changes not published because the queue was full.
    dropped: int = 0
    #: Tier changes of chunks whose vLLM blocks kvtier did not know (or no longer).
    unmapped: int = 0


class TierEvents:
    """Turns the manager's residency changes into vLLM KV-cache events.

    :meth:`remember` (the scheduler's thread) records a chunk's blocks while
    its request is at hand; :meth:`changed` is the manager's residency
    listener, called on any thread; :meth:`take` (the scheduler's thread,
    once a step) translates what changed since. At most ``max_chunks``
    chunks are remembered (the least recently recorded go first: their later
    removals go unannounced, which costs a router a miss) and at most
    ``max_queued`` changes wait between two :meth:`take` calls (more are
    dropped and counted).
    """

    def __init__(
        self,
        tier_names: Sequence[str],
        *,
        blocks_per_chunk: int,
        block_size: int,
        hash_block_size: int,
        media: Mapping[str, str] | None = None,
        max_chunks: int = 16384,
        max_queued: int = 65536,
    ) -> None:
        media = dict(media or {})
        self.media = {name: media.pop(name, MEDIUM_PREFIX + name) for name in tier_names}
        if media:
            raise ConfigError(
                [
                    (
                        "kv_connector_extra_config.kvtier_kv_events_media",
                        f"{sorted(media)} name no tier; the tiers are {list(tier_names)}",
                    )
                ]
            )
        self.blocks_per_chunk = blocks_per_chunk
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.max_chunks = max_chunks
        self.max_queued = max_queued
        self.counters = EventCounters()
        self._chunks: OrderedDict[ChunkKey, _Tracked] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: list[tuple[str, Sequence[ChunkKey], bool]] = []
        self._queued = 0
        self._warned_full = False

    def remember(self, request: Any, chunks: Iterable[int], keys: Sequence[ChunkKey]) -> None:
        """Record the vLLM blocks of ``request``'s chunks ``chunks`` (keys ``keys[i]``)."""
        for chunk in chunks:
            key = keys[chunk]
            tracked = self._chunks.get(key)
            if tracked is not None:
                self._chunks.move_to_end(key)
                continue
            blocks = chunk_blocks(
                request, chunk, self.blocks_per_chunk, self.block_size, self.hash_block_size
            )
            if blocks is None:
                break  # nor any later chunk of the request
            self._chunks[key] = _Tracked(blocks)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

    def changed(self, tier: str, keys: Sequence[ChunkKey], stored: bool) -> None:
        """The manager's residency listener: queue the change for :meth:`take`."""
        with self._lock:
            if self._queued + len(keys) > self.max_queued:
                self.counters.dropped += len(keys)
                if not self._warned_full:
                    self._warned_full = True
                    logger.warning(
                        "kvtier: more than %d tier changes between two engine steps; "
                        "dropping KV events (raise kvtier_kv_events_max_queued)",
                        self.max_queued,
                    )
                return
            self._queue.append((tier, keys, stored))
            self._queued += len(keys)

    def take(self) -> list[KVCacheEvent]:
        """The events of the changes queued since the last call, in order."""
        with self._lock:
            queue, self._queue, self._queued = self._queue, [], 0
        events: list[KVCacheEvent] = []
        for tier, keys, stored in queue:
            medium = self.media[tier]
            if stored:
                events.extend(self._stored(medium, keys))
            else:
                removed = self._removed(medium, keys)
                if removed:
                    events.append(BlockRemoved(block_hashes=removed, medium=medium, group_idx=0))
        self.counters.published += len(events)
        return events

    def _stored(self, medium: str, keys: Sequence[ChunkKey]) -> Iterable[BlockStored]:
        for key in keys:
            tracked = self._chunks.get(key)
            if tracked is None:
                self.counters.unmapped += 1
            elif medium not in tracked.media:
                tracked.media.append(medium)
                yield tracked.blocks.stored(medium)

    def _removed(self, medium: str, keys: Sequence[ChunkKey]) -> list[ExternalBlockHash]:
        hashes: list[ExternalBlockHash] = []
        for key in keys:
            tracked = self._chunks.get(key)
            if tracked is None or medium not in tracked.media:
                continue  # never announced here (or forgotten): nothing to take back
            tracked.media.remove(medium)
            hashes.extend(tracked.blocks.block_hashes)
            if not tracked.media:
                del self._chunks[key]
        return hashes


def tier_events(
    options: ConnectorOptions,
    config: KVTierConfig,
    vllm_config: Any,
    kv_cache_config: Any,
    shape: VllmGeometry,
) -> TierEvents | None:
    """The events of kvtier's tiers for this engine, or ``None`` when vLLM
    publishes no KV-cache events or ``kvtier_kv_events`` is off."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if not options.kvtier_kv_events or not getattr(events_config, "enable_kv_cache_events", False):
        return None
    secondary = tier_names([tier.tier_type for tier in config.secondary_tiers])
    return TierEvents(
        [PRIMARY_TIER_NAME, *secondary],
        blocks_per_chunk=shape.blocks_per_chunk,
        block_size=shape.block_size,
        # The block size of request.block_hashes (the cache's unless vLLM hashes finer).
        hash_block_size=int(getattr(kv_cache_config, "hash_block_size", None) or shape.block_size),
        media=options.kvtier_kv_events_media,
        max_chunks=options.kvtier_kv_events_max_chunks,
        max_queued=options.kvtier_kv_events_max_queued,
    )
