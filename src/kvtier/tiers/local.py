"""Tiers that keep chunks on this machine: a :class:`LocalBackend`, blocking
batched calls that read into and write from primary slots, run as it is by
the tier runtime (:mod:`kvtier.tiers.runtime`), with no guards. It verifies
its own chunks: it knows how it stores them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric
from kvtier.tiers.jobs import JobState
from kvtier.tiers.options import ThreadedTierOptions
from kvtier.tiers.runtime import ChunkStore, ItemErrors, SlotPairs, TierRuntime, in_batches

if TYPE_CHECKING:
    from kvtier.codecs.stage import CodecStage

__all__ = ["ItemErrors", "LocalBackend", "LocalRuntime", "LocalTier", "SlotPairs"]


class LocalRuntime(Protocol):
    """What a local backend may ask of the tier that runs it."""

    @property
    def tier_type(self) -> str:
        """The tier's configured ``type``, for messages."""

    @property
    def namespace(self) -> bytes:
        """The namespace digest every chunk header carries."""

    @property
    def fixed_payload_size(self) -> bool:
        """Whether every payload fills its slot (no variable-size codec)."""

    @property
    def slot_bytes(self) -> int:
        """Bytes of one primary slot."""

    #: How chunks are encoded on their way: the size they are stored at, the
    #: codec a store that records it names.
    codec_stage: CodecStage

    def slot(self, index: int) -> memoryview:
        """Primary slot ``index``, for a backend that serves the node's own
        chunks to others (``p2p``) or checks the buffer's alignment (``fs``)."""

    def count(self, **deltas: int) -> None:
        """Add to the tier's counters (``evictions=1``), from any thread."""

    def report_removed(self, keys: Sequence[ChunkKey]) -> None:
        """Chunks the backend dropped on its own (evicted), for residency."""

    def require_room(self, max_bytes: int | None, largest: int, what: str = "chunk") -> None:
        """Refuse, at start, a ``max_bytes`` below the ``largest`` chunk the
        backend stores (``what`` names it in the message)."""


OptionsT = TypeVar("OptionsT", bound=ThreadedTierOptions)


class LocalBackend(ABC, Generic[OptionsT]):
    """Blocking, batched calls to a store on this machine, run on the tier's
    worker threads. A load writes into its buffer only bytes it verified."""

    #: The typed options the tier's configuration entry is validated against.
    Options: ClassVar[type[ThreadedTierOptions]] = ThreadedTierOptions
    #: Most chunks per call of :meth:`load_many` and :meth:`store_many`.
    io_batch: ClassVar[int] = 1
    #: Most keys per call of :meth:`contains_many`.
    check_batch: ClassVar[int] = 256
    #: A load may fill only the start of its buffer (variable-size codecs).
    variable_payloads: ClassVar[bool] = False

    def __init__(self, options: OptionsT, runtime: LocalRuntime) -> None:
        self.options = options
        self.runtime = runtime

    def known(self, key: ChunkKey) -> bool | None:
        """Answer a lookup without a worker when an index at hand can, else ``None``."""
        return None

    @abstractmethod
    def contains_many(self, keys: Sequence[ChunkKey]) -> Sequence[bool | None]:
        """Whether the store holds each key; ``None`` where it could not say."""

    @abstractmethod
    def store_many(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> ItemErrors:
        """Persist each payload (read it before returning: it is reused)."""

    @abstractmethod
    def load_many(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> ItemErrors:
        """Fill each ``out`` with its chunk's verified bytes. A chunk that fails
        verification is that key's :class:`~kvtier.errors.CorruptChunkError`
        (discarded and counted), one gone since its lookup its
        :class:`~kvtier.errors.ChunkVanishedError` (a miss)."""

    def discard(self, key: ChunkKey) -> bool | None:
        """Delete a chunk found corrupt; ``False`` when it was gone already."""
        return None

    def move_many(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> ItemErrors:
        """:meth:`load_many` or :meth:`store_many`, as the runtime calls them."""
        if state.loading:
            return self.load_many(keys, payloads)
        return self.store_many(keys, payloads)

    def batches(self, pending: SlotPairs, idle_workers: int) -> list[SlotPairs]:
        """A job's chunks in the batches worker tasks move, given how many
        workers have nothing queued: :attr:`io_batch` at a time."""
        return in_batches(pending, self.io_batch)

    def step_task(self) -> Callable[[], None] | None:
        """Work to queue at the end of an engine step, beside existence
        checks (a periodic poll), or ``None``."""
        return None

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Keys the engine just used: a hint for the store's eviction."""

    def close(self) -> None:
        """Release files and memory once no worker uses them."""

    def describe(self) -> dict[str, object]:
        """What status pages show of this store, beside the tier's type."""
        return {}

    def health(self) -> Sequence[HealthCheck]:
        return ()

    def metrics(self) -> Sequence[TierMetric]:
        return ()

    @staticmethod
    def each(
        call: Callable[[ChunkKey, memoryview], None],
        keys: Sequence[ChunkKey],
        buffers: Sequence[memoryview],
    ) -> ItemErrors:
        """``call`` per key and buffer, its exception as that key's error."""
        errors: ItemErrors = []
        for key, buffer in zip(keys, buffers, strict=True):
            try:
                call(key, buffer)
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        return errors


class LocalTier(TierRuntime[OptionsT]):
    """A tier over a :class:`LocalBackend`, named in :attr:`backend_class`."""

    #: The backend this tier runs; :attr:`Options` and the batch sizes are its.
    backend_class: ClassVar[type[LocalBackend[Any]]]
    backend: LocalBackend[OptionsT]

    def _open_store(self) -> ChunkStore:
        self.backend = self.backend_class(self.options, self)
        return self.backend

    @property
    def fixed_payload_size(self) -> bool:
        return self.codec_stage.fixed_size
