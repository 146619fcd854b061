"""The backend of a remote tier: a small class of blocking, batched calls to
a shared store (contains, get, put, delete), built from one typed options
object. :class:`~kvtier.tiers.remote.RemoteTier` runs it on worker threads
behind deadlines, a circuit breaker and checksums.

See docs/out-of-tree-tier.md, 'Write a backend'.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar

from kvtier.errors import BackendUnavailableError, MissingDependencyError, describe_error
from kvtier.tiers.base import TierMetric
from kvtier.tiers.options import MAX_WAIT_S, RemoteTierOptions

__all__ = [
    "MAX_WAIT_S",
    "Backend",
    "BackendRuntime",
    "BackendSkipped",
    "Exists",
    "Fetched",
    "FramedValue",
    "PutErrors",
    "ReadCut",
    "RemoteTierOptions",
    "ValueBuffer",
]

#: What a batched read gives back per name: the value, ``None`` when the store
#: does not hold it, or the error that one item met.
Fetched = bytes | memoryview | None | BaseException
#: What a batched existence check gives back per name: held or not, or the error that item met.
Exists = bool | BaseException
#: A reusable buffer a worker frames one value into (see :meth:`Backend.allocate_values`).
ValueBuffer = bytearray | memoryview
#: What a batched write gives back per name: ``None``, or the error that item met.
PutErrors = list[BaseException | None]

T = TypeVar("T")


class FramedValue(NamedTuple):
    """A value in its two parts, for a backend that sends them one after the
    other: the integrity header, then the payload straight from its slot."""

    header: bytes
    payload: memoryview


class BackendSkipped(ConnectionError):
    """A call not sent because the backend is known to be down (breaker open)."""


class ReadCut(BackendSkipped):
    """A read into slots given up at its job's deadline, or once its job was
    answered. The tier answers the job then, if its deadline's timer has not
    yet, and counts the miss once either way."""


class BackendRuntime(Protocol):
    """What a backend may ask of the tier that runs it."""

    @property
    def tier_type(self) -> str:
        """The tier's configured ``type``, for messages."""

    @property
    def names_prefix(self) -> str:
        """The start of every name in the store: prefix, namespace, separator."""

    @property
    def value_bytes(self) -> int:
        """Length of the largest stored value (header and payload)."""

    @property
    def fixed_value_size(self) -> bool:
        """Whether every value is exactly :attr:`value_bytes` long (no variable-size codec)."""

    def check_sending(self) -> None:
        """Raise :class:`BackendSkipped` once the backend is known down: a
        backend that sends a request per item calls it between requests."""

    def answered(self) -> None:
        """A call got an answer (per item, for a backend of per-item requests)."""

    def scratch_values(self, count: int) -> list[ValueBuffer]:
        """The calling worker's reusable value buffers, at least ``count``."""

    def start_backend(
        self, connect: Callable[[], T], dispose: Callable[[T], None], target: str, hint: str = ""
    ) -> T:
        """``connect()`` within ``startup_timeout_s``, else a clear error naming ``target``."""

    def threads_in_calls(self) -> list[threading.Thread]:
        """Threads that may still be inside a backend call (workers, probes)."""

    def count(self, **deltas: int) -> None:
        """Add to the tier's counters (``evictions=1``), from any thread."""

    def report_removed(self, names: Sequence[str | bytes]) -> int:
        """Names the backend dropped on its own (its eviction), from any thread:
        residency announces them gone (KV events for routers). Names of
        other namespaces, or of nothing kvtier stores, are ignored; returns
        how many were this tier's chunks."""

    def require_room(self, max_bytes: int | None, option: str = "max_bytes") -> None:
        """Refuse, at start, a bound of the backend's below one value
        (:attr:`value_bytes`); ``option`` names the bound in the message."""


OptionsT = TypeVar("OptionsT", bound=RemoteTierOptions)


class Backend(ABC, Generic[OptionsT]):
    """Blocking, batched calls to one store, run on the tier's worker threads.

    Names are strings the runtime builds (:attr:`BackendRuntime.names_prefix`
    and a key's digest); values are framed and verified by the runtime, so a
    backend moves opaque bytes. Per-item errors go back as items; raise when
    a whole batch failed.
    """

    #: The typed options the tier's configuration entry is validated against.
    Options: ClassVar[type[RemoteTierOptions]] = RemoteTierOptions
    #: Most chunks per call of :meth:`get_many` and :meth:`put_many`.
    io_batch: ClassVar[int] = 1
    #: Most names per call of :meth:`exists_many`.
    check_batch: ClassVar[int] = 256
    #: Payload bytes per batch, which caps a batch of large chunks; ``0``: no cap.
    batch_bytes: ClassVar[int] = 0
    #: Payload bytes per existence check, which caps a check of large chunks
    #: (checks that read values whole hold them until the check answers); ``0``: no cap.
    check_bytes: ClassVar[int] = 0
    #: Spread a job over the workers (one request per chunk: a batch is no cheaper).
    spreads_batches: ClassVar[bool] = False
    #: Values may be shorter than :attr:`BackendRuntime.value_bytes` (variable-size codecs).
    variable_payloads: ClassVar[bool] = False
    #: Between the store's prefix and namespace digest and the key digest.
    name_separator: ClassVar[str] = ":"
    #: Whether stores go through :meth:`put_framed` (no copy of the payload)
    #: instead of :meth:`put_many`. Set in ``__init__`` where options decide it.
    sends_framed: bool = False
    #: Whether loads of fixed-size values go through :meth:`get_into`
    #: (received in place) instead of :meth:`get_many`. Set like :attr:`sends_framed`.
    receives_into: bool = False

    def __init__(self, options: OptionsT, runtime: BackendRuntime) -> None:
        """Connect (through :meth:`BackendRuntime.start_backend`, bounded) or raise."""
        self.options = options
        self.runtime = runtime

    def start_client(
        self, connect: Callable[[], T], dispose: Callable[[T], None], target: str, hint: str = ""
    ) -> T:
        """:meth:`BackendRuntime.start_backend`, failing as :meth:`starting` says."""
        with self.starting(target):
            return self.runtime.start_backend(connect, dispose, target, hint)

    @contextmanager
    def starting(self, target: str) -> Iterator[None]:
        """Any error but a missing dependency raised within, as a
        :class:`BackendUnavailableError` naming ``target``: for start-up work
        that needs no bound (building a client, which sends nothing)."""
        try:
            yield
        except (MissingDependencyError, BackendUnavailableError):
            raise
        except Exception as exc:
            raise BackendUnavailableError(
                self.runtime.tier_type, target, describe_error(exc)
            ) from exc

    @classmethod
    def name_prefix(cls, options: OptionsT) -> str:
        """What every name in the store starts with (an option, usually). Default: nothing."""
        return ""

    @classmethod
    def batch_chunks(cls, value_bytes: int) -> int:
        """Chunks per batch for values of ``value_bytes``."""
        return _capped(cls.io_batch, cls.batch_bytes, value_bytes)

    @classmethod
    def check_chunks(cls, value_bytes: int) -> int:
        """Chunks per existence check for values of ``value_bytes``."""
        return _capped(cls.check_batch, cls.check_bytes, value_bytes)

    @property
    def prefetch_bytes(self) -> int:
        """Most bytes existence checks read whole and hold for the loads that
        follow. For a store whose check costs a request per value anyway, and
        whose :meth:`get_many` returns values the caller may keep. Default: 0."""
        return 0

    @abstractmethod
    def exists_many(self, names: Sequence[str]) -> list[Exists]:
        """Whether the store holds each name."""

    @abstractmethod
    def get_many(self, names: Sequence[str]) -> list[Fetched]:
        """Read each value. One that cannot be a chunk (wrong size or type) is
        a :class:`~kvtier.errors.CorruptChunkError` item: deleted and counted."""

    def get_into(
        self,
        names: Sequence[str],
        headers: Sequence[memoryview],
        payloads: Sequence[memoryview],
        deadline: float,
        touch: Callable[[], AbstractContextManager[bool]],
    ) -> list[Fetched]:
        """:meth:`get_many` received in place (see :attr:`receives_into`): each
        value's start into ``headers[i]``, the rest into ``payloads[i]``, a slot.
        Per name: ``payloads[i]`` once filled, ``None``, or the item's error (a
        value of another length: :class:`~kvtier.errors.CorruptChunkError`).
        Write only within ``touch()``, and only when it yields true; the job's
        report waits for it to end, so end it by ``deadline`` (``time.monotonic``),
        raising :class:`ReadCut`: the slots may be another chunk's after it."""
        raise NotImplementedError(f"{type(self).__name__} does not receive in place")

    @abstractmethod
    def put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        """Write each value (the buffers are reused once this returns)."""

    def put_framed(self, names: Sequence[str], values: Sequence[FramedValue]) -> PutErrors:
        """:meth:`put_many` with each value in its two parts (see :attr:`sends_framed`)."""
        raise NotImplementedError(f"{type(self).__name__} does not send framed values")

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove one value (a corrupt one)."""

    @abstractmethod
    def ping(self) -> None:
        """One cheap request that raises unless the store serves this tier."""

    def refresh_many(self, names: Sequence[str]) -> None:
        """Chunks stored again while held: extend their life. Default: nothing."""

    def refuses(self, error: BaseException) -> bool:
        """Whether an item's error is the store answering "no" (full,
        read-only, not permitted) rather than failing to serve: it fails that
        chunk's write, or leaves its check or read unanswered, but never
        opens the breaker. Default: never."""
        return False

    def allocate_values(self, count: int) -> list[ValueBuffer]:
        """At least ``count`` new value buffers for a worker to keep. A store
        moving values from memory it registered (RDMA) hands out that memory."""
        return [bytearray(self.runtime.value_bytes) for _ in range(count)]

    def close(self) -> None:
        """Release the client once no worker uses it. Default: nothing."""

    def describe(self) -> dict[str, Any]:
        """What status pages show of this backend, beside the tier's own."""
        return {}

    def metrics(self) -> Sequence[TierMetric]:
        """Extra values this backend exports, beside the tier's own. Default: none."""
        return ()


def _capped(chunks: int, cap_bytes: int, value_bytes: int) -> int:
    """``chunks``, fewer where they would hold over ``cap_bytes`` (``0``: no cap); at least 1."""
    if not cap_bytes:
        return chunks
    return max(1, min(chunks, cap_bytes // max(1, value_bytes)))
