"""The jobs a tier has in flight: what their batches did, the keys loads
found gone, and the results waiting for the manager to collect them."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey
from kvtier.tiers.base import JobResult, TransferJob


@dataclass
class JobState:
    """A job in flight: what its batches did so far, and whether it was answered."""

    job: TransferJob
    loading: bool
    started: float = field(default_factory=time.perf_counter)
    remaining: int = 0
    succeeded: set[ChunkKey] = field(default_factory=set)
    nbytes: int = 0
    #: When the job is answered however far it got, on ``time.monotonic``
    #: (``Guards.bound_job``): a worker reading into its slots gives up then.
    deadline: float = math.inf
    #: When the job's request began to wait on this tier (``perf_counter``;
    #: ``None``: when the job started): what a missed deadline is measured from.
    waiting_since: float | None = None
    #: Set once the job's result is out (all batches ended, or answered at its
    #: deadline): its slots are no longer the tier's to touch.
    reported: bool = False
    #: Workers touching the job's slots now (see :meth:`Jobs.touching_slots`).
    touching: int = 0
    #: Answered at its deadline while workers touched its slots: the last of
    #: them to leave reports it.
    answer_due: bool = False


class Jobs:
    """Thread-safe bookkeeping of a tier's jobs; ``on_progress`` is called
    (under this object's lock) whenever a result comes out."""

    def __init__(self, chunk_bytes: int, on_progress: Callable[[], None]) -> None:
        self.chunk_bytes = chunk_bytes
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running: dict[int, JobState] = {}
        self._finished: list[JobResult] = []
        # Keys loads found gone, until their job reports them as misses.
        self._vanished: set[ChunkKey] = set()

    def open(self, state: JobState, batches: int) -> None:
        """Track ``state`` until its ``batches`` end (reported now if none)."""
        with self._lock:
            state.remaining = batches
            self._running[state.job.job_id] = state
            if not batches:
                self._finish(state)

    def batch_done(self, state: JobState, keys: Sequence[ChunkKey], ok: Sequence[bool]) -> None:
        with self._lock:
            state.remaining -= 1
            if state.reported:
                return
            moved = [key for key, good in zip(keys, ok, strict=True) if good]
            state.succeeded.update(moved)
            state.nbytes += len(moved) * self.chunk_bytes
            if state.remaining == 0:
                self._finish(state)

    def answer_early(self, job_id: int) -> JobState | None:
        """Report a job still running with what it has; ``None`` when it was
        reported already. Workers touching its slots delay the report until
        the last of them leaves, and none starts after this."""
        with self._lock:
            state = self._running.get(job_id)
            if state is None or state.reported or state.answer_due:
                return None
            if state.touching:
                state.answer_due = True
            else:
                self._finish(state)
        return state

    @contextmanager
    def touching_slots(self, state: JobState) -> Iterator[bool]:
        """Whether a worker may touch ``state``'s slots: false once the job was
        answered, for they may be another chunk's now. While a worker is
        inside, the job's report waits for it: the worker must leave by the
        job's :attr:`~JobState.deadline` (a copy; a read bounded by it)."""
        with self._lock:
            allowed = not (state.reported or state.answer_due)
            state.touching += allowed
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    state.touching -= 1
                    if state.answer_due and not state.touching and not state.reported:
                        self._finish(state)

    def report(self, result: JobResult) -> None:
        """Hand out the result of a job settled without the workers."""
        with self._lock:
            self._finished.append(result)
            self._on_progress()

    def vanished(self, key: ChunkKey) -> None:
        """A load found ``key`` gone: its job reports it as a miss."""
        with self._lock:
            self._vanished.add(key)

    def take_finished(self) -> list[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._running)

    def drain(self, timeout: float | None = None) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._running, timeout=timeout)

    def _finish(self, state: JobState) -> None:
        """Report a job as it stands; the caller holds the lock."""
        state.reported = True
        job = state.job
        del self._running[job.job_id]
        # Nearly always empty: no scan of the job's keys.
        vanished = self._take_vanished(state) if self._vanished else frozenset()
        succeeded = frozenset(state.succeeded)
        seconds = time.perf_counter() - state.started
        success = len(succeeded) == len(job.keys)
        self._finished.append(
            JobResult(job.job_id, success, succeeded, state.nbytes, seconds, vanished)
        )
        if not self._running:  # what drain() waits for: no wake-up per job
            self._idle.notify_all()
        self._on_progress()

    def _take_vanished(self, state: JobState) -> frozenset[ChunkKey]:
        """The keys of ``state``'s job that loads found gone; the caller holds the lock."""
        gone = self._vanished
        vanished = frozenset(k for k in state.job.keys if k in gone and k not in state.succeeded)
        gone.difference_update(vanished)
        return vanished
