"""The runtime of every remote tier: it runs a :class:`~kvtier.tiers.backend.Backend`
on worker threads, names, frames and verifies its values, bounds every job by a
deadline behind a circuit breaker, and holds values read by existence checks.

See docs/shared-tiers.md, 'How they behave' and 'When the backend fails'.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from kvtier import integrity
from kvtier.errors import BackendUnavailableError, CorruptChunkError, describe_error
from kvtier.keys import ChunkKey
from kvtier.tiers.backend import (
    MAX_WAIT_S,
    Backend,
    BackendSkipped,
    Exists,
    Fetched,
    FramedValue,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.base import (
    HealthCheck,
    JobResult,
    Lookup,
    LookupContext,
    TierMetric,
    TierStats,
    TransferJob,
)
from kvtier.tiers.budgets import RequestBudgets
from kvtier.tiers.circuit import BreakerState, CircuitBreaker
from kvtier.tiers.deadlines import Deadlines, call_within
from kvtier.tiers.prefetch import Prefetched
from kvtier.tiers.probes import Probes
from kvtier.tiers.threaded import JobState, ThreadedBatchTier

__all__ = [
    "MAX_WAIT_S",
    "BackendSkipped",
    "Exists",
    "Fetched",
    "FramedValue",
    "PutErrors",
    "RemoteTier",
    "RemoteTierOptions",
    "RemoteTierStats",
    "ValueBuffer",
    "remote_tier",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _fitted(buffer: ValueBuffer, size: int) -> ValueBuffer:
    """``buffer`` itself when ``size`` fills it, else a view of its start."""
    return buffer if len(buffer) == size else memoryview(buffer)[:size]


@dataclass
class RemoteTierStats(TierStats):
    """:class:`TierStats` plus what a remote backend does wrong (exported as counters)."""

    #: Backend calls that failed: a whole batch, or one item of it.
    backend_errors: int = 0
    #: Times the circuit breaker opened after the backend had been answering.
    backend_outages: int = 0
    #: Jobs and existence checks still running at their deadline.
    deadline_misses: int = 0
    #: Probes sent to a backend whose breaker was open.
    breaker_probes: int = 0
    #: Lookups answered MISS without asking the backend (breaker open).
    outage_skipped_lookups: int = 0
    #: Chunks of store jobs dropped without a call to the backend (breaker open).
    outage_dropped_stores: int = 0
    #: Chunks of load jobs failed without a call to the backend (breaker open).
    outage_failed_loads: int = 0
    #: Chunks whose write the backend refused while answering (full, read-only,
    #: not permitted): failed stores that leave the breaker alone.
    refused_stores: int = 0
    #: Chunks an existence check read whole and held for their promotion.
    prefetched_chunks: int = 0
    #: Chunks loads took from those held values, without a request.
    prefetch_served: int = 0
    #: Held values dropped unclaimed to make room for newer checks.
    prefetch_expired: int = 0


RemoteOptionsT = TypeVar("RemoteOptionsT", bound=RemoteTierOptions)


class RemoteTier(ThreadedBatchTier[RemoteOptionsT]):
    """A tier over a :class:`Backend`: framing, verification, naming and outage
    handling around its batched calls. A tier class names its backend in
    :attr:`backend_class` and nothing else (see :func:`remote_tier`)."""

    #: The backend this tier runs; :attr:`Options` and the batch sizes are its.
    backend_class: ClassVar[type[Backend[Any]]]
    Stats: ClassVar[type[TierStats]] = RemoteTierStats
    stats: RemoteTierStats

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = self.options
        backend_class = getattr(type(self), "backend_class", None)
        if backend_class is None:
            raise TypeError(
                f"{type(self).__qualname__} names no backend_class: set it, "
                "or build the tier class with remote_tier(YourBackend)"
            )
        self._names_prefix = (
            f"{backend_class.name_prefix(options)}{self.namespace.hex()}"
            f"{backend_class.name_separator}"
        )
        self._worker_local = threading.local()
        #: When a backend call last got an answer (``time.perf_counter``).
        self._last_answer = time.perf_counter()
        # The guards, each one object built from the options.
        self.breaker = CircuitBreaker(
            failures=options.breaker_failures,
            backoff_s=options.breaker_backoff_s,
            max_backoff_s=options.breaker_max_backoff_s,
            on_change=self._breaker_changed,
        )
        self._deadlines = Deadlines(f"kvtier-{self.tier_type}-deadlines")
        self.probes = Probes(self.tier_type, self.breaker, self._probe)
        #: Each request's wait on the backend, so that its checks and its
        #: loads share one ``deadline_s`` (see :mod:`kvtier.tiers.budgets`).
        self.budgets = RequestBudgets(options.deadline_s)
        try:
            self.backend: Backend[RemoteOptionsT] = backend_class(options, self)
        except BaseException:  # no worker started yet: the guards' threads only
            self._deadlines.close()
            if self._codec_calls is not None:
                self._codec_calls.close()
            raise
        #: Values existence checks read whole, for the loads that follow.
        self._prefetched: Prefetched | None = None
        if self.backend.prefetch_bytes:
            self._prefetched = Prefetched(
                self.backend.prefetch_bytes,
                on_expired=lambda count: self.count(prefetch_expired=count),
            )

    def _codec_timeout_s(self) -> float:
        # A job is answered at its deadline anyway; a codec call holding its
        # slots must not outlast it by more.
        return self.options.codec_timeout_s or self.options.deadline_s

    def _split(self, pending: list[tuple[ChunkKey, int]]) -> list[list[tuple[ChunkKey, int]]]:
        size = self.backend_class.batch_chunks(self.stored_bytes)
        if self.backend_class.spreads_batches:
            # One request per chunk, so a task per worker: a job's chunks run in
            # parallel, and once the backend is known down each task stops
            # sending instead of a queue of one-chunk tasks each paying a timeout.
            size = min(self.io_batch, max(1, -(-len(pending) // self.io_threads)))
        return [pending[i : i + size] for i in range(0, len(pending), size)]

    # What a backend may ask of its runtime (kvtier.tiers.backend.BackendRuntime)

    @property
    def names_prefix(self) -> str:
        """The start of every name in the store: prefix, namespace, separator."""
        return self._names_prefix

    @property
    def value_bytes(self) -> int:
        """Length of one stored value: header and one chunk's stored payload
        (the most, under a variable-size codec)."""
        return integrity.HEADER_BYTES + self.stored_bytes

    @property
    def fixed_value_size(self) -> bool:
        """Whether every value is exactly :attr:`value_bytes` long."""
        return self.codec_stage.fixed_size

    def check_sending(self) -> None:
        """Raise :class:`BackendSkipped` once the backend is known down."""
        if not self._sending():
            raise BackendSkipped("backend known down: request not sent")

    def answered(self) -> None:
        """A backend call got an answer (backends with per-item requests call it per item)."""
        self._last_answer = time.perf_counter()

    def scratch_values(self, count: int) -> list[ValueBuffer]:
        """This worker's reusable value buffers, at least ``count`` of them.

        Framing into buffers that stay mapped spares a fresh allocation, and
        its page faults, per chunk; the clients are done with a buffer when
        ``put_many`` returns.
        """
        buffers: list[ValueBuffer] = getattr(self._worker_local, "buffers", [])
        if len(buffers) < count:
            buffers = buffers + self.backend.allocate_values(count - len(buffers))
            self._worker_local.buffers = buffers
        return buffers

    def start_backend(
        self, connect: Callable[[], T], dispose: Callable[[T], None], target: str, hint: str = ""
    ) -> T:
        """Connect and ping within ``startup_timeout_s``, or fail with a clear message.

        ``connect`` builds the client and pings it; errors other than the
        timeout propagate as they are, for the backend to explain. ``hint``
        ends the message of a timeout (another likely cause).
        """
        options = self.options
        try:
            return self._bounded(connect, options.startup_timeout_s, dispose)
        except TimeoutError as exc:
            raise BackendUnavailableError(
                self.tier_type,
                target,
                f"no answer within startup_timeout_s={options.startup_timeout_s}s: "
                "the endpoint accepts connections but does not serve; check the address "
                f"and that the server is running and not overloaded{hint}",
            ) from exc

    def threads_in_calls(self) -> list[threading.Thread]:
        """Workers and probes alive: any may be inside a backend call."""
        return [t for t in self._threaded_workers if t.is_alive()] + self.probes.threads

    def store_name(self, key: ChunkKey) -> str:
        """The name ``key`` has in the store."""
        return self._names_prefix + key.hex()

    @property
    def backend_down(self) -> bool:
        """Whether calls skip the backend: the breaker is open or probing."""
        return not self.breaker.closed

    def _sending(self) -> bool:
        """Whether to go on sending requests (backends check it between requests)."""
        return self.breaker.closed and not self.shut_down

    # The contract: fail fast while the breaker is open ------------------------

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        answer = super().lookup(key, ctx) if self._admit() else self._lookup_while_down()
        if ctx.request_id is not None:
            if answer is Lookup.PENDING:
                self.budgets.waiting(ctx.request_id)
            else:
                self.budgets.found(ctx.request_id, key)
        return answer

    def _lookup_while_down(self) -> Lookup:
        if self.breaker.state is BreakerState.HALF_OPEN:
            # The probe answers within deadline_s: the first request
            # after a recovery waits for it rather than missing.
            return Lookup.PENDING
        self.count(outage_skipped_lookups=1)
        return Lookup.MISS

    def on_request_finished(self, request_id: str) -> None:
        self.budgets.finished(request_id)
        super().on_request_finished(request_id)

    def _submit(self, job: TransferJob, *, loading: bool) -> None:
        if not self._admit():
            self._fail_while_down(job, loading=loading)
            return
        # A load gets what its request's checks left of the deadline.
        left, waiting_since = self.budgets.take(job.request_id) if loading else (None, None)
        super()._submit(job, loading=loading)
        self._deadlines.after(
            self.options.deadline_s if left is None else left,
            lambda: self._answer_at_deadline(job.job_id, waiting_since),
        )

    def _fail_while_down(self, job: TransferJob, *, loading: bool) -> None:
        """Answer a job at once, without a call to the backend (breaker open)."""
        if loading:
            self.count(outage_failed_loads=len(job.keys))
        else:
            self.count(outage_dropped_stores=len(job.keys))
        self._report(JobResult(job.job_id, not job.keys, frozenset(), nbytes=0, seconds=0.0))

    def _admit(self) -> bool:
        """Whether a request may go to the backend; starts the probe when due."""
        if self.breaker.closed:
            return True
        if self.probes.start_if_due():
            self.count(breaker_probes=1)
        return False

    def _probe(self) -> None:
        done = threading.Event()
        # A probe past its deadline failed, whatever else answered meanwhile:
        # the breaker must not stay half-open on a probe that hangs.
        self._watch(done, "probe", then=lambda: self.breaker.trip("probe missed its deadline"))
        try:
            self.backend.ping()
        except BaseException as exc:  # whatever it is, the probe must end half-open
            self.breaker.record_failure(f"probe failed: {describe_error(exc)}")
        else:
            self.answered()
            self.breaker.record_success()
        finally:
            done.set()
            self._progressed()  # lookups answered PENDING for the probe: ask again

    def _answer_at_deadline(self, job_id: int, waiting_since: float | None = None) -> None:
        """Answer a job still running with what it has; ``waiting_since``:
        when its request began to wait, if earlier than the job."""
        with self._threaded_lock:
            state = self._threaded_jobs.get(job_id)
        if state is None:
            return
        # A copy into or out of its slots ends first.
        with state.slots_guard, self._threaded_lock:
            if state.reported:
                return
            self._threaded_finish(state)
        since = state.started if waiting_since is None else min(waiting_since, state.started)
        self._missed_deadline(f"{'load' if state.loading else 'store'} job {job_id}", since=since)

    def _watch(
        self, done: threading.Event, what: str, then: Callable[[], None] | None = None
    ) -> None:
        """Unless ``done`` is set in time: count a missed deadline (which may
        open the breaker), then call ``then``."""
        since = time.perf_counter()

        def check() -> None:
            if not done.is_set():
                self._missed_deadline(what, since)
                if then is not None:
                    then()

        self._deadlines.after(self.options.deadline_s, check)

    def shutdown(self) -> None:
        """Drain and close within ``deadline_s``, whatever the backend does."""
        if self.shut_down:
            return
        give_up = time.monotonic() + self.options.deadline_s
        self.drain(timeout=self.options.deadline_s)
        with self._threaded_lock:
            late = list(self._threaded_jobs)
        for job_id in late:  # answered now, their slots left alone from here on
            self._answer_at_deadline(job_id)
        self._threaded_join_timeout_s = max(0.0, give_up - time.monotonic())
        super().shutdown()

    def _missed_deadline(self, what: str, since: float) -> None:
        self.count(deadline_misses=1)
        # A backend that answered anything meanwhile is slow, not stalled:
        # the late work is cut short, but the tier stays in service.
        if self._last_answer < since:
            self.breaker.trip(f"{what} missed its {self.options.deadline_s}s deadline")

    def _run_check(self, keys: list[ChunkKey]) -> Callable[[], None]:
        check = super()._run_check(keys)
        done = threading.Event()

        def run() -> None:
            try:
                check()
            finally:
                done.set()
                self.budgets.checked(keys)

        # Counted from when the step asked, as the lookups wait from then.
        # Past it, the lookups waiting on it answer MISS, every request's and
        # not just the first's; a late answer serves the next request.
        self._watch(
            done, f"existence check of {len(keys)} chunks", functools.partial(self._overdue, keys)
        )
        return run

    # ThreadedBatchTier hooks --------------------------------------------------

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool | None]:
        if not self._sending():
            return [None] * len(keys)  # unknown: asked again once the backend is back
        names = [self.store_name(k) for k in keys]
        try:
            if self._prefetched is None:
                found = self.backend.exists_many(names)
            else:
                found = self._read_checked(self._prefetched, names)
        except Exception as exc:
            self._outcome(len(keys), len(keys), exc)
            return [None] * len(keys)
        self._outcome_of(found)
        return [None if isinstance(f, BaseException) else bool(f) for f in found]

    def _read_checked(self, held: Prefetched, names: list[str]) -> list[Exists]:
        """An existence check that reads the values and holds them, if ``held``
        has room for them: a value read is there, a missing one is not.

        A value that cannot be a chunk counts as there and is not held: its
        load reads it again and discards it as corrupt, as after any check.
        """
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

    def _transfer(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> list[bool]:
        if not self._sending():
            return [False] * len(keys)
        try:
            if state.loading:
                return self._load(state, keys, payloads)
            return self._store(state, keys, payloads)
        except Exception as exc:
            self._outcome(len(keys), len(keys), exc)
            return [False] * len(keys)

    def _store(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> list[bool]:
        names = [self.store_name(k) for k in keys]
        held = [False] * len(names)
        if self.options.skip_existing:
            # An item the store could not check is sent: a write is never wrong.
            held = [f is True for f in self.backend.exists_many(names)]
        todo = [i for i, present in enumerate(held) if not present]
        todo_names = [names[i] for i in todo]
        with state.slots_guard:
            if state.reported:  # answered at its deadline: the slots may hold other chunks now
                return [False] * len(keys)
            if self.backend.sends_framed:
                # Checksummed here, sent after from the slot itself: should the
                # job be answered at its deadline meanwhile and a slot written
                # again, its value no longer matches its checksum, and no load
                # ever serves it.
                framed = []
                for i in todo:
                    payload = payloads[i]
                    header = integrity.pack_header(self.namespace, keys[i], payload)
                    framed.append(FramedValue(header, payload))
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
        self._outcome_of_writes(errors)
        ok = [True] * len(keys)
        for index, error in zip(todo, errors, strict=True):
            ok[index] = error is None
        return ok

    def _load(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> list[bool]:
        values = self._fetch([self.store_name(k) for k in keys])
        ok = [False] * len(keys)
        corrupt: list[tuple[ChunkKey, CorruptChunkError]] = []
        with state.slots_guard:
            if state.reported:  # answered at its deadline: the slots may be another's now
                return ok
            exact_size = self.codec_stage.fixed_size
            for index, (key, value, out) in enumerate(zip(keys, values, payloads, strict=True)):
                if value is None:
                    self._vanished(key)  # evicted or expired since the lookup
                elif isinstance(value, CorruptChunkError):
                    corrupt.append((key, value))
                elif not isinstance(value, BaseException):  # else counted by _fetch
                    try:
                        integrity.unframe_into(
                            value, out, namespace=self.namespace, key=key, exact_size=exact_size
                        )
                        ok[index] = True
                    except CorruptChunkError as exc:
                        corrupt.append((key, exc))
        for bad_key, error in corrupt:  # deletes are backend calls: outside the guard
            self._discard_corrupt(bad_key, error)
        return ok

    def _fetch(self, names: list[str]) -> list[Fetched]:
        """Each value, read from the backend (or held by the checks: :meth:`_fetch_held`)."""
        if self._prefetched is not None:
            return self._fetch_held(self._prefetched, names)
        fetched = self.backend.get_many(names)
        self._outcome_of(fetched)
        return fetched

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
        self._outcome_of(fetched)
        for index, value in zip(missing, fetched, strict=True):
            values[index] = value
        return values

    def _discard(self, key: ChunkKey) -> None:
        name = self.store_name(key)
        if self._prefetched is not None:
            self._prefetched.drop([name])
        self.backend.delete(name)

    # Health -----------------------------------------------------------------

    def _outcome_of(self, items: Sequence[object]) -> None:
        """Account a batch by its per-item results (errors are ``BaseException`` items)."""
        errors = [
            item
            for item in items
            if isinstance(item, BaseException) and not isinstance(item, CorruptChunkError)
        ]
        self._outcome(len(errors), len(items), errors[0] if errors else None)

    def _outcome_of_writes(self, errors: PutErrors) -> None:
        """:meth:`_outcome_of` a batch of writes: items the backend refused
        (:meth:`Backend.refuses_write`) are counted apart and take no part in
        the breaker's verdict."""
        kept: PutErrors = []
        refused: list[BaseException] = []
        for error in errors:
            if error is not None and self.backend.refuses_write(error):
                refused.append(error)
            else:
                kept.append(error)
        if refused:
            self.count(backend_errors=len(refused), refused_stores=len(refused))
            self.answered()
            logger.debug("tier %s: %d writes refused: %r", self.tier_type, len(refused), refused[0])
        self._outcome_of(kept)

    def _outcome(self, errors: int, items: int, first: BaseException | None) -> None:
        """One breaker verdict per batch, so mixed per-item results never flap.

        A batch where every item failed is a failed call; one where any item
        got an answer shows the backend serving. Errors are counted either way.
        """
        if isinstance(first, BackendSkipped):
            return  # not a call: the breaker is open already
        if errors:
            self.count(backend_errors=errors)
            logger.debug("tier %s: %d backend errors: %r", self.tier_type, errors, first)
        if items and errors == items:
            self.breaker.record_failure(describe_error(first) if first else "a call failed")
        elif items:
            self.answered()
            self.breaker.record_success()

    def _breaker_changed(self, old: BreakerState, new: BreakerState, reason: str) -> None:
        if old is BreakerState.CLOSED:
            self.count(backend_outages=1)
        if self.shut_down:
            return
        if new is BreakerState.OPEN:
            logger.warning(
                "tier %s: circuit breaker %s -> open (%s): lookups miss and stores are "
                "dropped without calling the backend; probing again in %.2fs",
                self.tier_type,
                old.name.lower(),
                reason,
                max(0.0, self.breaker.retry_at - self.breaker.clock()),
            )
        else:
            logger.warning(
                "tier %s: circuit breaker %s -> %s (%s)",
                self.tier_type,
                old.name.lower(),
                new.name.lower().replace("_", "-"),
                reason,
            )

    def _bounded(self, call: Callable[[], T], timeout_s: float, dispose: Callable[[T], None]) -> T:
        """:func:`call_within` on a thread named after this tier."""
        return call_within(call, timeout_s, name=f"kvtier-{self.tier_type}-call", dispose=dispose)

    def _close(self) -> None:
        self._deadlines.close()
        if self._prefetched is not None:
            self._prefetched.clear()
        self.backend.close()

    def describe(self) -> dict[str, object]:
        return {
            "type": self.tier_type,
            "backend_down": self.backend_down,
            "breaker": self.breaker.state.name.lower(),
            **self.backend.describe(),
        }

    def health(self) -> Sequence[HealthCheck]:
        options = self.options
        try:
            self._bounded(self.backend.ping, options.startup_timeout_s, lambda _: None)
        except Exception as exc:
            return [HealthCheck("backend answers", False, describe_error(exc))]
        return [HealthCheck("backend answers", True)]

    def metrics(self) -> Sequence[TierMetric]:
        state = self.breaker.state
        return [
            TierMetric(
                "backend_up",
                1.0 if state is BreakerState.CLOSED else 0.0,
                "1 while the tier sends requests to its backend (circuit breaker closed), else 0.",
            ),
            TierMetric(
                "breaker_state",
                float(state.value),
                "Circuit breaker of the tier's backend: 0 closed, 1 half-open (probing), 2 open.",
            ),
            *self.backend.metrics(),
        ]


@functools.cache
def remote_tier(backend_class: type[Backend[Any]]) -> type[RemoteTier[Any]]:
    """The tier class running ``backend_class`` (one per backend class), as
    the factory builds for a configuration entry that names a backend."""
    name = backend_class.__name__.removesuffix("Backend") + "Tier"
    namespace = {"backend_class": backend_class, "__module__": backend_class.__module__}
    return type(name, (RemoteTier,), namespace)
