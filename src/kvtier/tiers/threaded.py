"""Bases for tiers whose backend calls block: they run them on worker threads.
:class:`ThreadedTier` turns plain blocking hooks into the whole non-blocking
tier contract; :class:`ThreadedBatchTier` takes one hook per batch instead.

See docs/out-of-tree-tier.md, 'Start from ThreadedTier'.
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import Field

from kvtier.codecs import CodecMismatchError
from kvtier.errors import ChunkVanishedError, CorruptChunkError
from kvtier.integrity import copy_bytes
from kvtier.keys import ChunkKey
from kvtier.tiers.base import (
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    TierOptions,
    TransferJob,
)
from kvtier.tiers.bounded import drop_oldest
from kvtier.tiers.deadlines import BoundedCalls, CallTimeout

if TYPE_CHECKING:
    from kvtier.primary import PrimaryTier

logger = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    """Queue priorities of worker tasks: cheaper and more latency-critical work first."""

    CHECK = 0
    LOAD = 1
    STORE = 2


#: How long a tier without deadlines of its own waits for its codec on one chunk.
DEFAULT_CODEC_TIMEOUT_S = 5.0


class ThreadedTierOptions(TierOptions):
    io_threads: int = Field(default=4, ge=1, le=256)
    """Worker threads doing the tier's blocking I/O."""

    codec_timeout_s: float | None = Field(default=None, gt=0, le=3600)
    """Longest wait for the tier's codec to encode or decode one chunk: a
    chunk it takes longer on fails (a miss, counted), and while that call
    is still running every other chunk fails at once instead of waiting
    again. Unset: kvtier's own codecs, which always return, are called
    directly; any other is waited for the tier's ``deadline_s`` where it
    has one, else 5 s. Set, it bounds every codec."""


@dataclass
class JobState:
    """A job in flight: what its batches did so far, and whether it was answered."""

    job: TransferJob
    loading: bool
    remaining: int
    started: float
    succeeded: set[ChunkKey] = field(default_factory=set)
    nbytes: int = 0
    #: Set once the job's result is out (all batches ended, or a tier with
    #: deadlines answered early): its slots are no longer the tier's to touch.
    reported: bool = False
    #: Held while a worker touches the job's slots, so that a tier answering
    #: early first waits for any copy in progress to end.
    slots_guard: threading.Lock = field(default_factory=threading.Lock)


ThreadedOptionsT = TypeVar("ThreadedOptionsT", bound=ThreadedTierOptions)
T = TypeVar("T")


class ThreadedBatchTier(SecondaryTier[ThreadedOptionsT]):
    """Implements the tier contract on a priority queue of worker threads;
    subclasses move each batch of a job in :meth:`_transfer`."""

    Options: ClassVar[type[TierOptions]] = ThreadedTierOptions
    #: Keys handed to one ``_transfer`` call.
    io_batch: ClassVar[int] = 1
    #: Keys handed to one ``_contains`` call.
    check_batch: ClassVar[int] = 256
    #: Answers kept for lookups that never came back (an aborted request).
    max_unclaimed_answers: ClassVar[int] = 65536
    #: Existence checks of one key that may fail (backend error: "unknown")
    #: before its lookup answers MISS instead of checking again.
    check_attempts: ClassVar[int] = 3
    takes_codecs: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend = cls.__dict__.get("backend_class")
        if backend is not None:  # a runtime over a backend takes what it declares
            cls.Options = backend.Options
            cls.io_batch = backend.io_batch
            cls.check_batch = backend.check_batch
            cls.variable_payloads = backend.variable_payloads

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Every name here is ``_threaded_*``: subclasses keep the obvious ones
        # (``_lock``, ``_closed``, ``_jobs``...) for their own state.
        self._threaded_lock = threading.Lock()
        self._threaded_idle = threading.Condition(self._threaded_lock)
        # Tasks wait in one deque per priority; a worker takes one token per
        # task from a SimpleQueue (C, no Python-level Condition per wait),
        # then the first task of the most urgent non-empty deque. A task is
        # appended before its token is put, so a worker holding a token
        # finds one, except for the extra tokens shutdown puts to stop them.
        self._threaded_tasks: tuple[collections.deque[Callable[[], None]], ...] = tuple(
            collections.deque() for _ in Priority
        )
        self._threaded_tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._threaded_jobs: dict[int, JobState] = {}
        self._threaded_finished: list[JobResult] = []
        # Keys loads found gone, until their job reports them (see _vanished).
        self._threaded_vanished: set[ChunkKey] = set()
        self._threaded_to_check: list[ChunkKey] = []
        self._threaded_checking: set[ChunkKey] = set()
        self._threaded_checked: dict[ChunkKey, bool] = {}
        #: Keys whose check is still running past its deadline: every lookup
        #: of one answers MISS (not once: many requests may wait on one
        #: check) until the late answer comes (see :meth:`_overdue`).
        self._threaded_overdue: set[ChunkKey] = set()
        self._threaded_failed_checks: dict[ChunkKey, int] = {}
        self._threaded_closed = False
        #: How long :meth:`shutdown` waits for workers still in a backend call
        #: (``None``: for ever). Tiers that answer jobs at a deadline bound it.
        self._threaded_join_timeout_s: float | None = None
        #: Started when the manager attaches the tier (or on the first task),
        #: never in ``__init__``: a subclass's ``__init__`` finishes its set-up
        #: before any worker can call a hook, and a constructor that raises
        #: leaves no thread behind.
        self._threaded_workers: list[threading.Thread] = []
        #: Called when a lookup's answer may have changed (see :meth:`set_progress_listener`).
        self._threaded_progress: Callable[[], None] | None = None
        #: The codec's calls, each waited for at most the codec timeout.
        self._codec_calls: BoundedCalls | None = None
        stage = self.codec_stage
        # A helper thread and a copy per chunk cost loads up to a third of
        # their speed (measured, docs/codecs.md): only where a codec may hang.
        if not stage.identity and (
            self.options.codec_timeout_s is not None
            or not type(stage.codec).declares_prompt_return()
        ):
            self._codec_calls = BoundedCalls(
                f"kvtier-{self.tier_type}-codec", self._codec_timeout_s()
            )

    def _codec_timeout_s(self) -> float:
        """How long one chunk's encode or decode may take (``codec_timeout_s``)."""
        return self.options.codec_timeout_s or DEFAULT_CODEC_TIMEOUT_S

    @property
    def io_threads(self) -> int:
        """How many worker threads the tier runs (started on its first task)."""
        return self.options.io_threads

    @property
    def shut_down(self) -> bool:
        """Whether :meth:`shutdown` began: no new work is taken."""
        return self._threaded_closed

    def _report(self, result: JobResult) -> None:
        """Hand out a job's result that a subclass settled without the workers."""
        with self._threaded_lock:
            self._threaded_finished.append(result)
            self._progressed()  # before a collector can see the result, as for the workers' jobs

    def _progressed(self) -> None:
        """Tell the listener a lookup's answer may have changed. Called with
        no lock of the tier's held or with :attr:`_threaded_lock` only (the
        listener takes none of the tier's locks)."""
        listener = self._threaded_progress
        if listener is not None:
            try:
                listener()
            except Exception:  # a waiter then finds out by its own bounded poll
                logger.exception("tier %s: progress listener raised", self.tier_type)

    # Backend hooks: blocking, called on worker threads -------------------

    @abstractmethod
    def _contains(self, keys: Sequence[ChunkKey]) -> Sequence[bool | None]:
        """Whether the backend holds each key; ``None`` where it could not say.

        An unknown key is checked again at its next lookup (up to
        :attr:`check_attempts` times), never taken as absent.
        """

    def _discard(self, key: ChunkKey) -> bool | None:
        """Delete a chunk found corrupt. ``False`` when it was gone already,
        removed (and counted) by another path of the tier; ``None`` or
        ``True``: counted here. Default: nothing to delete."""
        return None

    def discard(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            try:
                self._discard(key)
            except Exception as exc:  # best effort: what stays ages out
                logger.debug("tier %s: cannot discard %s: %s", self.tier_type, key.hex(), exc)

    def _known(self, key: ChunkKey) -> bool | None:
        """Answer a lookup without I/O when a local index can, else ``None``."""
        return None

    def _close(self) -> None:
        """Release connections and files after the workers stopped."""

    # The contract ---------------------------------------------------------

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        known = self._known(key)
        if known is not None:
            return Lookup.HIT if known else Lookup.MISS
        with self._threaded_lock:
            # Results are consumed once: a shared backend may change under us.
            found = self._threaded_checked.pop(key, None)
            if found is not None:
                return Lookup.HIT if found else Lookup.MISS
            if key in self._threaded_overdue:
                return Lookup.MISS
            if self._threaded_failed_checks.get(key, 0) >= self.check_attempts:
                del self._threaded_failed_checks[key]
                return Lookup.MISS  # the backend keeps failing for this key
            if key not in self._threaded_checking:
                self._threaded_checking.add(key)
                self._threaded_to_check.append(key)
        return Lookup.PENDING

    def set_progress_listener(self, listener: Callable[[], None]) -> bool:
        self._threaded_progress = listener
        return True

    def on_attach(self, primary: PrimaryTier) -> None:
        # Started now, not by the first request's promotion: starting dozens
        # of threads would otherwise sit on that request's time to first token.
        with self._threaded_lock:
            if not self._threaded_closed and not self._threaded_workers:
                self._threaded_start_workers()

    def on_step_end(self) -> None:
        with self._threaded_lock:
            batch, self._threaded_to_check = self._threaded_to_check, []
        if not batch:
            return
        # Spread over the idle workers (check_batch keys at most each): a
        # prefix's checks then answer in parallel, and its first keys first.
        idle = max(1, self.io_threads - self._backlog())
        size = min(self.check_batch, max(1, -(-len(batch) // idle)))
        for start in range(0, len(batch), size):
            self._threaded_enqueue(Priority.CHECK, self._run_check(batch[start : start + size]))

    def submit_store(self, job: TransferJob) -> None:
        self._submit(job, loading=False)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job, loading=True)

    def get_finished_jobs(self) -> list[JobResult]:
        with self._threaded_lock:
            finished, self._threaded_finished = self._threaded_finished, []
        return finished

    def drain(self, timeout: float | None = None) -> None:
        with self._threaded_idle:
            self._threaded_idle.wait_for(lambda: not self._threaded_jobs, timeout=timeout)

    def shutdown(self) -> None:
        if self._threaded_closed:
            return
        self.drain()
        with self._threaded_lock:
            self._threaded_closed = True
            workers = list(self._threaded_workers)
        for _ in workers:
            self._threaded_tokens.put(None)  # a token with no task stops a worker
        give_up = (
            None
            if self._threaded_join_timeout_s is None
            else time.monotonic() + self._threaded_join_timeout_s
        )
        for worker in workers:
            # A worker stuck in a backend call past the bound is left behind
            # (a daemon thread): every job it held was answered already.
            worker.join(None if give_up is None else max(0.0, give_up - time.monotonic()))
        if self._codec_calls is not None:
            self._codec_calls.close()
        self._close()

    # Machinery --------------------------------------------------------------

    def _threaded_enqueue(self, priority: Priority, task: Callable[[], None]) -> None:
        with self._threaded_lock:
            if self._threaded_closed:
                raise RuntimeError(f"tier {self.tier_type!r} is shut down")
            if not self._threaded_workers:
                self._threaded_start_workers()
        self._threaded_tasks[priority].append(task)
        self._threaded_tokens.put(None)

    def _threaded_take(self) -> Callable[[], None] | None:
        """The most urgent queued task; ``None`` when there is none (to stop)."""
        for tasks in self._threaded_tasks:
            try:
                return tasks.popleft()
            except IndexError:
                continue
        return None

    def _threaded_start_workers(self) -> None:
        """Start the workers; the caller holds the lock."""
        self._threaded_workers = [
            threading.Thread(
                target=self._threaded_work,
                name=f"kvtier-{self.tier_type}-{i}",
                daemon=True,
            )
            for i in range(self.io_threads)
        ]
        for worker in self._threaded_workers:
            worker.start()

    def _threaded_work(self) -> None:
        while True:
            self._threaded_tokens.get()
            task = self._threaded_take()
            if task is None:
                return
            try:
                task()
            except BaseException:  # a worker must survive any backend surprise
                logger.exception("tier %s: unexpected error in worker", self.tier_type)

    def _vanished(self, key: ChunkKey) -> None:
        """Note that a load found ``key`` gone: its job reports it as a miss."""
        with self._threaded_lock:
            self._threaded_vanished.add(key)

    def _discard_corrupt(self, key: ChunkKey, exc: CorruptChunkError) -> None:
        """Log, count and delete a chunk that failed verification."""
        logger.warning(
            "tier %s: discarding corrupt chunk %s: %s", self.tier_type, key.hex()[:16], exc
        )
        removed_here = True
        try:
            removed_here = self._discard(key) is not False
        except Exception:
            logger.exception("tier %s: could not discard corrupt chunk", self.tier_type)
        if removed_here:  # else the path that removed it counted it
            self.count(corrupt_chunks=1)
        self.report_removed([key])

    def _run_check(self, keys: list[ChunkKey]) -> Callable[[], None]:
        def check() -> None:
            found: Sequence[bool | None]
            try:
                found = list(self._contains(keys))
                if len(found) != len(keys):
                    raise ValueError(f"{len(found)} answers for {len(keys)} keys")
            except BaseException as exc:  # even a BaseException: else the keys stay "checking"
                logger.warning("tier %s: existence check failed: %r", self.tier_type, exc)
                found = [None] * len(keys)
            with self._threaded_lock:
                for key, present in zip(keys, found, strict=True):
                    self._threaded_checking.discard(key)
                    self._threaded_overdue.discard(key)
                    if present is None:  # unknown: the next lookup asks again
                        self._threaded_failed_checks[key] = (
                            self._threaded_failed_checks.get(key, 0) + 1
                        )
                        self._threaded_checked.pop(key, None)
                    else:
                        self._threaded_failed_checks.pop(key, None)
                        self._threaded_checked[key] = present
                # Oldest answers first: nobody came back for them.
                drop_oldest(self._threaded_checked, self.max_unclaimed_answers)
                drop_oldest(self._threaded_failed_checks, self.max_unclaimed_answers)
            self._progressed()

        return check

    def _overdue(self, keys: Sequence[ChunkKey]) -> None:
        """The check of ``keys`` is past its deadline: their lookups answer
        MISS from now on, for every request, until the check ends."""
        with self._threaded_lock:
            self._threaded_overdue.update(key for key in keys if key in self._threaded_checking)
        self._progressed()

    def _submit(self, job: TransferJob, *, loading: bool) -> None:
        state = JobState(job, loading, remaining=0, started=time.perf_counter())
        pending: list[tuple[ChunkKey, int]] = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if not loading and self._known(key):
                state.succeeded.add(key)  # already held: nothing to write
            else:
                pending.append((key, slot))
        batches = self._split(pending)
        with self._threaded_lock:
            state.remaining = len(batches)
            self._threaded_jobs[job.job_id] = state
            if not batches:
                self._threaded_finish(state)
                return
        for batch in batches:
            self._threaded_enqueue(
                Priority.LOAD if loading else Priority.STORE, self._threaded_run_batch(state, batch)
            )

    def _backlog(self) -> int:
        """Tasks queued that no worker has taken yet."""
        return sum(map(len, self._threaded_tasks))

    def _split(self, pending: list[tuple[ChunkKey, int]]) -> list[list[tuple[ChunkKey, int]]]:
        """A job's (key, slot) pairs in batches of :attr:`io_batch`."""
        size = self.io_batch
        return [pending[i : i + size] for i in range(0, len(pending), size)]

    @abstractmethod
    def _transfer(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> list[bool]:
        """Move one batch of ``state``'s job (a load when ``state.loading``)
        between ``keys`` and their ``payloads``; whether each key made it.

        A payload is the key's primary slot, or, under a codec, a buffer of
        the worker holding the encoded chunk (a store) or taking it (a load:
        :attr:`stored_bytes` long; a tier of :attr:`variable_payloads` fills
        its start). Tiers that answer jobs before their batches end (at a
        deadline) touch payloads only under ``state.slots_guard`` and only
        while ``state.reported`` is false.
        """

    def _move(self, state: JobState, keys: list[ChunkKey], slots: list[int]) -> list[bool]:
        """:meth:`_transfer` one batch, through the codec unless it is ``none``."""
        if self.codec_stage.identity:
            return self._transfer(state, keys, [self.slot(slot) for slot in slots])
        return self._move_coded(state, keys, slots)

    def _move_coded(self, state: JobState, keys: list[ChunkKey], slots: list[int]) -> list[bool]:
        """:meth:`_move` one batch through the codec's buffers."""
        buffers = self.codec_stage.scratch(len(keys))
        if state.loading:
            ok = self._transfer(state, keys, buffers)
            return self._decode(state, keys, slots, buffers, ok)
        return self._encode_and_store(state, keys, slots, buffers)

    def _encode_and_store(
        self, state: JobState, keys: list[ChunkKey], slots: list[int], buffers: list[memoryview]
    ) -> list[bool]:
        """Encode one batch's slots into ``buffers``, then :meth:`_transfer` what encoded."""
        stage = self.codec_stage
        payloads: list[memoryview] = []
        encoded: list[int] = []
        raw_bytes = 0
        with state.slots_guard:
            if state.reported:
                return [False] * len(keys)
            for index, (slot, buffer) in enumerate(zip(slots, buffers, strict=True)):
                try:
                    encode = functools.partial(stage.encode, self.slot(slot), buffer)
                    length = self._codec_call(encode)
                except CallTimeout as exc:  # the rest would fail at once: stop here
                    self._codec_overdue(exc)
                    break
                except Exception as exc:  # the codec's failure costs this chunk only
                    self.count(codec_failures=1)
                    logger.warning(
                        "tier %s: codec %s failed to encode: %r", self.tier_type, stage.name, exc
                    )
                    continue
                payloads.append(buffer[:length])
                encoded.append(index)
                raw_bytes += self.slot_bytes
        self.count(codec_bytes_in=raw_bytes, codec_bytes_out=sum(map(len, payloads)))
        ok = [False] * len(keys)
        if encoded:
            sent = self._transfer(state, [keys[i] for i in encoded], payloads)
            for index, good in zip(encoded, sent, strict=True):
                ok[index] = good
        return ok

    def _codec_call(self, call: Callable[[], T]) -> T:
        """``call()`` (the codec's), waited for at most the codec timeout."""
        calls = self._codec_calls
        return call() if calls is None else calls(call)

    def _codec_overdue(self, exc: CallTimeout) -> None:
        """The codec missed its bound: this thread's buffers are left to it."""
        self.codec_stage.abandon_buffers()
        self.count(codec_failures=1, codec_timeouts=1)
        logger.warning("tier %s: codec %s: %s", self.tier_type, self.codec_stage.name, exc)

    def _decode(
        self,
        state: JobState,
        keys: list[ChunkKey],
        slots: list[int],
        buffers: list[memoryview],
        loaded: Sequence[bool],
    ) -> list[bool]:
        """Decode the chunks loaded into ``buffers`` into their slots."""
        ok = [False] * len(keys)
        refused: list[tuple[ChunkKey, CorruptChunkError]] = []
        with state.slots_guard:
            if state.reported:  # answered at its deadline: the slots may be another's now
                return ok
            stage = self.codec_stage
            bounded = self._codec_calls is not None
            for index, (key, slot, buffer) in enumerate(zip(keys, slots, buffers, strict=True)):
                if not loaded[index]:
                    continue
                # A bounded decode writes into a buffer of this worker's, so
                # that one past its bound never writes into a slot.
                decoded = stage.decoded() if bounded else self.slot(slot)
                try:
                    self._codec_call(functools.partial(stage.decode, buffer, decoded))
                except CallTimeout as exc:  # not damage: the chunk stays stored
                    self._codec_overdue(exc)
                    break
                except CorruptChunkError as exc:
                    refused.append((key, exc))
                    continue
                if bounded:
                    copy_bytes(self.slot(slot), decoded)
                ok[index] = True
        for key, error in refused:  # deletes are backend calls: outside the guard
            if isinstance(error, CodecMismatchError):
                self.count(codec_refused=1)
            else:
                self.count(codec_failures=1)
            self._discard_corrupt(key, error)
        return ok

    def _threaded_run_batch(
        self, state: JobState, batch: list[tuple[ChunkKey, int]]
    ) -> Callable[[], None]:
        def run() -> None:
            keys = [key for key, _ in batch]
            ok = [False] * len(keys)
            if not state.reported:  # else answered already: nothing left to do
                try:
                    ok = list(self._move(state, keys, [slot for _, slot in batch]))
                    if len(ok) != len(keys):
                        raise ValueError(f"{len(ok)} answers for a batch of {len(keys)} chunks")
                # Even a BaseException (a CancelledError, a SystemExit) fails
                # the batch alone: a job left unreported would keep its slots
                # in the writing state and make drain() wait for ever.
                except BaseException as exc:
                    logger.warning("tier %s: batch failed: %r", self.tier_type, exc)
                    ok = [False] * len(keys)
            with self._threaded_lock:
                state.remaining -= 1
                if state.reported:
                    return
                for key, good in zip(keys, ok, strict=True):
                    if good:
                        state.succeeded.add(key)
                        state.nbytes += self.slot_bytes
                if state.remaining == 0:
                    self._threaded_finish(state)

        return run

    def _threaded_finish(self, state: JobState) -> None:
        """Report a job as it stands; the caller holds the lock."""
        state.reported = True
        del self._threaded_jobs[state.job.job_id]
        # Nearly always empty: no scan of the job's keys.
        vanished = self._threaded_take_vanished(state) if self._threaded_vanished else frozenset()
        self._threaded_finished.append(
            JobResult(
                job_id=state.job.job_id,
                success=len(state.succeeded) == len(state.job.keys),
                succeeded=frozenset(state.succeeded),
                nbytes=state.nbytes,
                seconds=time.perf_counter() - state.started,
                vanished=vanished,
            )
        )
        if not self._threaded_jobs:  # what drain() waits for: no wake-up per job
            self._threaded_idle.notify_all()
        self._progressed()

    def _settled(self, key: ChunkKey, error: BaseException | None) -> bool:
        """Whether one chunk's move succeeded, given its error: a corrupt chunk
        is discarded and counted, a vanished one noted, any other error
        fails that key alone."""
        if error is None:
            return True
        if isinstance(error, CorruptChunkError):
            self._discard_corrupt(key, error)
        elif isinstance(error, ChunkVanishedError):
            self._vanished(key)
        else:
            logger.debug("tier %s: chunk %s failed: %r", self.tier_type, key.hex()[:16], error)
        return False

    def _threaded_take_vanished(self, state: JobState) -> frozenset[ChunkKey]:
        """The keys of ``state``'s job that loads found gone; the caller holds the lock."""
        vanished = frozenset(
            key
            for key in state.job.keys
            if key in self._threaded_vanished and key not in state.succeeded
        )
        self._threaded_vanished.difference_update(vanished)
        return vanished


class ThreadedTier(ThreadedBatchTier[ThreadedOptionsT]):
    """Implements the tier contract on worker threads over per-chunk hooks:
    subclasses write ``_contains``, ``_store_chunk`` and ``_load_chunk``."""

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
        if state.loading:
            return self._load_batch(keys, payloads)
        return self._store_batch(keys, payloads)

    def _attempt(
        self, operation: Callable[[ChunkKey, memoryview], None], key: ChunkKey, view: memoryview
    ) -> bool:
        """Run one chunk's hook; what its error means: :meth:`_settled`."""
        try:
            operation(key, view)
        except Exception as exc:
            return self._settled(key, exc)
        return True
