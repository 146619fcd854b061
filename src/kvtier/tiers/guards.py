"""The guards of a remote backend, one object the tier runtime consults where
it decides: admit a lookup or a job, bound a job or a check by its deadline,
account a batch's outcome. A circuit breaker (with probes), deadlines and
per-request budgets; see docs/shared-tiers.md, 'When the backend fails'.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.errors import CorruptChunkError, describe_error
from kvtier.keys import ChunkKey
from kvtier.tiers.backend import BackendSkipped
from kvtier.tiers.base import Lookup, LookupContext, TierMetric, TransferJob
from kvtier.tiers.budgets import RequestBudgets
from kvtier.tiers.circuit import BreakerState, CircuitBreaker
from kvtier.tiers.deadlines import Deadlines
from kvtier.tiers.jobs import Jobs, JobState
from kvtier.tiers.options import RemoteTierOptions
from kvtier.tiers.probes import Probes
from kvtier.tiers.workers import Workers

logger = logging.getLogger(__name__)


class Guards:
    """Fail fast while the backend is down, cut work short at its deadline.

    ``ping`` is the probe's backend call; ``progressed`` tells waiting
    lookups to ask again; ``workers`` stop when the tier shuts down.
    """

    def __init__(
        self,
        tier_type: str,
        options: RemoteTierOptions,
        *,
        jobs: Jobs,
        count: Callable[..., None],
        ping: Callable[[], None],
        progressed: Callable[[], None],
        workers: Workers,
    ) -> None:
        self.tier_type = tier_type
        self.deadline_s = options.deadline_s
        self._jobs = jobs
        self._count = count
        self._ping = ping
        self._progressed = progressed
        self._workers = workers
        #: When a backend call last got an answer (``time.perf_counter``).
        self._last_answer = time.perf_counter()
        self.breaker = CircuitBreaker(
            failures=options.breaker_failures,
            backoff_s=options.breaker_backoff_s,
            max_backoff_s=options.breaker_max_backoff_s,
            on_change=self._breaker_changed,
        )
        self.probes = Probes(tier_type, self.breaker, self._probe)
        #: Each request's wait on the backend: its checks and its loads share one deadline.
        self.budgets = RequestBudgets(options.deadline_s)
        self._deadlines = Deadlines(f"kvtier-{tier_type}-deadlines")

    @property
    def sending(self) -> bool:
        """Whether to send requests (backends check it between requests)."""
        return self.breaker.closed and not self._workers.stopped

    def lookup(
        self, key: ChunkKey, ctx: LookupContext, ask: Callable[[ChunkKey], Lookup]
    ) -> Lookup:
        """``ask(key)`` unless the breaker is open; the answer feeds the request's budget."""
        answer = ask(key) if self.admit() else self._lookup_while_down(1)[0]
        if ctx.request_id is not None:
            if answer is Lookup.PENDING:
                self.budgets.waiting(ctx.request_id)
            else:
                self.budgets.found(ctx.request_id, (key,))
        return answer

    def lookup_run(
        self,
        keys: Sequence[ChunkKey],
        ctx: LookupContext,
        ask: Callable[[Sequence[ChunkKey]], list[Lookup]],
    ) -> list[Lookup]:
        """:meth:`lookup` of a run of keys: the request waits once for all it waits on."""
        answers = ask(keys) if self.admit() else self._lookup_while_down(len(keys))
        request_id = ctx.request_id
        if request_id is not None:
            budgets = self.budgets
            waiting = answers.count(Lookup.PENDING)
            if waiting:
                budgets.waiting(request_id)
            if waiting < len(answers):
                pairs = zip(keys, answers, strict=False)
                budgets.found(request_id, [k for k, a in pairs if a is not Lookup.PENDING])
        return answers

    def _lookup_while_down(self, count: int) -> list[Lookup]:
        """Answers for ``count`` keys while the breaker is open, ending at the first MISS."""
        if self.breaker.state is BreakerState.HALF_OPEN:
            return [Lookup.PENDING] * count  # the probe answers within deadline_s: wait for it
        self._count(outage_skipped_lookups=1)
        return [Lookup.MISS]

    def count_lost(self, job: TransferJob, loading: bool) -> None:
        """``job`` was not admitted: its chunks are lost to the outage."""
        lost = "outage_failed_loads" if loading else "outage_dropped_stores"
        self._count(**{lost: len(job.keys)})

    def bound_job(self, state: JobState) -> None:
        """Answer the job at its deadline; a load gets what its request's checks left."""
        left, since = self.budgets.take(state.job.request_id) if state.loading else (None, None)
        seconds = self.deadline_s if left is None else left
        state.deadline = time.monotonic() + seconds  # the clock of Deadlines
        state.waiting_since = since
        self._deadlines.after(seconds, functools.partial(self._job_deadline, state))

    def _job_deadline(self, state: JobState) -> None:
        if not state.reported:  # else it ended in time: not even the jobs' lock
            self.answer_late(state.job.job_id)

    def answer_late(self, job_id: int) -> None:
        """Answer a job still running with what it has, and count its missed
        deadline; nothing if it ended. Its deadline's timer calls this, and so
        does a read that its own clock cut first (:class:`ReadCut`), and a
        shutdown: whichever comes first answers and counts the miss."""
        state = self._jobs.answer_early(job_id)
        if state is not None:
            waiting_since = state.waiting_since
            since = state.started if waiting_since is None else min(waiting_since, state.started)
            what = f"{'load' if state.loading else 'store'} job {job_id}"
            self.missed_deadline(what, since)

    def bound_check(self, keys: Sequence[ChunkKey], overdue: Callable[[], None]) -> threading.Event:
        """An event to set when the check of ``keys`` ends; ``overdue()`` unless set in time."""
        done, what = threading.Event(), f"existence check of {len(keys)} chunks"
        late = functools.partial(self._expired, done, what, time.perf_counter(), overdue)
        self._deadlines.after(self.deadline_s, late)
        return done

    def check_done(self, keys: Sequence[ChunkKey], done: threading.Event) -> None:
        done.set()
        self.budgets.checked(keys)

    def answered(self) -> None:
        """A backend call got an answer."""
        self._last_answer = time.perf_counter()

    def account(self, items: Sequence[object]) -> None:
        """One breaker verdict per batch, by its items (errors: ``BaseException``)."""
        errors = [item for item in items if isinstance(item, BaseException)]
        if errors:  # corrupt values aside: the backend answered those
            counted = [e for e in errors if not isinstance(e, CorruptChunkError)]
            self.outcome(len(counted), len(items), counted[0] if counted else None)
        elif items:
            self._last_answer = time.perf_counter()
            self.breaker.record_success()

    def outcome(self, errors: int, items: int, first: BaseException | None) -> None:
        """A batch's verdict by its counts: every item failed is a failed
        call, any answered shows the backend serving."""
        if isinstance(first, BackendSkipped):
            return  # not a call: the breaker is open already
        if errors:
            self._count(backend_errors=errors)
            logger.debug("tier %s: %d backend errors: %r", self.tier_type, errors, first)
        if items and errors == items:
            self.breaker.record_failure(describe_error(first) if first else "a call failed")
        elif items:
            self.answered()
            self.breaker.record_success()

    @property
    def threads(self) -> list[threading.Thread]:
        """Probe threads alive (any may be inside a backend call)."""
        return self.probes.threads

    def metrics(self) -> list[TierMetric]:
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
        ]

    def close(self) -> None:
        self._deadlines.close()

    def admit(self) -> bool:
        """Whether a request may go to the backend; starts the probe when due."""
        if self.breaker.closed:
            return True
        if self.probes.start_if_due():
            self._count(breaker_probes=1)
        return False

    def _probe(self) -> None:
        done = threading.Event()
        # A probe past its deadline failed, whatever else answered meanwhile:
        # the breaker must not stay half-open on a probe that hangs.
        self._watch(done, "probe", lambda: self.breaker.trip("probe missed its deadline"))
        try:
            self._ping()
        except BaseException as exc:  # whatever it is, the probe must end half-open
            self.breaker.record_failure(f"probe failed: {describe_error(exc)}")
        else:
            self.answered()
            self.breaker.record_success()
        finally:
            done.set()
            self._progressed()  # lookups answered PENDING for the probe: ask again

    def _watch(self, done: threading.Event, what: str, then: Callable[[], None]) -> None:
        """Unless ``done`` is set in time: count a missed deadline, then ``then()``."""
        expired = functools.partial(self._expired, done, what, time.perf_counter(), then)
        self._deadlines.after(self.deadline_s, expired)

    def _expired(
        self, done: threading.Event, what: str, since: float, then: Callable[[], None]
    ) -> None:
        if not done.is_set():
            self.missed_deadline(what, since)
            then()

    def missed_deadline(self, what: str, since: float) -> None:
        self._count(deadline_misses=1)
        # A backend that answered anything meanwhile is slow, not stalled:
        # the late work is cut short, but the tier stays in service.
        if self._last_answer < since:
            self.breaker.trip(f"{what} missed its {self.deadline_s}s deadline")

    def _breaker_changed(self, old: BreakerState, new: BreakerState, reason: str) -> None:
        if old is BreakerState.CLOSED:
            self._count(backend_outages=1)
        if self._workers.stopped:
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
