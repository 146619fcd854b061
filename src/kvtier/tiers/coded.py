"""A tier's moves through its codec: chunks encoded into a worker's buffers
before a store, decoded from them after a load, each codec call bounded
where the codec might hang. See docs/codecs.md."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvtier.codecs import CodecMismatchError
from kvtier.errors import CorruptChunkError
from kvtier.integrity import copy_bytes
from kvtier.keys import ChunkKey
from kvtier.tiers.deadlines import BoundedCalls, CallTimeout
from kvtier.tiers.jobs import Jobs, JobState

if TYPE_CHECKING:
    from kvtier.codecs import CodecStage

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CodedTier(Protocol):
    """What the codec stage needs of the tier it serves."""

    @property
    def tier_type(self) -> str: ...

    @property
    def codec_stage(self) -> CodecStage: ...

    @property
    def slot_bytes(self) -> int: ...

    @property
    def jobs(self) -> Jobs: ...

    def slot(self, index: int) -> memoryview: ...

    def count(self, **deltas: int) -> None: ...

    def move(self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]) -> list[bool]:
        """Move one batch through the tier's store; whether each key made it."""

    def discard_corrupt(self, key: ChunkKey, exc: CorruptChunkError) -> None: ...


class CodedMoves:
    """The codec stage of ``tier``; calls bounded by ``timeout_s`` (else
    ``default_s``) unless the codec declares it always returns promptly."""

    def __init__(self, tier: CodedTier, timeout_s: float | None, default_s: float) -> None:
        self.tier = tier
        self.stage = stage = tier.codec_stage
        #: The codec's calls, each waited for at most the timeout. A helper
        #: thread and a copy per chunk cost loads up to a third of their
        #: speed (docs/codecs.md): only where a codec may hang.
        self.calls: BoundedCalls | None = None
        if timeout_s is not None or not type(stage.codec).declares_prompt_return():
            self.calls = BoundedCalls(f"kvtier-{tier.tier_type}-codec", timeout_s or default_s)

    def close(self) -> None:
        if self.calls is not None:
            self.calls.close()

    def move(self, state: JobState, keys: list[ChunkKey], slots: list[int]) -> list[bool]:
        """Move one batch through the codec's buffers."""
        buffers = self.stage.scratch(len(keys))
        if state.loading:
            ok = self.tier.move(state, keys, buffers)
            return self._decode(state, keys, slots, buffers, ok)
        return self._encode_and_store(state, keys, slots, buffers)

    def _encode_and_store(
        self, state: JobState, keys: list[ChunkKey], slots: list[int], buffers: list[memoryview]
    ) -> list[bool]:
        tier, stage = self.tier, self.stage
        payloads: list[memoryview] = []
        encoded: list[int] = []
        raw_bytes = 0
        with self.tier.jobs.touching_slots(state) as allowed:
            if not allowed:
                return [False] * len(keys)
            for index, (slot, buffer) in enumerate(zip(slots, buffers, strict=True)):
                try:
                    length = self._call(functools.partial(stage.encode, tier.slot(slot), buffer))
                except CallTimeout as exc:  # the rest would fail at once: stop here
                    self._overdue(exc)
                    break
                except Exception as exc:  # the codec's failure costs this chunk only
                    tier.count(codec_failures=1)
                    logger.warning(
                        "tier %s: codec %s failed to encode: %r", tier.tier_type, stage.name, exc
                    )
                    continue
                payloads.append(buffer[:length])
                encoded.append(index)
                raw_bytes += tier.slot_bytes
        tier.count(codec_bytes_in=raw_bytes, codec_bytes_out=sum(map(len, payloads)))
        ok = [False] * len(keys)
        if encoded:
            sent = tier.move(state, [keys[i] for i in encoded], payloads)
            for index, good in zip(encoded, sent, strict=True):
                ok[index] = good
        return ok

    def _decode(
        self,
        state: JobState,
        keys: list[ChunkKey],
        slots: list[int],
        buffers: list[memoryview],
        loaded: Sequence[bool],
    ) -> list[bool]:
        tier, stage = self.tier, self.stage
        ok = [False] * len(keys)
        refused: list[tuple[ChunkKey, CorruptChunkError]] = []
        with self.tier.jobs.touching_slots(state) as allowed:
            if not allowed:  # answered at its deadline: the slots may be another's now
                return ok
            bounded = self.calls is not None
            for index, (key, slot, buffer) in enumerate(zip(keys, slots, buffers, strict=True)):
                if not loaded[index]:
                    continue
                # A bounded decode writes into a buffer of this worker's, so
                # that one past its bound never writes into a slot.
                decoded = stage.decoded() if bounded else tier.slot(slot)
                try:
                    self._call(functools.partial(stage.decode, buffer, decoded))
                except CallTimeout as exc:  # not damage: the chunk stays stored
                    self._overdue(exc)
                    break
                except CorruptChunkError as exc:
                    refused.append((key, exc))
                    continue
                if bounded:
                    copy_bytes(tier.slot(slot), decoded)
                ok[index] = True
        for key, error in refused:  # deletes are backend calls: outside the guard
            if isinstance(error, CodecMismatchError):
                tier.count(codec_refused=1)
            else:
                tier.count(codec_failures=1)
            tier.discard_corrupt(key, error)
        return ok

    def _call(self, call: Callable[[], T]) -> T:
        """``call()`` (the codec's), waited for at most the timeout."""
        return call() if self.calls is None else self.calls(call)

    def _overdue(self, exc: CallTimeout) -> None:
        """The codec missed its bound: this thread's buffers are left to it."""
        self.stage.abandon_buffers()
        self.tier.count(codec_failures=1, codec_timeouts=1)
        logger.warning("tier %s: codec %s: %s", self.tier.tier_type, self.stage.name, exc)
