"""The jobs the manager hands its secondary tiers, from submission to applied result.

What a tier's lookups and jobs add to its counters, and which loads failed
for a request, are kept here for every driver of a tier: the manager, and
vLLM's native tiering adapter that drives one kvtier tier on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.backpressure import Backpressure
from kvtier.keys import ChunkKey
from kvtier.primary import PrimaryTier
from kvtier.progress import Progress
from kvtier.residency import ResidencyFeed
from kvtier.tiers.base import JobResult, Lookup, SecondaryTier, TransferJob

__all__ = [
    "JobBook",
    "JobListener",
    "JobOutcome",
    "JobRecord",
    "RequestMisses",
    "count_lookup",
    "count_lookups",
    "count_refused",
]

logger = logging.getLogger(__name__)

#: Called with ``(tier_index, loading, result)`` for every finished job (see
#: :attr:`JobBook.listeners`).
JobListener = Callable[[int, bool, JobResult], None]


@dataclass
class JobRecord:
    """A job the manager handed a tier, kept until its result is applied."""

    job_id: int
    tier_index: int
    loading: bool
    keys: tuple[ChunkKey, ...]
    request_id: str | None
    #: Whether the job's slots were handed back (a load's slots completed, a
    #: store's unpinned): exactly once, whatever else goes wrong.
    released: bool = False
    #: A job the residency feed follows (see :meth:`ResidencyFeed.job_started`).
    followed: bool = False


#: What one lookup adds to its tier's counters, by answer (made once: a
#: lookup's count builds no dict).
_LOOKUP_COUNTS: dict[Lookup | None, dict[str, int]] = {
    Lookup.HIT: {"lookups": 1, "hits": 1},
    Lookup.MISS: {"lookups": 1, "misses": 1},
    Lookup.PENDING: {"lookups": 1, "pending": 1},
    None: {"lookups": 1, "misses": 1, "load_failures": 1},
}


def count_lookup(tier: SecondaryTier, answer: Lookup | None) -> None:
    """Count a lookup of ``tier`` by its answer; ``None``: the lookup raised,
    a miss and a failed load."""
    tier.count(**_LOOKUP_COUNTS[answer])


def count_lookups(tier: SecondaryTier, answers: Sequence[Lookup]) -> None:
    """:func:`count_lookup` of each of ``answers``, in one call of the tier's counters."""
    tier.count(
        lookups=len(answers),
        hits=answers.count(Lookup.HIT),
        misses=answers.count(Lookup.MISS),
        pending=answers.count(Lookup.PENDING),
    )


def count_refused(tier: SecondaryTier, num_keys: int, *, loading: bool) -> None:
    """Count a job of ``num_keys`` chunks that failed as a whole (the tier
    refused it, or its result could not be applied)."""
    tier.count(**{"load_failures" if loading else "store_failures": num_keys})


_K = TypeVar("_K", bound=Hashable)


class RequestMisses(Generic[_K]):
    """Per request, chunks that are misses for the rest of it (say, those whose
    load failed, so that it never retries a bad chunk); forgotten when it
    ends. Anonymous lookups (no request id) ask again."""

    __slots__ = ("_by_request",)

    def __init__(self) -> None:
        self._by_request: dict[str, set[_K]] = {}

    def remember(self, request_id: str | None, keys: Collection[_K]) -> None:
        if request_id is not None and keys:
            self._by_request.setdefault(request_id, set()).update(keys)

    def of(self, request_id: str | None) -> Collection[_K]:
        """The chunks that are misses for ``request_id`` (read by every lookup)."""
        return self._by_request.get(request_id, ()) if request_id is not None else ()

    def forget(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def clear(self) -> None:
        self._by_request.clear()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def __bool__(self) -> bool:
        """Whether any request has a miss remembered."""
        return bool(self._by_request)


@dataclass(frozen=True)
class JobOutcome:
    """A tier's :class:`JobResult`, checked against its job's keys."""

    good: list[ChunkKey]
    bad: list[ChunkKey]
    nbytes: int
    seconds: float
    #: Of ``bad``: keys the tier no longer held (misses, not failures).
    gone: list[ChunkKey]

    @classmethod
    def of(cls, keys: Iterable[ChunkKey], result: JobResult) -> JobOutcome:
        """Raises ``TypeError`` or ``ValueError`` on a malformed result."""
        keys = tuple(keys)
        succeeded = frozenset(result.succeeded)
        bad = [key for key in keys if key not in succeeded]
        vanished = frozenset(result.vanished)
        return cls(
            good=[key for key in keys if key in succeeded],
            bad=bad,
            nbytes=int(result.nbytes),
            seconds=float(result.seconds),
            gone=[key for key in bad if key in vanished] if vanished else [],
        )

    def count_on(self, tier: SecondaryTier, *, loading: bool) -> None:
        """Add the job's chunks, bytes and failures to ``tier``'s counters. A
        chunk gone since its lookup (evicted, say by another process) is a
        miss the request recomputes: nothing failed."""
        if loading:
            tier.count(
                chunks_loaded=len(self.good),
                bytes_loaded=self.nbytes,
                load_failures=len(self.bad) - len(self.gone),
            )
        else:
            tier.count(
                chunks_stored=len(self.good),
                bytes_stored=self.nbytes,
                store_failures=len(self.bad),
            )


class JobBook:
    """Hands jobs to the tiers, applies their results and gives their slots
    back. Not locked itself: the manager calls it under its lock."""

    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier],
        backpressure: Sequence[Backpressure],
        residency: ResidencyFeed,
        progress: Progress,
    ) -> None:
        self.primary = primary
        self.tiers = tiers
        self.backpressure = backpressure
        self.residency = residency
        self.progress = progress
        #: Jobs handed to a tier whose results are not applied yet, by (tier index, job id).
        self.running: dict[tuple[int, int], JobRecord] = {}
        #: Promotions that failed, per request, by (tier index, key).
        self.failed: RequestMisses[tuple[int, ChunkKey]] = RequestMisses()
        # Tiers whose get_finished_jobs raised at the last collect (logged once).
        self._collect_failing: set[int] = set()
        #: Results a tier reported that could not be applied (each failed its job).
        self.unapplied_results = 0
        #: Observers of finished jobs (metrics, engine statistics). Called under
        #: the manager's lock once a result is applied; an observer that raises
        #: is logged and never disturbs the manager.
        self.listeners: list[JobListener] = []

    def fail_unreported(self) -> None:
        """After a drain: a drained tier no longer touches the slots; if it still
        cannot report its jobs it is broken, and they count as failed so the
        slots come back."""
        for (index, job_id), job in list(self.running.items()):
            tier = self.tiers[index]
            logger.error("tier %s: job %d unreported after drain; failed", tier.tier_type, job_id)
            del self.running[(index, job_id)]
            self._finish(job, JobResult(job_id, False, frozenset(), 0, 0.0))

    def _admit(self, tier_indexes: range, num_keys: int) -> list[int]:
        """The tiers among ``tier_indexes`` whose backpressure takes a store job now."""
        admitted = []
        for index in tier_indexes:
            if self.backpressure[index].admit():
                admitted.append(index)
            else:
                self.tiers[index].count(backpressure_drops=num_keys)
        return admitted

    def cascade(self, ready: Mapping[ChunkKey, int], tier_indexes: Sequence[int]) -> None:
        """Write-through: copy ready chunks (``{key: slot}``) out to tiers, pinned
        until each job ends.

        The chunks come pinned once per tier (:meth:`PrimaryTier.complete_store`
        pinned them as they became ready); a job that cannot start unpins its share.
        """
        if not ready or not tier_indexes:
            return
        keys, slots = tuple(ready), tuple(ready.values())
        for done, index in enumerate(tier_indexes, 1):
            self.backpressure[index].started()
            try:
                self.submit(index, TransferJob(keys, slots), loading=False)
            except BaseException:
                for _ in tier_indexes[done:]:  # the shares of the tiers not reached
                    self.primary.complete_load(keys)
                raise

    def submit(self, index: int, job: TransferJob, *, loading: bool) -> None:
        """Hand ``job`` to tier ``index``; if the tier raises, the job fails and
        its slots come back (a ``BaseException`` then goes on up)."""
        tier = self.tiers[index]
        # Recorded before the tier sees it: a fast tier may report the job
        # before submit returns, and its result must find the job.
        record = JobRecord(job.job_id, index, loading, job.keys, job.request_id)
        record.followed = self.residency.job_started(index, job.keys)
        self.running[(index, job.job_id)] = record
        try:
            (tier.submit_load if loading else tier.submit_store)(job)
        except BaseException as error:
            logger.exception("tier %s: submit raised; job %d failed", tier.tier_type, job.job_id)
            # Unless it reported the job before raising: that result stands.
            if self.running.pop((index, job.job_id), None) is not None:
                count_refused(tier, len(job.keys), loading=loading)
                self._release_failed(record)
            if not isinstance(error, Exception):
                raise

    def collect(self) -> None:
        applied = False
        for index, tier in enumerate(self.tiers):
            try:
                results = tier.get_finished_jobs()
            except Exception:
                # Once until it answers again: lookups waiting for a promotion
                # collect every poll (0.5 ms), a traceback each would flood the log.
                if index not in self._collect_failing:
                    self._collect_failing.add(index)
                    logger.exception("tier %s: get_finished_jobs raised", tier.tier_type)
                continue
            if index in self._collect_failing:
                self._collect_failing.discard(index)
                logger.warning("tier %s: get_finished_jobs answers again", tier.tier_type)
            for result in results:
                job = self.running.pop((index, result.job_id), None)
                if job is None:
                    logger.warning(
                        "tier %s: result for unknown job %d", tier.tier_type, result.job_id
                    )
                    continue
                self._finish(job, result)
                applied = True
        if applied:
            self.progress.announce()  # chunks became ready, or their promotions failed

    def _finish(self, job: JobRecord, result: JobResult) -> None:
        """Apply one finished job in isolation: a result that cannot be applied
        fails its own job (counted, logged once), and its slots come back."""
        tier = self.tiers[job.tier_index]
        try:
            self._apply(tier, job, JobOutcome.of(job.keys, result))
        except Exception:
            logger.exception(
                "tier %s: the result of job %d could not be applied; the job failed",
                tier.tier_type,
                job.job_id,
            )
            self.unapplied_results += 1
            self._job_ended(job, ())
            if job.released:
                return  # only its bookkeeping was lost
            try:
                self._release_failed(job)
            except Exception:
                logger.exception("tier %s: job %d: slots not released", tier.tier_type, job.job_id)
            count_refused(tier, len(job.keys), loading=job.loading)
            result = JobResult(job.job_id, False, frozenset(), 0, 0.0)
        for listener in self.listeners:
            try:
                listener(job.tier_index, job.loading, result)
            except Exception:
                logger.exception("job listener %r raised", listener)

    def _apply(self, tier: SecondaryTier, job: JobRecord, outcome: JobOutcome) -> None:
        if job.loading:
            # Slower tiers' hits warm the faster tiers in front of them; the
            # chunks are pinned for that as they become ready.
            targets = self._admit(range(job.tier_index), len(outcome.good)) if outcome.good else []
            loaded = self.primary.complete_store(outcome.good, pins=len(targets))
            self.primary.complete_store(outcome.bad, success=False)
            job.released = True
            self._remember_failures(job.request_id, job.tier_index, outcome.bad)
            outcome.count_on(tier, loading=True)
            self.residency.removed(job.tier_index, outcome.gone)
            self._job_ended(job, outcome.good)
            self.cascade(loaded, targets)
        else:
            self.primary.complete_load(job.keys)
            job.released = True
            pressure = self.backpressure[job.tier_index]
            pressure.finished(outcome.seconds / max(1, len(job.keys)))
            outcome.count_on(tier, loading=False)
            self._job_ended(job, outcome.good)

    def _release_failed(self, job: JobRecord) -> None:
        """Hand back the slots of a job that failed as a whole."""
        if job.loading:
            # Keys already ready stay (their bytes are whole); the rest are freed.
            self.primary.complete_store(job.keys, success=False)
            self._remember_failures(job.request_id, job.tier_index, job.keys)
        else:
            self.primary.complete_load(job.keys)
            self.backpressure[job.tier_index].cancelled()
        self._job_ended(job, ())
        job.released = True

    def _remember_failures(
        self, request_id: str | None, index: int, keys: Sequence[ChunkKey]
    ) -> None:
        if request_id is not None and keys:  # no list for anonymous jobs
            self.failed.remember(request_id, [(index, key) for key in keys])

    def _job_ended(self, job: JobRecord, held: Sequence[ChunkKey]) -> None:
        if job.followed:
            job.followed = False
            self.residency.job_ended(job.tier_index, job.keys, held)
