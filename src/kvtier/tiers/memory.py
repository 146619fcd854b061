"""``memory``: a bounded, byte-exact tier in this process's memory.

The reference implementation of :class:`ThreadedTier` and the test double
for everything above the tiers: it frames chunks with the same integrity
header as the persistent tiers, so corruption tests exercise the real check.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import ByteSize, Field

from kvtier import integrity
from kvtier.errors import ChunkVanishedError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric, TierOptions
from kvtier.tiers.threaded import ThreadedTier, ThreadedTierOptions
from kvtier.units import format_bytes


class MemoryTierOptions(ThreadedTierOptions):
    max_bytes: ByteSize = Field(default=ByteSize(1 << 30), gt=0)
    """Upper bound on chunk bytes held; least recently used chunks go first."""

    io_threads: int = Field(default=2, ge=1, le=64)
    """Worker threads copying chunks."""


class MemoryTier(ThreadedTier[MemoryTierOptions]):
    """Chunks in a dict, least recently used evicted beyond ``max_bytes``."""

    Options: ClassVar[type[TierOptions]] = MemoryTierOptions
    variable_payloads: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_bytes = int(self.options.max_bytes)
        self._chunks: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._chunks_lock = threading.Lock()
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def _known(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [key in self._chunks for key in keys]

    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        value = integrity.frame(self.namespace, key, payload)
        if len(value) > self.max_bytes:
            raise ValueError(f"a {len(value)}-byte chunk exceeds max_bytes={self.max_bytes}")
        with self._chunks_lock:
            old = self._chunks.pop(key, None)
            self._held_bytes -= len(old) if old is not None else 0
            evicted = []
            while self._held_bytes + len(value) > self.max_bytes:
                victim_key, victim = self._chunks.popitem(last=False)
                self._held_bytes -= len(victim)
                evicted.append(victim_key)
            self._chunks[key] = value
            self._held_bytes += len(value)
        if evicted:
            self.count(evictions=len(evicted))
            self.report_removed(evicted)

    def _load_chunk(self, key: ChunkKey, out: memoryview) -> None:
        with self._chunks_lock:
            value = self._chunks.get(key)
            if value is None:
                raise ChunkVanishedError("chunk evicted")
            self._chunks.move_to_end(key)
        integrity.unframe_into(
            value,
            out,
            namespace=self.namespace,
            key=key,
            exact_size=self.codec_stage.fixed_size,
        )

    def _discard(self, key: ChunkKey) -> None:
        with self._chunks_lock:
            value = self._chunks.pop(key, None)
            self._held_bytes -= len(value) if value is not None else 0

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
                f"{format_bytes(self._held_bytes)} of {format_bytes(self.max_bytes)} "
                "held in this process",
            ),
        )

    def metrics(self) -> Sequence[TierMetric]:
        return (
            TierMetric("held_bytes", self._held_bytes, "Framed chunk bytes the tier holds."),
            TierMetric("max_bytes", self.max_bytes, "The tier's bound on held bytes."),
        )

    def describe(self) -> dict[str, object]:
        return {"type": self.tier_type, "max_bytes": self.max_bytes, "held_bytes": self._held_bytes}
