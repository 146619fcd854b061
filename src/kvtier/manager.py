"""The tiering manager: lookups across tiers, promotions, write-through cascades.

The engine's scheduler calls it, and :meth:`TieringManager.step` once per
engine step collects finished jobs (before any eviction decision of the
step) and submits batched promotions. Tiers do their I/O on their own
workers. A tier that raises, fails jobs or falls behind only ever costs
cache hits: its keys count as misses, its failures are counted, and the
engine recomputes.

Thread-safe: one re-entrant lock serialises the manager's bookkeeping. It is
held for that bookkeeping and for the tiers' non-blocking calls only, never
while bytes are copied: the engine copies into and out of slots between
``prepare_*`` and ``complete_*``, on its own thread, and the tiers on theirs.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Concatenate, NamedTuple, ParamSpec, Protocol, TypeVar

from kvtier.backpressure import Backpressure
from kvtier.jobs import JobOutcome, JobRecord
from kvtier.keys import ChunkKey
from kvtier.primary import PrimaryTier
from kvtier.residency import ResidencyFeed
from kvtier.settings import BackpressureConfig
from kvtier.tiers.base import (
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    TierMetric,
    TransferJob,
)

logger = logging.getLogger(__name__)


_ANSWER_COUNTER = {Lookup.HIT: "hits", Lookup.MISS: "misses", Lookup.PENDING: "pending"}

#: Called with ``(tier_index, loading, result)`` for every finished job (see
#: :attr:`TieringManager.job_listeners`).
JobListener = Callable[[int, bool, JobResult], None]


class Attachment(Protocol):
    """A service running beside the manager (the cluster index publisher):
    exported as ``kvtier_<name>_<metric>``, closed when the manager shuts down."""

    name: str

    def metrics(self) -> Sequence[TierMetric]: ...

    def close(self) -> None: ...


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _serialised(
    method: Callable[Concatenate[TieringManager, _P], _R],
) -> Callable[Concatenate[TieringManager, _P], _R]:
    """Run ``method`` under the manager's lock."""

    @functools.wraps(method)
    def locked(self: TieringManager, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class LookupResult(NamedTuple):
    """``hit_chunks`` leading chunks are ready in the primary tier now;
    ``pending`` means more may be once in-flight work ends: ask again next step."""

    # A named tuple: made once a lookup, where a frozen dataclass costs a call per field.
    hit_chunks: int
    pending: bool


class TieringManager:
    """Owns the primary tier and drives the secondary tiers behind it."""

    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier],
        backpressure: BackpressureConfig | None = None,
    ) -> None:
        self.primary = primary
        self.tiers = list(tiers)
        config = backpressure or BackpressureConfig()
        self.backpressure = [Backpressure(config) for _ in self.tiers]
        # Re-entrant: drain and reset step, a listener may read the manager.
        self._lock = threading.RLock()
        self._jobs: dict[tuple[int, int], JobRecord] = {}
        # (tier index, request id) -> [(key, slot)], submitted at step end.
        self._promotions: dict[tuple[int, str | None], list[tuple[ChunkKey, int]]] = defaultdict(
            list
        )
        # Promotions that failed, per request, so a request never retries a bad
        # chunk; forgotten when the request finishes. Anonymous lookups retry.
        self._failed: dict[str, set[tuple[int, ChunkKey]]] = defaultdict(set)
        # Requests told to ask again: their primary hits were counted at the
        # first ask, and what was promoted for them counts as the tier's hit,
        # so a request's chunks count once, however many steps it waits.
        self._asking: set[str] = set()
        self._closed = False
        # Tiers whose get_finished_jobs raised at the last collect (logged once).
        self._collect_failing: set[int] = set()
        #: Results a tier reported that could not be applied (each failed its job).
        self.unapplied_results = 0
        #: Observers of finished jobs (metrics, engine statistics). Called under
        #: the manager's lock once a result is applied; an observer that raises
        #: is logged and never disturbs the manager.
        self.job_listeners: list[JobListener] = []
        #: Services closed, in order, at :meth:`shutdown` (after the drain, before the tiers).
        self.attachments: list[Attachment] = []
        # Bumped whenever a lookup's answer may have changed, so that callers
        # waiting for promotions sleep until then instead of polling.
        self._progress = threading.Condition(threading.Lock())
        self._progress_mark = 0
        for tier in self.tiers:
            self._call(tier, "on_attach", primary)
        #: Whether every tier announces its progress (else waiters poll).
        self.announces_progress = all(self._listens(tier) for tier in self.tiers)
        #: Which tier holds which chunk, as it changes (KV events for routers):
        #: add observers to ``residency.listeners``.
        self.residency = ResidencyFeed([tier.tier_type for tier in self.tiers])
        primary.watchers.append(self.residency.primary_changed)
        for index, tier in enumerate(self.tiers):
            tier.removal_listeners.append(functools.partial(self.residency.removed, index))

    # Waiting for promotions -------------------------------------------------

    def _listens(self, tier: SecondaryTier) -> bool:
        try:
            return tier.set_progress_listener(self._progressed) is True
        except Exception:
            logger.exception("tier %s: set_progress_listener raised", tier.tier_type)
            return False

    def _progressed(self) -> None:
        with self._progress:
            self._progress_mark += 1
            self._progress.notify_all()

    @property
    def progress_mark(self) -> int:
        """Changes whenever a lookup's answer may have changed (a tier's job
        ended or a check answered, a store completed): take it before a
        lookup, then :meth:`wait_for_progress` past it."""
        return self._progress_mark

    def wait_for_progress(self, mark: int, timeout: float) -> bool:
        """Block until :attr:`progress_mark` moves past ``mark`` or ``timeout``
        seconds pass; whether it moved. Tiers that do not announce their
        progress (:attr:`announces_progress`) never move it: poll them."""
        with self._progress:
            return self._progress.wait_for(lambda: self._progress_mark != mark, timeout)

    # Scheduler side -------------------------------------------------------

    @_serialised
    def lookup(self, keys: Sequence[ChunkKey], request_id: str | None = None) -> LookupResult:
        """How many leading chunks are ready; starts promotions for the rest it finds."""
        return self._lookup(keys, request_id)

    @_serialised
    def lookup_pinned(
        self, keys: Sequence[ChunkKey], request_id: str, *, end_request: bool = False
    ) -> tuple[list[int], bool]:
        """:meth:`lookup`, then pin the leading ready chunks, in one entry: the
        slots pinned, and whether more may be ready at a later step (fewer
        pinned than found also counts: evicted in between, ask again).

        ``end_request``: the request's lookups are over unless more is pending,
        and then it ends here as by :meth:`on_request_finished`.
        """
        result = self._lookup(keys, request_id)
        slots = self.primary.pin_prefix(keys[: result.hit_chunks])
        pending = result.pending or len(slots) < result.hit_chunks
        if end_request and not pending:
            self._end_request(request_id)
        return slots, pending

    def _lookup(self, keys: Sequence[ChunkKey], request_id: str | None) -> LookupResult:
        """:meth:`lookup`, under the lock.

        Linear in ``keys``: the leading ready chunks are found and touched in
        one pass (touched first, so that the promotions' evictions meet them
        at the recent end of the policy's order), and every promotion
        protects the same set of the chain's keys, made once.
        """
        primary = self.primary
        asked_before = request_id is not None and request_id in self._asking
        hits = primary.lookup(keys, count_hits=not asked_before)
        pending = False
        chain: set[ChunkKey] | None = None
        # Past the ready prefix, only secondary tiers or writes in flight add anything.
        for index in range(hits, len(keys) if self.tiers or primary.has_writes else hits):
            key = keys[index]
            if primary.is_ready(key):
                continue
            if primary.is_writing(key):
                pending = True
                continue
            if chain is None:
                chain = set(keys)
            found = self._lookup_secondary(key, LookupContext(request_id, index), chain)
            if found is None:
                break
            pending = pending or found
        if request_id is not None:
            if pending:
                self._asking.add(request_id)
            elif asked_before:
                self._asking.discard(request_id)
        return LookupResult(hits, pending)

    def _lookup_secondary(
        self, key: ChunkKey, ctx: LookupContext, chain: set[ChunkKey]
    ) -> bool | None:
        """``True`` if a tier has or may have ``key`` (pending), ``None`` on a miss.

        A promotion never evicts another chunk of the same ``chain``.
        """
        failed = self._failed.get(ctx.request_id, ()) if ctx.request_id is not None else ()
        for index, tier in enumerate(self.tiers):
            if (index, key) in failed:
                continue
            try:
                answer = tier.lookup(key, ctx)
            except Exception:
                logger.exception("tier %s: lookup raised; counted as a miss", tier.tier_type)
                tier.count(lookups=1, misses=1, load_failures=1)
                continue
            tier.count(lookups=1, **{_ANSWER_COUNTER[answer]: 1})
            if answer is Lookup.PENDING:
                return True
            if answer is Lookup.HIT:
                reserved = self._reserve([key], protect=chain)
                if not reserved:
                    return None  # no room to promote into: treat as a miss
                self._promotions[(index, ctx.request_id)].append((key, reserved[key]))
                return True
        return None

    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin ready chunks for the engine to copy out; returns their slots.

        Raises ``KeyError`` if one is not ready; see :meth:`pin_prefix` for the
        form that pins what is there.
        """
        return self.primary.prepare_load(keys)

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin the leading ready chunks of ``keys``; returns their slots (maybe fewer)."""
        return self.primary.pin_prefix(keys)

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        self.primary.complete_load(keys)

    @_serialised
    def prepare_store(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int] | None:
        """Slots for the chunks not yet resident, or ``None`` if there is no room."""
        return self._reserve(keys)

    def _reserve(
        self, keys: Sequence[ChunkKey], protect: Collection[ChunkKey] = ()
    ) -> dict[ChunkKey, int] | None:
        """:meth:`PrimaryTier.prepare_store`; short of room, finished jobs are
        collected first and it tries again.

        A finished job keeps its chunks pinned until its result is applied:
        an engine that never calls :meth:`step` (stores and lookups that find
        everything ready never do) would otherwise lose that room for good.
        """
        reserved = self.primary.prepare_store(keys, protect)
        if reserved is None and self._jobs:
            self._collect()
            reserved = self.primary.prepare_store(keys, protect)
        return reserved

    @_serialised
    def complete_store(self, keys: Sequence[ChunkKey], success: bool = True) -> None:
        """The engine finished writing ``keys``; on success they cascade to the tiers."""
        try:
            if not success:
                self.primary.complete_store(keys, success=False)
                return
            # Which tiers take a store job is known before the chunks are ready
            # (admission only reads the backpressure), so that they come ready
            # already pinned once per tier, with no pass over the keys of its own.
            targets = [i for i, pressure in enumerate(self.backpressure) if pressure.admit()]
            ready = self.primary.complete_store(keys, pins=len(targets))
            if ready and len(targets) < len(self.tiers):
                for index in set(range(len(self.tiers))).difference(targets):
                    self.tiers[index].count(backpressure_drops=len(ready))
            self._cascade(ready, targets)
        finally:
            if keys:
                self._progressed()  # for lookups that found them being written

    @_serialised
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self.primary.touch(keys)
        for tier in self.tiers:
            self._call(tier, "touch", keys)

    @_serialised
    def on_request_finished(self, request_id: str) -> None:
        self._end_request(request_id)

    def _end_request(self, request_id: str) -> None:
        self._failed.pop(request_id, None)
        self._asking.discard(request_id)
        for tier in self.tiers:
            self._call(tier, "on_request_finished", request_id)

    @_serialised
    def step(self) -> None:
        """Once per engine step: collect finished jobs, then submit batched promotions."""
        self._collect()
        promotions, self._promotions = self._promotions, defaultdict(list)
        batches = list(promotions.items())
        for done, ((index, request_id), batch) in enumerate(batches, 1):
            keys = tuple(key for key, _ in batch)
            job = TransferJob(keys, tuple(slot for _, slot in batch), request_id=request_id)
            try:
                self._submit(index, job, loading=True)
            except BaseException:
                # A KeyboardInterrupt out of a tier: the batches not submitted
                # yet wait for the next step instead of holding their slots for ever.
                for where, rest in batches[done:]:
                    self._promotions[where].extend(rest)
                raise
        for tier in self.tiers:
            self._call(tier, "on_step_end")

    @_serialised
    def collect(self) -> None:
        """Apply the results of jobs that ended since the last call, as :meth:`step`
        does first, but leave the promotions queued since for the step to submit:
        for an engine that asks again, within a step, about chunks being promoted."""
        self._collect()

    @property
    def busy(self) -> bool:
        """Whether any job or promotion is still in flight."""
        with self._lock:
            return bool(self._jobs or self._promotions)

    # Lifecycle -------------------------------------------------------------

    @_serialised
    def drain(self) -> None:
        """Wait for every in-flight job and apply its result.

        Other threads' calls wait meanwhile: a drain is for resets and shutdown.
        """
        self.step()
        for tier in self.tiers:
            self._call(tier, "drain")
        self._collect()
        # A drained tier no longer touches the slots; if it still cannot report
        # its jobs it is broken, and they count as failed so the slots come back.
        for (index, job_id), job in list(self._jobs.items()):
            tier = self.tiers[index]
            logger.error("tier %s: job %d unreported after drain; failed", tier.tier_type, job_id)
            del self._jobs[(index, job_id)]
            self._finish(job, JobResult(job_id, False, frozenset(), 0, 0.0))

    @_serialised
    def reset(self) -> None:
        """Drain, then empty the primary tier (the secondary tiers keep their chunks)."""
        self.drain()
        self._failed.clear()
        self._asking.clear()
        self.primary.clear()

    @_serialised
    def shutdown(self) -> None:
        """Drain, stop every tier, release the primary buffer. Idempotent."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        for attachment in self.attachments:
            try:
                attachment.close()
            except Exception:
                logger.exception("%s: close raised", attachment.name)
        for tier in self.tiers:
            self._call(tier, "shutdown")
        self.primary.buffer.close()

    # Machinery -------------------------------------------------------------

    def _admit(self, tier_indexes: range, num_keys: int) -> list[int]:
        """The tiers among ``tier_indexes`` whose backpressure takes a store job now."""
        admitted = []
        for index in tier_indexes:
            if self.backpressure[index].admit():
                admitted.append(index)
            else:
                self.tiers[index].count(backpressure_drops=num_keys)
        return admitted

    def _cascade(self, ready: Mapping[ChunkKey, int], tier_indexes: Sequence[int]) -> None:
        """Write-through: copy ready chunks (``{key: slot}``) out to tiers, pinned
        until each job ends.

        The chunks come pinned once per tier (:meth:`PrimaryTier.complete_store`
        pinned them as they became ready); a job that cannot start unpins its share.
        """
        if not ready:
            return
        keys, slots = tuple(ready), tuple(ready.values())
        for done, index in enumerate(tier_indexes, 1):
            self.backpressure[index].started()
            try:
                self._submit(index, TransferJob(keys, slots), loading=False)
            except BaseException:
                for _ in tier_indexes[done:]:  # the shares of the tiers not reached
                    self.primary.complete_load(keys)
                raise

    def _submit(self, index: int, job: TransferJob, *, loading: bool) -> None:
        """Hand ``job`` to tier ``index``; if the tier raises, the job fails and
        its slots come back (a ``BaseException`` then goes on up)."""
        tier = self.tiers[index]
        # Recorded before the tier sees it: a fast tier may report the job
        # before submit returns, and its result must find the job.
        record = JobRecord(job.job_id, index, loading, job.keys, job.request_id)
        record.followed = self.residency.job_started(index, job.keys)
        self._jobs[(index, job.job_id)] = record
        try:
            (tier.submit_load if loading else tier.submit_store)(job)
        except BaseException as error:
            logger.exception("tier %s: submit raised; job %d failed", tier.tier_type, job.job_id)
            # Unless it reported the job before raising: that result stands.
            if self._jobs.pop((index, job.job_id), None) is not None:
                tier.count(**{"load_failures" if loading else "store_failures": len(job.keys)})
                self._release_failed(record)
            if not isinstance(error, Exception):
                raise

    def _collect(self) -> None:
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
                job = self._jobs.pop((index, result.job_id), None)
                if job is None:
                    logger.warning(
                        "tier %s: result for unknown job %d", tier.tier_type, result.job_id
                    )
                    continue
                self._finish(job, result)
                applied = True
        if applied:
            self._progressed()  # chunks became ready, or their promotions failed

    def _finish(self, job: JobRecord, result: JobResult) -> None:
        """Apply one finished job in isolation: a result that cannot be applied
        fails its own job (counted, logged once), and its slots come back."""
        tier = self.tiers[job.tier_index]
        try:
            self._apply(tier, job, JobOutcome.of(job, result))
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
            tier.count(**{"load_failures" if job.loading else "store_failures": len(job.keys)})
            result = JobResult(job.job_id, False, frozenset(), 0, 0.0)
        for listener in self.job_listeners:
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
            tier.count(
                chunks_loaded=len(outcome.good),
                bytes_loaded=outcome.nbytes,
                # A chunk evicted since the lookup (by another process, say) is
                # a miss: the request recomputes it, and nothing failed.
                load_failures=len(outcome.bad) - len(outcome.gone),
            )
            self.residency.removed(job.tier_index, outcome.gone)
            self._job_ended(job, outcome.good)
            self._cascade(loaded, targets)
        else:
            self.primary.complete_load(job.keys)
            job.released = True
            pressure = self.backpressure[job.tier_index]
            pressure.finished(outcome.seconds / max(1, len(job.keys)))
            tier.count(
                chunks_stored=len(outcome.good),
                bytes_stored=outcome.nbytes,
                store_failures=len(outcome.bad),
            )
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
        if request_id is not None and keys:
            self._failed[request_id].update((index, key) for key in keys)

    def _job_ended(self, job: JobRecord, held: Sequence[ChunkKey]) -> None:
        if job.followed:
            job.followed = False
            self.residency.job_ended(job.tier_index, job.keys, held)

    @staticmethod
    def _call(tier: SecondaryTier, method: str, *args: object) -> None:
        try:
            getattr(tier, method)(*args)
        except Exception:
            logger.exception("tier %s: %s raised", tier.tier_type, method)
