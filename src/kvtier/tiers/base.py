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
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from kvtier.codecs import Codec, CodecStage
from kvtier.keys import ChunkKey
from kvtier.options import Options

if TYPE_CHECKING:
    from kvtier.layout import KVLayout
    from kvtier.primary import PrimaryTier

logger = logging.getLogger(__name__)

#: Told the keys a tier no longer holds (see :meth:`SecondaryTier.report_removed`).
RemovalListener = Callable[[Sequence[ChunkKey]], None]


class TierSpec(Protocol):
    """What a tier reads of the :class:`~kvtier.specs.base.OffloadingSpec` it
    is built for: the KV layout (chunk size, ``layout.namespace``). Any object
    with a ``layout`` will do, so tiers do not depend on the specs."""

    @property
    def layout(self) -> KVLayout: ...


class HolderIndex(Protocol):
    """Where chunks are, as the cluster index tells (see :mod:`kvtier.fleet`)."""

    def peers_holding(self, keys: Sequence[ChunkKey]) -> list[frozenset[str]]:
        """For each key, the ``host:port`` of the live nodes' peer services whose
        primary tier holds it. Raises when the index cannot answer in time."""
        ...


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
    #: Chunk bytes given to the tier's codec to store (before encoding).
    codec_bytes_in: int = 0
    #: Payload bytes the codec made of them (what the tier stores).
    codec_bytes_out: int = 0
    #: Chunks the codec failed to encode (not stored) or to decode (not served).
    codec_failures: int = 0
    #: Chunks loaded that another codec, or other parameters, wrote: never
    #: decoded nor served (a lossy chunk reaching a tier without that opt-in).
    codec_refused: int = 0
    #: Of :attr:`codec_failures`: encodes or decodes that missed the codec
    #: timeout (the tier waited no longer; see ``codec_timeout_s``).
    codec_timeouts: int = 0

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


class TierOptions(Options):
    """Base for a tier's typed options; unknown keys are errors.

    Subclass it, declare fields with defaults and docstrings, and set it as the
    tier's ``Options``: configuration is validated against it before any tier
    starts, and the configuration reference is generated from it.
    """

    def store_location(self) -> str | None:
        """Where the tier keeps its chunks, as text that two entries of one
        configuration share exactly when they name the same place (a
        directory; a server and key prefix). ``None``, the default: a store of
        its own, as ``memory``'s. A configuration with two tiers over one
        place is refused: each chunk would be held, counted and evicted twice.
        Never holds a secret: it is shown in that refusal."""
        return None


#: The options type of a tier: ``class AcmeTier(ThreadedTier[AcmeTierOptions])``
#: makes ``self.options`` an ``AcmeTierOptions`` to the type checker.
OptionsT = TypeVar("OptionsT", bound=TierOptions)

#: The keyword under which a factory hands a tier the options object it
#: validated, beside the options themselves. No option can take this name: a
#: pydantic field never starts with an underscore.
VALIDATED_OPTIONS = "_validated_options"


def constructor_arguments(options: TierOptions) -> dict[str, Any]:
    """The keyword arguments that build a tier with ``options``, validated already.

    A tier is constructed with its options as keyword arguments (the plugin
    contract); :class:`SecondaryTier` takes ``options`` itself when exactly
    these arguments reach it, instead of validating them a second time.
    Arguments a subclass changed on their way are validated as usual.
    """
    arguments = {name: getattr(options, name) for name in options.model_fields_set}
    arguments[VALIDATED_OPTIONS] = options
    return arguments


def _validated(
    model: type[TierOptions], options: Mapping[str, Any], validated: TierOptions | None
) -> TierOptions:
    """``options`` validated against ``model``, or ``validated`` if they were made
    of it: the same names, each the very same object."""
    if (
        validated is not None
        and type(validated) is model
        and options.keys() == validated.model_fields_set
        and all(options[name] is getattr(validated, name) for name in options)
    ):
        return validated
    return model.model_validate(options)


class SecondaryTier(ABC, Generic[OptionsT]):
    """Base of every secondary tier, built-in or out-of-tree.

    Built by the factory as ``cls(spec=..., primary_kv_view=..., tier_type=...,
    **options)``; ``options`` are validated against :attr:`Options`. A tier
    entry with a ``codec`` also passes ``codec=`` (a built
    :class:`~kvtier.codecs.Codec`), which only tiers with :attr:`takes_codecs` accept.
    """

    #: The typed options this tier accepts.
    Options: ClassVar[type[TierOptions]] = TierOptions
    #: The counters :attr:`stats` holds (a subclass of :class:`TierStats` adds its own).
    Stats: ClassVar[type[TierStats]] = TierStats
    #: ``False`` for a tier that never keeps what it is given to store (``p2p``
    #: pulls chunks from peers instead): tools then probe it with lookups only.
    holds_stores: ClassVar[bool] = True
    #: Whether chunks pass through :attr:`codec_stage` on their way (the
    #: threaded runtime's tiers); others refuse a ``codec`` at start.
    takes_codecs: ClassVar[bool] = False
    #: Whether stored values may differ in size (a variable-size codec such
    #: as ``lossless`` needs it); tiers of fixed-size values refuse those.
    variable_payloads: ClassVar[bool] = False
    #: Stored payloads of a fixed-size codec are padded to a multiple of this.
    payload_align: ClassVar[int] = 1
    #: Whether :meth:`recent_keys` names what the tier held before this
    #: process started (a warm start needs one such tier).
    knows_recent_use: ClassVar[bool] = False

    def __init__(
        self,
        *,
        spec: TierSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        codec: Codec | None = None,
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
        handed = options.pop(VALIDATED_OPTIONS, None)
        self.options = cast(OptionsT, _validated(self.Options, options, handed))
        self.stats = self.Stats()
        self._stats_lock = threading.Lock()
        #: Observers of the chunks the tier drops (:meth:`report_removed`).
        self.removal_listeners: list[RemovalListener] = []
        if codec is not None and not getattr(codec, "identity", False):
            if not self.takes_codecs:
                raise ValueError(
                    f"{tier_type}: {type(self).__name__} does not take a codec "
                    f"(it does not store chunks through the tier runtime)"
                )
            if not codec.fixed_size and not self.variable_payloads:
                raise ValueError(
                    f"{tier_type}: codec {codec.name!r} gives chunks of varying size and "
                    f"{type(self).__name__} stores fixed-size values; use a fixed-size "
                    "codec (fp8, int8, int4) here"
                )
        #: Encodes chunks on their way to the tier, decodes them on promotion.
        self.codec_stage = CodecStage(codec, spec.layout, align=self.payload_align)
        self._namespace = self.codec_stage.namespace(spec.layout.namespace)

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def slot(self, index: int) -> memoryview:
        """Primary slot ``index`` as a flat, writable memoryview (CPython cannot
        index a 2-D memoryview by row)."""
        size = self.slot_bytes
        if not 0 <= index < len(self._flat_view) // max(size, 1):
            raise IndexError(f"{self.tier_type}: slot {index} is outside the primary view")
        return self._flat_view[index * size : (index + 1) * size]

    @property
    def namespace(self) -> bytes:
        """Digest of the layout the chunks belong to (mixed with the codec's
        name and parameters, under any codec but ``none``); stored beside
        every chunk."""
        return self._namespace

    @property
    def stored_bytes(self) -> int:
        """Payload bytes of one stored chunk (at most, under a variable-size codec)."""
        return self.codec_stage.stored_bytes

    @abstractmethod
    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        """HIT, MISS, or PENDING while an existence check runs. Never blocks on I/O."""

    def lookup_run(self, keys: Sequence[ChunkKey], ctx: LookupContext) -> list[Lookup]:
        """:meth:`lookup` of the leading ``keys``, in order (``ctx`` is the
        first's): at least one answer, ending after any MISS. A waiting request
        asks about its whole prefix at every look, so a tier answering many
        keys at once saves it a call per key. Default: the first key only."""
        return [self.lookup(keys[0], ctx)]

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

    def release_view(self) -> None:
        """Let go of the primary view, after :meth:`shutdown`, so that whoever
        owns the buffer can unmap it (a view still held keeps it exported)."""
        self._flat_view.release()
        self.primary_kv_view.release()

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

    def advertised_address(self) -> str | None:
        """``host:port`` where other nodes fetch this node's chunks through
        this tier (``p2p``), for the cluster index; ``None``: nowhere."""
        return None

    def recent_keys(self, limit: int) -> Sequence[ChunkKey]:
        """Up to ``limit`` chunks the tier holds, most recently used first, for
        a warm start to promote (see :attr:`knows_recent_use`). May block (a
        scan, a query); called once, off the request path. Default: none."""
        return ()

    def use_holder_index(self, index: HolderIndex) -> None:
        """A cluster index is configured: a tier that asks other nodes may ask
        only those ``index`` names. Default: ignored."""

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

    def require_room(
        self, max_bytes: int | None, largest: int, what: str = "chunk", option: str = "max_bytes"
    ) -> None:
        """Refuse, at start, a bound (the tier's ``option``, ``max_bytes`` by
        default) below the ``largest`` chunk the tier stores (``what`` names it
        in the message): under it every store would fail, or be evicted at
        once, and the tier would hold nothing."""
        if max_bytes is not None and max_bytes < largest:
            raise ValueError(
                f"{self.tier_type}: {option}={max_bytes} cannot hold one {what} of {largest} bytes"
            )

    def report_removed(self, keys: Sequence[ChunkKey]) -> None:
        """Tell :attr:`removal_listeners` that the tier no longer holds ``keys``.

        A tier calls it, from any thread, for chunks it drops by its own
        eviction, finds deleted by another process, or deletes as corrupt, so
        that whoever announces where chunks live (KV events for routers) can
        announce the removal. Chunks a backend drops unseen (a server's own
        eviction) are reported when a load finds them gone, as ``vanished``.
        A listener that raises is logged.
        """
        if not keys:
            return
        for listener in self.removal_listeners:
            try:
                listener(keys)
            except Exception:
                logger.exception("tier %s: removal listener %r raised", self.tier_type, listener)

    def count(self, **deltas: int) -> None:
        """Add to :attr:`stats` from any thread."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tier_type={self.tier_type!r})"
