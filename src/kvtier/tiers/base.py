"""The secondary tier contract.

A secondary tier never touches engine memory. It reads and writes primary
slots through ``primary_kv_view``, a 2-D ``memoryview`` of shape
``(num_slots, slot_bytes)``; :meth:`SecondaryTier.slot` gives one chunk. Every method
runs on the caller's thread and returns quickly; all I/O happens on the
tier's own workers.
"""

from __future__ import annotations

import enum
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from pydantic import BaseModel, ConfigDict

from kvtier.keys import ChunkKey

if TYPE_CHECKING:
    from kvtier.layout import KVLayout
    from kvtier.primary import PrimaryTier


class TierSpec(Protocol):
    """What a tier reads of the :class:`~kvtier.specs.base.OffloadingSpec` it
    is built for: the KV layout (chunk size, ``layout.namespace``). Any object
    with a ``layout`` will do, so tiers do not depend on the specs."""

    @property
    def layout(self) -> KVLayout: ...


class Lookup(enum.Enum):
    """What a tier knows about a key right now."""

    HIT = "hit"
    MISS = "miss"
    #: Found or being checked, with a transfer or existence check in flight:
    #: ask again at the next step.
    PENDING = "pending"


@dataclass(frozen=True)
class LookupContext:
    """Who is asking: lets a tier batch per request or prefetch along a prefix."""

    request_id: str | None = None
    #: Position of the key in the request's chunk chain.
    index: int = 0


_job_ids = itertools.count(1)


def next_job_id() -> int:
    """A process-unique job id."""
    return next(_job_ids)


@dataclass(frozen=True)
class TransferJob:
    """A batch of chunks to move between primary slots and a tier.

    For a store, ``slots[i]`` holds the bytes of ``keys[i]``; for a load,
    ``slots[i]`` is where they go.
    """

    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...]
    job_id: int = field(default_factory=next_job_id)
    request_id: str | None = None

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError(
                f"job {self.job_id}: {len(self.keys)} keys but {len(self.slots)} slots"
            )


@dataclass(frozen=True)
class JobResult:
    """How a job ended. ``succeeded`` lists the keys that made it on partial failure."""

    job_id: int
    success: bool
    succeeded: frozenset[ChunkKey]
    nbytes: int
    seconds: float
    #: Keys of a load that the tier no longer held (evicted since the lookup):
    #: misses for the manager, not failures.
    vanished: frozenset[ChunkKey] = frozenset()


@dataclass
class TierStats:
    """Counters every tier keeps; exported as metrics labelled by tier."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    pending: int = 0
    chunks_stored: int = 0
    chunks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_failures: int = 0
    load_failures: int = 0
    corrupt_chunks: int = 0
    evictions: int = 0
    backpressure_drops: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class TierMetric:
    """One extra value a tier exports beside its :class:`TierStats`.

    Exported as ``kvtier_tier_<name>`` (``_total`` appended for counters),
    labelled by tier like every tier metric. ``name`` is lower-case letters,
    digits and underscores.
    """

    name: str
    value: float
    help: str = ""
    #: A monotonically growing count (exported as a counter), else a gauge.
    counter: bool = False


@dataclass(frozen=True)
class HealthCheck:
    """One line of ``kvtier check`` about a tier: reachability, permissions, space..."""

    name: str
    ok: bool
    detail: str = ""


class TierOptions(BaseModel):
    """Base for a tier's typed options; unknown keys are errors.

    Subclass it, declare fields with defaults and docstrings, and set it as the
    tier's ``Options``: configuration is validated against it before any tier
    starts, and the configuration reference is generated from it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


#: The options type of a tier: ``class AcmeTier(ThreadedTier[AcmeTierOptions])``
#: makes ``self.options`` an ``AcmeTierOptions`` to the type checker.
OptionsT = TypeVar("OptionsT", bound=TierOptions)

# Options validated already, and the keyword arguments made of them, while
# the factory constructs a tier with those arguments (see handed_over).
_handed_over: ContextVar[tuple[TierOptions, dict[str, Any]] | None] = ContextVar(
    "kvtier_validated_tier_options", default=None
)


@contextmanager
def handed_over(options: TierOptions) -> Iterator[dict[str, Any]]:
    """The constructor keyword arguments of ``options``, validated already.

    A tier is constructed with its options as keyword arguments (the plugin
    contract). While this block runs, :class:`SecondaryTier` takes ``options``
    itself when exactly these arguments reach it, instead of validating them
    a second time: a configuration's options are validated once. Arguments a
    subclass changed on their way are validated as usual.
    """
    arguments = {name: getattr(options, name) for name in options.model_fields_set}
    token = _handed_over.set((options, arguments))
    try:
        yield arguments
    finally:
        _handed_over.reset(token)


def _validated(model: type[TierOptions], options: Mapping[str, Any]) -> TierOptions:
    """``options`` validated against ``model``, or the object they were made of."""
    handed = _handed_over.get()
    if handed is not None:
        validated, arguments = handed
        if (
            type(validated) is model
            and options.keys() == arguments.keys()
            and all(options[name] is value for name, value in arguments.items())
        ):
            return validated
    return model.model_validate(options)


class SecondaryTier(ABC, Generic[OptionsT]):
    """Base of every secondary tier, built-in or out-of-tree.

    Built by the factory as ``cls(spec=..., primary_kv_view=..., tier_type=...,
    **options)``; ``options`` are validated against :attr:`Options`.
    """

    #: The typed options this tier accepts.
    Options: ClassVar[type[TierOptions]] = TierOptions
    #: ``False`` for a tier that never keeps what it is given to store (``p2p``
    #: pulls chunks from peers instead): tools then probe it with lookups only.
    holds_stores: ClassVar[bool] = True

    def __init__(
        self,
        *,
        spec: TierSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        **options: Any,
    ) -> None:
        if primary_kv_view.ndim != 2:
            raise ValueError(
                f"{tier_type}: primary_kv_view must be 2-D (num_slots, slot_bytes), "
                f"got shape {primary_kv_view.shape}"
            )
        self.spec = spec
        self.primary_kv_view = primary_kv_view
        self._flat_view = primary_kv_view.cast("B")
        self._slot_bytes = int((primary_kv_view.shape or (0, 0))[1])
        self.tier_type = tier_type
        #: The entry's options, validated against :attr:`Options` (once: a
        #: configuration that validated them hands them over as they are).
        self.options = cast(OptionsT, _validated(self.Options, options))
        self.stats = TierStats()
        self._stats_lock = threading.Lock()

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def slot(self, index: int) -> memoryview:
        """The bytes of primary slot ``index`` as a flat, writable memoryview.

        CPython cannot index a 2-D memoryview by row (``view[i]`` raises
        ``NotImplementedError``), so tiers take slots through this.
        """
        size = self.slot_bytes
        return self._flat_view[index * size : (index + 1) * size]

    @property
    def namespace(self) -> bytes:
        """Digest of the layout the chunks belong to; stored beside every chunk."""
        return self.spec.layout.namespace

    @abstractmethod
    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        """HIT, MISS, or PENDING while an existence check runs. Never blocks on I/O."""

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Start copying ``job``'s slots out to the tier; returns at once."""

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Start copying ``job``'s chunks into its slots; returns at once."""

    @abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Results of the jobs that ended since the last call."""

    @abstractmethod
    def drain(self) -> None:
        """Block until no I/O of this tier touches the primary view."""

    @abstractmethod
    def shutdown(self) -> None:
        """Drain, then release workers and connections. Idempotent."""

    # Optional hooks -----------------------------------------------------

    def on_attach(self, primary: PrimaryTier) -> None:
        """Called once by the manager with its primary tier.

        For tiers that serve the node's own chunks to others (``p2p``): pin a
        ready chunk with ``primary.prepare_load``, read it, ``complete_load``.
        """

    def set_progress_listener(self, listener: Callable[[], None]) -> bool:
        """Whether this tier calls ``listener`` (from any thread, quickly, holding
        nothing the manager may wait for) whenever a lookup's answer may have
        changed: a job ended, an existence check answered.

        Callers waiting for promotions then wake when there is something new
        instead of polling. Default: ``False``, and the tier is polled.
        """
        return False

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """The engine used these chunks: a hint for the tier's own eviction."""

    def on_request_finished(self, request_id: str) -> None:
        """The request is done: drop per-request state."""

    def on_step_end(self) -> None:
        """End of an engine step: submit whatever was batched during it."""

    def describe(self) -> dict[str, object]:
        """Facts for ``kvtier check`` and logs (backend, paths, modes)."""
        return {"type": self.tier_type}

    def discard(self, keys: Sequence[ChunkKey]) -> None:
        """Remove these chunks where the tier holds them, best effort; may block.

        For tools, not engines: ``kvtier check`` and ``kvtier bench`` remove
        their probe chunks with it. Default: nothing (the chunks age out).
        """

    def health(self) -> Sequence[HealthCheck]:
        """Checks ``kvtier check`` runs before its round trip (may block briefly).

        A tier reports what it can test cheaply: the backend answers, the
        directory or bucket is writable, there is free space. A failed check
        fails ``kvtier check``.
        """
        return ()

    def metrics(self) -> Sequence[TierMetric]:
        """Extra values to export beside :attr:`stats`, read at every scrape.

        Must be cheap and must not block: it runs on the scraper's thread.
        """
        return ()

    def count(self, **deltas: int) -> None:
        """Add to :attr:`stats` from any thread."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tier_type={self.tier_type!r})"
