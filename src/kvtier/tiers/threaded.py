"""A tier written as per-chunk blocking hooks (``_contains``,
``_store_chunk``, ``_load_chunk``), run on the worker threads of the tier
runtime (:mod:`kvtier.tiers.runtime`).

See docs/out-of-tree-tier.md, 'Start from ThreadedTier'.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric
from kvtier.tiers.jobs import JobState
from kvtier.tiers.options import ThreadedTierOptions
from kvtier.tiers.runtime import (
    SETTLED,
    ChunkStore,
    ItemErrors,
    SlotPairs,
    TierRuntime,
    in_batches,
)
from kvtier.tiers.workers import Priority

__all__ = ["JobState", "Priority", "ThreadedTier", "ThreadedTierOptions"]

ThreadedOptionsT = TypeVar("ThreadedOptionsT", bound=ThreadedTierOptions)


class ThreadedTier(TierRuntime[ThreadedOptionsT]):
    """Implements the tier contract on worker threads over per-chunk hooks:
    subclasses write ``_contains``, ``_store_chunk`` and ``_load_chunk``."""

    #: Keys handed to one ``_store_batch`` or ``_load_batch`` call.
    io_batch = 1

    def _open_store(self) -> ChunkStore:
        return _Hooks(self)

    @abstractmethod
    def _contains(self, keys: Sequence[ChunkKey]) -> Sequence[bool | None]:
        """Whether the backend holds each key; ``None`` where it could not say
        (checked again at its next lookup, up to :attr:`check_attempts` times)."""

    def _known(self, key: ChunkKey) -> bool | None:
        """Answer a lookup without I/O when a local index can, else ``None``."""
        return None

    def _discard(self, key: ChunkKey) -> bool | None:
        """Delete a chunk found corrupt. ``False`` when it was gone already,
        removed (and counted) by another path of the tier. Default: nothing."""
        return None

    def _close(self) -> None:
        """Release connections and files after the workers stopped."""

    @abstractmethod
    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        """Persist one chunk; raise on failure."""

    @abstractmethod
    def _load_chunk(self, key: ChunkKey, out: memoryview) -> None:
        """Fill ``out`` with the chunk's verified bytes; raise on failure.

        Raise :class:`CorruptChunkError` for bytes that fail verification:
        the base then discards the chunk and counts it. Write into ``out``
        only bytes that passed verification.
        """

    def _store_batch(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Store several chunks (``io_batch`` at most); override to pipeline.
        Default: one at a time."""
        return [self._attempt(self._store_chunk, k, p) for k, p in zip(keys, payloads, strict=True)]

    def _load_batch(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        """Load several chunks (``io_batch`` at most); override to pipeline.
        Default: one at a time."""
        return [self._attempt(self._load_chunk, k, o) for k, o in zip(keys, outs, strict=True)]

    def _transfer(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> list[bool]:
        """Move one batch of ``state``'s job; whether each key made it."""
        if state.loading:
            return self._load_batch(keys, payloads)
        return self._store_batch(keys, payloads)

    def _attempt(
        self, operation: Callable[[ChunkKey, memoryview], None], key: ChunkKey, view: memoryview
    ) -> bool:
        """Run one chunk's hook; what its error means: :meth:`TierRuntime._failed`."""
        try:
            operation(key, view)
        except Exception as exc:
            return self._failed(key, exc)
        return True


class _Hooks:
    """A :class:`ThreadedTier`'s hooks in the call shape the runtime drives."""

    def __init__(self, tier: ThreadedTier[Any]) -> None:
        self.tier = tier

    def known(self, key: ChunkKey) -> bool | None:
        return self.tier._known(key)

    def contains_many(self, keys: Sequence[ChunkKey]) -> Sequence[bool | None]:
        return self.tier._contains(keys)

    def move_many(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> ItemErrors:
        # A hook's failure was settled in _attempt, or by the override that returned False.
        return [None if ok else SETTLED for ok in self.tier._transfer(state, keys, payloads)]

    def batches(self, pending: SlotPairs, idle_workers: int) -> list[SlotPairs]:
        return in_batches(pending, self.tier.io_batch)

    def step_task(self) -> Callable[[], None] | None:
        return None

    def discard(self, key: ChunkKey) -> bool | None:
        return self.tier._discard(key)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        pass

    def close(self) -> None:
        self.tier._close()

    def describe(self) -> dict[str, object]:
        return {}

    def health(self) -> Sequence[HealthCheck]:
        return ()

    def metrics(self) -> Sequence[TierMetric]:
        return ()
