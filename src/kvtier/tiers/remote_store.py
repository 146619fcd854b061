"""A remote :class:`~kvtier.tiers.backend.Backend` in the call shape the tier
runtime drives: it names each chunk, frames and verifies its value, holds the
values existence checks read (prefetch), and gives every batch's outcome to
the guards. It is also the backend's :class:`~kvtier.tiers.backend.BackendRuntime`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier import integrity
from kvtier.errors import (
    BackendUnavailableError,
    ChunkVanishedError,
    CorruptChunkError,
    describe_error,
)
from kvtier.keys import ChunkKey
from kvtier.layout import KEY_BYTES
from kvtier.tiers.backend import (
    Backend,
    BackendSkipped,
    Exists,
    Fetched,
    FramedValue,
    ValueBuffer,
)
from kvtier.tiers.base import HealthCheck, TierMetric
from kvtier.tiers.deadlines import call_within
from kvtier.tiers.guards import Guards
from kvtier.tiers.jobs import JobState
from kvtier.tiers.prefetch import Prefetched
from kvtier.tiers.runtime import ItemErrors, SlotPairs, in_batches, spread_size

if TYPE_CHECKING:
    from kvtier.tiers.runtime import TierRuntime

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: A batch's items while the backend is known down: failed, not sent.
_SKIPPED = BackendSkipped("backend known down: request not sent")


def _fitted(buffer: ValueBuffer, size: int) -> ValueBuffer:
    """``buffer`` itself when ``size`` fills it, else a view of its start."""
    return buffer if len(buffer) == size else memoryview(buffer)[:size]


class RemoteStore:
    """``backend_class`` built over this adapter, run by ``tier`` behind ``guards``."""

    def __init__(
        self, tier: TierRuntime[Any], guards: Guards, backend_class: type[Backend[Any]]
    ) -> None:
        options = tier.options
        self.tier = tier
        self.guards = guards
        self.tier_type = tier.tier_type
        self.namespace = tier.namespace
        #: The start of every name in the store: prefix, namespace, separator.
        self.names_prefix = (
            f"{backend_class.name_prefix(options)}{tier.namespace.hex()}"
            f"{backend_class.name_separator}"
        )
        #: Length of the largest stored value: header and stored payload.
        self.value_bytes = integrity.HEADER_BYTES + tier.stored_bytes
        #: Whether every value is exactly :attr:`value_bytes` long.
        self.fixed_value_size = tier.codec_stage.fixed_size
        self._batch = backend_class.batch_chunks(tier.stored_bytes)
        #: Most chunks one existence check asks about.
        self.check_chunks = backend_class.check_chunks(tier.stored_bytes)
        # One request per chunk: a task per worker runs a job's chunks in
        # parallel, and once the backend is known down each task stops sending
        # instead of a queue of one-chunk tasks each paying a timeout.
        self._spread_over = tier.workers.count if backend_class.spreads_batches else 1
        self._worker_local = threading.local()
        self.backend: Backend[Any] = backend_class(options, self)
        #: Whether loads receive values in their slots (see ``Backend.get_into``).
        self.receives_into = self.backend.receives_into and self.fixed_value_size
        #: Values existence checks read whole, for the loads that follow.
        self.prefetched: Prefetched | None = None
        if self.backend.prefetch_bytes:
            self.prefetched = Prefetched(
                self.backend.prefetch_bytes,
                on_expired=lambda count: self.count(prefetch_expired=count),
            )

    # What the backend may ask of its runtime (BackendRuntime) ---------------

    def count(self, **deltas: int) -> None:
        self.tier.count(**deltas)

    def report_removed(self, names: Sequence[str | bytes]) -> int:
        keys = [key for key in map(self.key_of, names) if key is not None]
        self.tier.report_removed(keys)
        return len(keys)

    def require_room(self, max_bytes: int | None, option: str = "max_bytes") -> None:
        self.tier.require_room(max_bytes, self.value_bytes, "value", option)

    def check_sending(self) -> None:
        """Raise :class:`BackendSkipped` once the backend is known down."""
        if not self.guards.sending:
            raise BackendSkipped("backend known down: request not sent")

    def answered(self) -> None:
        self.guards.answered()

    def scratch_headers(self, count: int) -> list[memoryview]:
        """This worker's header buffers, reused, for values received in place."""
        headers: list[memoryview] = getattr(self._worker_local, "headers", [])
        if len(headers) < count:
            size = integrity.HEADER_BYTES
            block = memoryview(bytearray(count * size))
            headers = [block[i * size : (i + 1) * size] for i in range(count)]
            self._worker_local.headers = headers
        return headers[:count]

    def scratch_values(self, count: int) -> list[ValueBuffer]:
        """This worker's value buffers, reused: no allocation per chunk."""
        buffers: list[ValueBuffer] = getattr(self._worker_local, "buffers", [])
        if len(buffers) < count:
            buffers = buffers + self.backend.allocate_values(count - len(buffers))
            self._worker_local.buffers = buffers
        return buffers

    def start_backend(
        self, connect: Callable[[], T], dispose: Callable[[T], None], target: str, hint: str = ""
    ) -> T:
        """Connect and ping within ``startup_timeout_s``, or fail with a clear message."""
        timeout_s = self.tier.options.startup_timeout_s
        try:
            return self._bounded(connect, timeout_s, dispose)
        except TimeoutError as exc:
            raise BackendUnavailableError(
                self.tier_type,
                target,
                f"no answer within startup_timeout_s={timeout_s}s: "
                "the endpoint accepts connections but does not serve; check the address "
                f"and that the server is running and not overloaded{hint}",
            ) from exc

    def threads_in_calls(self) -> list[threading.Thread]:
        """Workers and probes alive: any may be inside a backend call."""
        return [t for t in self.tier.workers.threads if t.is_alive()] + self.guards.threads

    def store_name(self, key: ChunkKey) -> str:
        """The name ``key`` has in the store."""
        return self.names_prefix + key.hex()

    def key_of(self, name: str | bytes) -> ChunkKey | None:
        """The key named ``name`` (:meth:`store_name`; as bytes too, as some
        stores list names), or ``None`` for a name of another namespace or
        none of kvtier's."""
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        if not name.startswith(self.names_prefix):
            return None
        try:
            key = bytes.fromhex(name[len(self.names_prefix) :])
        except ValueError:
            return None
        return ChunkKey(key) if len(key) == KEY_BYTES else None

    def holds(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether existence checks hold the values of all ``keys`` (a load of them is a copy)."""
        held = self.prefetched
        return held is not None and held.holds([self.store_name(k) for k in keys])

    # What the runtime drives (ChunkStore) ---------------------------------

    def known(self, key: ChunkKey) -> bool | None:
        return None

    def batches(self, pending: SlotPairs, idle_workers: int) -> list[SlotPairs]:
        return in_batches(pending, spread_size(len(pending), self._spread_over, self._batch))

    def step_task(self) -> None:
        return None

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool | None]:
        if not self.guards.sending:
            return [None] * len(keys)  # unknown: asked again once the backend is back
        names = [self.store_name(k) for k in keys]
        if self.prefetched is None:
            found = self.backend.exists_many(names)
        else:
            found = self._read_checked(self.prefetched, names)
        self._account(found)
        return [None if isinstance(f, BaseException) else bool(f) for f in found]

    def move_many(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> ItemErrors:
        if not self.guards.sending:
            return [_SKIPPED] * len(keys)
        if state.loading:
            return self._load(state, keys, payloads)
        return self._store(state, keys, payloads)

    def discard(self, key: ChunkKey) -> None:
        name = self.store_name(key)
        if self.prefetched is not None:
            self.prefetched.drop([name])
        self.backend.delete(name)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        pass

    def close(self) -> None:
        if self.prefetched is not None:
            self.prefetched.clear()
        self.backend.close()

    def describe(self) -> dict[str, object]:
        return {
            "backend_down": not self.guards.breaker.closed,
            "breaker": self.guards.breaker.state.name.lower(),
            **self.backend.describe(),
        }

    def health(self) -> Sequence[HealthCheck]:
        try:
            self._bounded(self.backend.ping, self.tier.options.startup_timeout_s, lambda _: None)
        except Exception as exc:
            return [HealthCheck("backend answers", False, describe_error(exc))]
        return [HealthCheck("backend answers", True)]

    def metrics(self) -> Sequence[TierMetric]:
        return self.backend.metrics()

    # Moves ------------------------------------------------------------------

    def _load(self, state: JobState, keys: list[ChunkKey], outs: list[memoryview]) -> ItemErrors:
        names = [self.store_name(k) for k in keys]
        touch = functools.partial(self.tier.jobs.touching_slots, state)
        # Values received in their slots (after a header each) are verified
        # there: bytes that fail stay in a slot the chunk's failure frees unread.
        headers: Sequence[memoryview | None] = [None] * len(keys)
        if self.prefetched is not None:
            values = self._fetch_held(self.prefetched, names)
        else:
            if self.receives_into:
                headers = self.scratch_headers(len(keys))
                values = self.backend.get_into(names, headers, outs, state.deadline, touch)
            else:
                values = self.backend.get_many(names)
            self._account(values)
        with touch() as allowed:
            if not allowed:  # answered at its deadline: the slots may be another's now
                return [_SKIPPED] * len(keys)
            return [
                self._unframe(k, v, out, header)
                for k, v, out, header in zip(keys, values, outs, headers, strict=True)
            ]

    def _unframe(
        self, key: ChunkKey, value: Fetched, out: memoryview, header: memoryview | None = None
    ) -> BaseException | None:
        """Verify ``value`` into ``out``, or ``out`` itself when its value was
        received there after ``header``; else why not (a missing value: vanished)."""
        if value is None or isinstance(value, BaseException):
            return ChunkVanishedError(key.hex()) if value is None else value
        try:
            if header is None:
                integrity.unframe_into(
                    value, out, namespace=self.namespace, key=key, exact_size=self.fixed_value_size
                )
            else:
                integrity.verify_in_place(header, out, namespace=self.namespace, key=key)
        except CorruptChunkError as exc:
            return exc
        return None

    def _fetch_held(self, held: Prefetched, names: list[str]) -> list[Fetched]:
        """Each value: taken from those the checks held, else read from the backend."""
        values: list[Fetched] = [held.take(name) for name in names]
        taken = sum(value is not None for value in values)
        if taken:
            self.count(prefetch_served=taken)
        if taken == len(names):
            return values
        missing = [i for i, value in enumerate(values) if value is None]
        fetched = self.backend.get_many([names[i] for i in missing])
        self._account(fetched)
        for index, value in zip(missing, fetched, strict=True):
            values[index] = value
        return values

    def _read_checked(self, held: Prefetched, names: list[str]) -> list[Exists]:
        """An existence check that reads the values and holds them, if ``held``
        has room: a value read is there, a missing one is not. One that cannot
        be a chunk counts as there, not held: its load discards it as corrupt."""
        reserved = len(names) * self.value_bytes
        if not held.reserve(reserved):
            return self.backend.exists_many(names)
        kept: list[tuple[str, bytes]] = []
        try:
            values = self.backend.get_many(names)
            found: list[Exists] = []
            for name, value in zip(names, values, strict=True):
                if value is None:
                    found.append(False)
                elif isinstance(value, CorruptChunkError):
                    found.append(True)
                elif isinstance(value, BaseException):
                    found.append(value)
                else:
                    kept.append((name, bytes(value)))
                    found.append(True)
        finally:
            held.keep(reserved, kept)
        self.count(prefetched_chunks=len(kept))
        return found

    def _store(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> ItemErrors:
        names = [self.store_name(k) for k in keys]
        held = [False] * len(names)
        if self.tier.options.skip_existing:
            # An item the store could not check is sent: a write is never wrong.
            held = [f is True for f in self.backend.exists_many(names)]
        todo = [i for i, present in enumerate(held) if not present]
        todo_names = [names[i] for i in todo]
        with self.tier.jobs.touching_slots(state) as allowed:
            if not allowed:  # answered at its deadline: the slots may hold other chunks now
                return [_SKIPPED] * len(keys)
            if self.backend.sends_framed:
                # Checksummed here, sent after from the slot itself: should the
                # job be answered at its deadline meanwhile and a slot written
                # again, its value no longer matches its checksum, and no load
                # ever serves it.
                framed = []
                for i in todo:
                    header = integrity.pack_header(self.namespace, keys[i], payloads[i])
                    framed.append(FramedValue(header, payloads[i]))
                send = functools.partial(self.backend.put_framed, todo_names, framed)
            else:
                # A backend's own buffer type where a value fills it (some
                # clients take bytearray, not memoryview; those take fixed sizes).
                values = [
                    _fitted(value, integrity.HEADER_BYTES + len(payloads[i]))
                    for value, i in zip(self.scratch_values(len(todo)), todo, strict=False)
                ]
                for value, i in zip(values, todo, strict=True):
                    integrity.frame_into(value, self.namespace, keys[i], payloads[i])
                send = functools.partial(self.backend.put_many, todo_names, values)
        errors = send()  # outside the guard: the network is slow
        if len(todo) < len(names):
            self.backend.refresh_many(
                [n for n, present in zip(names, held, strict=True) if present]
            )
        self._account(errors, writes=True)
        result: ItemErrors = [None] * len(keys)
        for index, error in zip(todo, errors, strict=True):
            result[index] = error
        return result

    def _account(self, items: Sequence[object], *, writes: bool = False) -> None:
        """:meth:`Guards.account` a batch: items the backend refused
        (:meth:`Backend.refuses`) are counted apart and take no part in the
        breaker's verdict, whichever batch holds them (a key refused alone,
        asked again, is never an outage)."""
        kept: list[object] = []
        refused: list[BaseException] = []
        for item in items:
            if isinstance(item, BaseException) and self.backend.refuses(item):
                refused.append(item)
            else:
                kept.append(item)
        if refused:
            stores = {"refused_stores": len(refused)} if writes else {}
            self.count(backend_errors=len(refused), **stores)
            self.guards.answered()
            logger.debug("tier %s: %d items refused: %r", self.tier_type, len(refused), refused[0])
        self.guards.account(kept)

    def _bounded(self, call: Callable[[], T], timeout_s: float, dispose: Callable[[T], None]) -> T:
        """:func:`call_within` on a thread named after this tier."""
        return call_within(call, timeout_s, name=f"kvtier-{self.tier_type}-call", dispose=dispose)
