"""``memory``: a bounded, byte-exact tier in this process's memory.

The reference local backend (:mod:`kvtier.tiers.local`) and the test double
for everything above the tiers: it frames chunks with the same integrity
header as the persistent tiers, so corruption tests exercise the real check.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from pydantic import ByteSize, Field

from kvtier import integrity
from kvtier.errors import ChunkVanishedError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric
from kvtier.tiers.local import ItemErrors, LocalBackend, LocalRuntime, LocalTier
from kvtier.tiers.options import ThreadedTierOptions
from kvtier.units import format_bytes


class MemoryTierOptions(ThreadedTierOptions):
    max_bytes: ByteSize = Field(default=ByteSize(1 << 30), gt=0)
    """Upper bound on chunk bytes held, each with its frame; least recently
    used chunks go first. Less than one chunk fails at start."""

    io_threads: int = Field(default=2, ge=1, le=64)
    """Worker threads copying chunks."""


class MemoryBackend(LocalBackend[MemoryTierOptions]):
    """Chunks in a dict, least recently used evicted beyond ``max_bytes``."""

    Options: ClassVar[type[ThreadedTierOptions]] = MemoryTierOptions
    variable_payloads: ClassVar[bool] = True

    def __init__(self, options: MemoryTierOptions, runtime: LocalRuntime) -> None:
        super().__init__(options, runtime)
        self.max_bytes = int(options.max_bytes)
        largest = integrity.HEADER_BYTES + runtime.codec_stage.stored_bytes
        runtime.require_room(self.max_bytes, largest, "framed chunk")
        self._chunks: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._chunks_lock = threading.Lock()
        self.held_bytes = 0

    def known(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [key in self._chunks for key in keys]

    def store_many(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> ItemErrors:
        return self.each(self._store, keys, payloads)

    def load_many(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> ItemErrors:
        return self.each(self._load, keys, outs)

    def _store(self, key: ChunkKey, payload: memoryview) -> None:
        value = integrity.frame(self.runtime.namespace, key, payload)
        if len(value) > self.max_bytes:
            raise ValueError(f"a {len(value)}-byte chunk exceeds max_bytes={self.max_bytes}")
        with self._chunks_lock:
            old = self._chunks.pop(key, None)
            self.held_bytes -= len(old) if old is not None else 0
            evicted = []
            while self.held_bytes + len(value) > self.max_bytes:
                victim_key, victim = self._chunks.popitem(last=False)
                self.held_bytes -= len(victim)
                evicted.append(victim_key)
            self._chunks[key] = value
            self.held_bytes += len(value)
        if evicted:
            self.runtime.count(evictions=len(evicted))
            self.runtime.report_removed(evicted)

    def _load(self, key: ChunkKey, out: memoryview) -> None:
        with self._chunks_lock:
            value = self._chunks.get(key)
            if value is None:
                raise ChunkVanishedError("chunk evicted")
            self._chunks.move_to_end(key)
        integrity.unframe_into(
            value,
            out,
            namespace=self.runtime.namespace,
            key=key,
            exact_size=self.runtime.fixed_payload_size,
        )

    def discard(self, key: ChunkKey) -> None:
        with self._chunks_lock:
            value = self._chunks.pop(key, None)
            self.held_bytes -= len(value) if value is not None else 0

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        with self._chunks_lock:
            for key in keys:
                if key in self._chunks:
                    self._chunks.move_to_end(key)

    def corrupt_for_tests(self, key: ChunkKey, offset: int = -1) -> None:
        """Flip one stored byte of ``key`` (used by fault tests)."""
        with self._chunks_lock:
            value = bytearray(self._chunks[key])
            value[offset] ^= 0xFF
            self._chunks[key] = bytes(value)

    def health(self) -> Sequence[HealthCheck]:
        return (
            HealthCheck(
                "capacity",
                True,
                f"{format_bytes(self.held_bytes)} of {format_bytes(self.max_bytes)} "
                "held in this process",
            ),
        )

    def metrics(self) -> Sequence[TierMetric]:
        return (
            TierMetric("held_bytes", self.held_bytes, "Framed chunk bytes the tier holds."),
            TierMetric("max_bytes", self.max_bytes, "The tier's bound on held bytes."),
        )

    def describe(self) -> dict[str, object]:
        return {"max_bytes": self.max_bytes, "held_bytes": self.held_bytes}


class MemoryTier(LocalTier[MemoryTierOptions]):
    """The ``memory`` tier: the local-tier runtime over :class:`MemoryBackend`."""

    backend_class = MemoryBackend
    backend: MemoryBackend

    @property
    def held_bytes(self) -> int:
        """Framed chunk bytes held (read by status pages)."""
        return self.backend.held_bytes
