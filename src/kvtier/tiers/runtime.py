"""The one runtime of every tier on worker threads: it drives a
:class:`ChunkStore` (blocking, batched calls) with :class:`Workers`,
:class:`ExistenceChecks`, :class:`Jobs`, the codec stage, and, where the
options configure them, the :class:`Guards` of a remote backend.

See docs/architecture.md, 'Secondary tiers'.
"""

from __future__ import annotations

import functools
import logging
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from kvtier.errors import ChunkVanishedError, CorruptChunkError
from kvtier.keys import ChunkKey
from kvtier.tiers.backend import ReadCut
from kvtier.tiers.base import (
    HealthCheck,
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    TierMetric,
    TierOptions,
    TransferJob,
)
from kvtier.tiers.checks import ExistenceChecks
from kvtier.tiers.coded import CodedMoves
from kvtier.tiers.deadlines import BoundedCalls
from kvtier.tiers.guards import Guards
from kvtier.tiers.jobs import Jobs, JobState
from kvtier.tiers.options import RemoteTierOptions, ThreadedTierOptions
from kvtier.tiers.workers import Priority, Workers

if TYPE_CHECKING:
    import threading

    from kvtier.primary import PrimaryTier

logger = logging.getLogger(__name__)

#: What a batched move gives back per key: ``None``, or the error that key met.
ItemErrors = list[BaseException | None]
#: The error of a key whose failure its store settled where it met it
#: (discarded, noted or logged): the runtime fails the key and nothing more.
SETTLED = RuntimeError("the store settled this key's failure")
#: A job's chunks as ``(key, primary slot)`` pairs.
SlotPairs = list[tuple[ChunkKey, int]]


_Item = TypeVar("_Item")


def in_batches(items: list[_Item], size: int) -> list[list[_Item]]:
    """``items`` in order, ``size`` a batch (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def spread_size(count: int, parts: int, most: int) -> int:
    """Items a batch for ``count`` spread over ``parts`` batches, at most ``most`` each."""
    return min(most, max(1, -(-count // parts)))


def _known_answers(
    keys: Sequence[ChunkKey], found_all: Sequence[bool | None]
) -> tuple[list[Lookup], list[ChunkKey]]:
    """The answers of the leading keys an index knew (``found_all``: its
    answer per key), ending after any MISS; else the leading keys it did not."""
    answers: list[Lookup] = []
    unknown: list[ChunkKey] = []
    for key, found in zip(keys, found_all, strict=True):
        if found is None:
            if answers:
                break
            unknown.append(key)
        else:
            if unknown:
                break
            answers.append(Lookup.HIT if found else Lookup.MISS)
            if not found:
                break
    return answers, unknown


class ChunkStore(Protocol):
    """The blocking, batched calls the runtime drives on its workers."""

    def known(self, key: ChunkKey) -> bool | None:
        """Answer a lookup without a worker when an index at hand can, else ``None``."""

    def contains_many(self, keys: Sequence[ChunkKey]) -> Sequence[bool | None]:
        """Whether the store holds each key; ``None`` where it could not say."""

    def move_many(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> ItemErrors:
        """Load (``state.loading``) or store one batch of ``state``'s job.
        Per key: ``None``, :class:`CorruptChunkError` (discarded, counted),
        :class:`ChunkVanishedError` (a miss) or another error."""

    def batches(self, pending: SlotPairs, idle_workers: int) -> list[SlotPairs]:
        """A job's chunks in the batches worker tasks move, given how many
        workers have nothing queued."""

    def step_task(self) -> Callable[[], None] | None:
        """Work to queue at the end of an engine step, beside existence checks."""

    def discard(self, key: ChunkKey) -> bool | None:
        """Delete a chunk found corrupt; ``False`` when it was gone already."""

    def touch(self, keys: Sequence[ChunkKey]) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, object]: ...

    def health(self) -> Sequence[HealthCheck]: ...

    def metrics(self) -> Sequence[TierMetric]: ...


OptionsT = TypeVar("OptionsT", bound=ThreadedTierOptions)

#: How long a tier without deadlines waits for its codec on one chunk.
DEFAULT_CODEC_TIMEOUT_S = 5.0


#: The attributes the runtime keeps its parts in, each set once by it.
_PARTS = frozenset({"workers", "checks", "jobs", "guards", "coded", "store"})


class TierRuntime(SecondaryTier[OptionsT]):
    """The tier contract over the :class:`ChunkStore` that :meth:`_open_store`
    builds; the guards come with options that configure them."""

    Options: ClassVar[type[TierOptions]] = ThreadedTierOptions
    #: Most chunks one batch moves (a backend's, where it has one).
    io_batch: ClassVar[int] = 1
    #: Keys handed to one ``contains_many`` call.
    check_batch: ClassVar[int] = 256
    #: Answers kept for lookups that never came back (an aborted request).
    max_unclaimed_answers: ClassVar[int] = 65536
    #: Failed existence checks of one key before its lookup answers MISS.
    check_attempts: ClassVar[int] = 3
    takes_codecs: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend = cls.__dict__.get("backend_class")
        if backend is not None:  # a tier naming its backend takes what that declares
            cls.Options = backend.Options
            cls.io_batch = backend.io_batch
            cls.check_batch = backend.check_batch
            cls.variable_payloads = backend.variable_payloads

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = self.options
        self._progress_listener: Callable[[], None] | None = None
        self.workers = Workers(f"kvtier-{self.tier_type}", options.io_threads)
        self.checks = ExistenceChecks(self.check_attempts, self.max_unclaimed_answers)
        self.jobs = Jobs(self.slot_bytes, self._progressed)
        guards = None
        if isinstance(options, RemoteTierOptions):
            guards = Guards(
                self.tier_type,
                options,
                jobs=self.jobs,
                count=self.count,
                ping=self._ping,
                progressed=self._progressed,
                workers=self.workers,
            )
        self.guards: Guards | None = guards
        coded = None
        if not self.codec_stage.identity:
            default_s = guards.deadline_s if guards else DEFAULT_CODEC_TIMEOUT_S
            coded = CodedMoves(self, options.codec_timeout_s, default_s)
        self.coded: CodedMoves | None = coded
        try:
            self.store: ChunkStore = self._open_store()
        except BaseException:  # no worker started yet: the helpers' threads only
            self._close_helpers()
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        # A subclass's own state named like a part would silently replace it.
        if name in _PARTS and name in self.__dict__:
            raise AttributeError(
                f"{type(self).__qualname__}.{name}: the tier runtime keeps its {name} "
                f"there (see docs/out-of-tree-tier.md); name yours otherwise, say "
                f"self._{name}"
            )
        super().__setattr__(name, value)

    @abstractmethod
    def _open_store(self) -> ChunkStore:
        """Build the store this tier runs (once, from ``__init__``)."""

    def _ping(self) -> None:
        """The guards' probe: one cheap call that raises unless the store
        serves. Default: none, so that after the backoff the next request tries."""

    @property
    def io_threads(self) -> int:
        """How many worker threads the tier runs."""
        return self.options.io_threads

    @property
    def check_chunks(self) -> int:
        """Most keys one existence-check task asks about. Default: :attr:`check_batch`."""
        return self.check_batch

    @property
    def codec_calls(self) -> BoundedCalls | None:
        """The codec's bounded calls; ``None`` where its calls are not bounded."""
        return None if self.coded is None else self.coded.calls

    @property
    def shut_down(self) -> bool:
        """Whether :meth:`shutdown` began."""
        return self.workers.stopped

    # The contract ---------------------------------------------------------

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        known = self.store.known(key)
        if known is not None:
            return Lookup.HIT if known else Lookup.MISS
        if self.guards is None:
            return self.checks.answer(key)
        return self.guards.lookup(key, ctx, self.checks.answer)

    def lookup_run(self, keys: Sequence[ChunkKey], ctx: LookupContext) -> list[Lookup]:
        if getattr(self.lookup, "__func__", None) is not TierRuntime.lookup:
            return super().lookup_run(keys, ctx)  # a lookup of its own answers, key by key
        return self._answer_run(keys, ctx)

    def _answer_run(self, keys: Sequence[ChunkKey], ctx: LookupContext) -> list[Lookup]:
        """The leading keys the store's index answers, else the leading ones it
        does not (answered by the existence checks), ending after any MISS."""
        found_all = list(map(self.store.known, keys))
        if found_all.count(True) == len(keys):  # an index that holds the whole run
            return [Lookup.HIT] * len(keys)
        if found_all.count(None) == len(keys):  # a store without an index: every run
            unknown = list(keys)
        else:
            answers, unknown = _known_answers(keys, found_all)
            if not unknown:
                return answers
        if self.guards is None:
            return self.checks.answer_run(unknown)
        return self.guards.lookup_run(unknown, ctx, self.checks.answer_run)

    def on_step_end(self) -> None:
        batch = self.checks.take_queued()
        # Spread over the idle workers: a prefix's checks answer in parallel.
        idle = max(1, self.workers.count - self.workers.backlog())
        for keys in in_batches(batch, spread_size(len(batch), idle, self.check_chunks)):
            done = None
            if self.guards is not None:
                done = self.guards.bound_check(keys, functools.partial(self._overdue, keys))
            self.workers.submit(Priority.CHECK, functools.partial(self.check, keys, done))
        task = self.store.step_task()
        if task is not None and not self.shut_down:
            self.workers.submit(Priority.CHECK, task)

    def check(self, keys: list[ChunkKey], done: threading.Event | None = None) -> None:
        """Run one existence check (on a worker); ``done`` is set after."""
        try:
            found = list(self.store.contains_many(keys))
            if len(found) != len(keys):
                raise ValueError(f"{len(found)} answers for {len(keys)} keys")
        except BaseException as exc:  # even a BaseException: else the keys stay "checking"
            self._call_failed("existence check", len(keys), exc)
            found = [None] * len(keys)
        self.checks.record(keys, found)
        self._progressed()
        if done is not None and self.guards is not None:
            self.guards.check_done(keys, done)

    def submit_store(self, job: TransferJob) -> None:
        self.checks.forget(job.keys)
        self._submit(job, loading=False)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job, loading=True)

    def get_finished_jobs(self) -> list[JobResult]:
        return self.jobs.take_finished()

    def drain(self, timeout: float | None = None) -> None:
        self.jobs.drain(timeout)

    def set_progress_listener(self, listener: Callable[[], None]) -> bool:
        self._progress_listener = listener
        return True

    def on_attach(self, primary: PrimaryTier) -> None:
        # Started now: starting threads would otherwise sit on the first request's time.
        self.workers.start()

    def on_request_finished(self, request_id: str) -> None:
        if self.guards is not None:
            self.guards.budgets.finished(request_id)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self.store.touch(keys)

    def discard(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            try:
                self.store.discard(key)
            except Exception as exc:  # best effort: what stays ages out
                logger.debug("tier %s: cannot discard %s: %s", self.tier_type, key.hex(), exc)

    def shutdown(self) -> None:
        """Drain and close; with guards, within ``deadline_s`` whatever the backend does."""
        if self.shut_down:
            return
        guards = self.guards
        join_s = None
        if guards is not None:
            join_s = guards.deadline_s
            self.drain(timeout=guards.deadline_s)
            for job_id in self.jobs.in_flight():  # answered now: slots left alone
                guards.answer_late(job_id)
        else:
            self.drain()
        # A worker stuck in a backend call past the bound is left behind (a
        # daemon): every job it held was answered already.
        self.workers.stop(join_s)
        self._close_helpers()
        self.store.close()

    def describe(self) -> dict[str, object]:
        return {"type": self.tier_type, **self.store.describe()}

    def health(self) -> Sequence[HealthCheck]:
        return self.store.health()

    def metrics(self) -> Sequence[TierMetric]:
        guards = [] if self.guards is None else self.guards.metrics()
        return [*guards, *self.store.metrics()]

    # Machinery --------------------------------------------------------------

    def _progressed(self) -> None:
        """Tell the listener a lookup's answer may have changed (it takes no lock of ours)."""
        listener = self._progress_listener
        if listener is not None:
            try:
                listener()
            except Exception:  # a waiter then finds out by its own bounded poll
                logger.exception("tier %s: progress listener raised", self.tier_type)

    def _overdue(self, keys: Sequence[ChunkKey]) -> None:
        self.checks.overdue(keys)
        self._progressed()

    def _submit(self, job: TransferJob, *, loading: bool) -> None:
        guards = self.guards
        if guards is not None and not guards.admit():
            guards.count_lost(job, loading)
            self.jobs.report(JobResult(job.job_id, not job.keys, frozenset(), 0, 0.0))
            return
        state = JobState(job, loading)
        pending = list(zip(job.keys, job.slots, strict=True))
        if not loading:
            pending = self._unheld(state, pending)
        batches = self._split(pending)
        self.jobs.open(state, len(batches))
        if guards is not None:  # before any batch starts: its reads are bounded by the deadline
            guards.bound_job(state)
        priority = self._load_priority(job.keys) if loading else Priority.STORE
        for batch in batches:
            self.workers.submit(priority, functools.partial(self._run_batch, state, batch))

    def _load_priority(self, keys: Sequence[ChunkKey]) -> Priority:
        """The queue a load of ``keys`` waits in. Default: :attr:`Priority.LOAD`."""
        return Priority.LOAD

    def _unheld(self, state: JobState, pending: SlotPairs) -> SlotPairs:
        """A store's chunks the store does not hold; those it holds succeeded."""
        unheld = []
        for key, slot in pending:
            if self.store.known(key):
                state.succeeded.add(key)  # nothing to write
            else:
                unheld.append((key, slot))
        return unheld

    def _split(self, pending: SlotPairs) -> list[SlotPairs]:
        """A job's (key, slot) pairs in batches."""
        return self.store.batches(pending, max(1, self.workers.count - self.workers.backlog()))

    def _run_batch(self, state: JobState, batch: SlotPairs) -> None:
        keys = [key for key, _ in batch]
        ok = [False] * len(keys)
        if not state.reported:  # else answered already: nothing left to do
            slots = [slot for _, slot in batch]
            try:
                if self.coded is None:
                    ok = self.move(state, keys, [self.slot(slot) for slot in slots])
                else:
                    ok = self.coded.move(state, keys, slots)
            except ReadCut:
                if self.guards is not None:  # the read's clock may run ahead of the timer's
                    self.guards.answer_late(state.job.job_id)
            except BaseException as exc:  # else its job would keep its slots for ever
                self._call_failed("batch", len(keys), exc)
        self.jobs.batch_done(state, keys, ok)

    def _call_failed(self, what: str, items: int, exc: BaseException) -> None:
        """A store call raised: with guards, a failed backend call; else logged."""
        if self.guards is not None:
            self.guards.outcome(items, items, exc)
        else:
            logger.warning("tier %s: %s failed: %r", self.tier_type, what, exc)

    def move(self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]) -> list[bool]:
        """Move one batch through the store; whether each key made it."""
        errors = self.store.move_many(state, keys, payloads)
        return [e is None or self._failed(k, e) for k, e in zip(keys, errors, strict=True)]

    def _failed(self, key: ChunkKey, error: BaseException) -> bool:
        """A chunk's move failed (``False``): a corrupt chunk is discarded and
        counted, a vanished one noted, any other error fails that key alone."""
        if error is SETTLED:
            return False
        if isinstance(error, CorruptChunkError):
            self.discard_corrupt(key, error)
        elif isinstance(error, ChunkVanishedError):
            self.jobs.vanished(key)
        else:
            logger.debug("tier %s: chunk %s failed: %r", self.tier_type, key.hex()[:16], error)
        return False

    def discard_corrupt(self, key: ChunkKey, exc: CorruptChunkError) -> None:
        """Log, count and delete a chunk that failed verification."""
        logger.warning(
            "tier %s: discarding corrupt chunk %s: %s", self.tier_type, key.hex()[:16], exc
        )
        removed_here = True
        try:
            removed_here = self.store.discard(key) is not False
        except Exception:
            logger.exception("tier %s: could not discard corrupt chunk", self.tier_type)
        if removed_here:  # else the path that removed it counted it
            self.count(corrupt_chunks=1)
        self.report_removed([key])

    def _close_helpers(self) -> None:
        if self.guards is not None:
            self.guards.close()
        if self.coded is not None:
            self.coded.close()
