"""The tiering manager: lookups across tiers, promotions, write-through
cascades. A tier that raises, fails jobs or falls behind only ever costs
cache hits. Thread-safe: one re-entrant lock, never held while bytes move.

See docs/architecture.md, 'The manager', and docs/threads.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Concatenate, NamedTuple, ParamSpec, Protocol, TypeVar

from kvtier.backpressure import Backpressure
from kvtier.config.sections import BackpressureConfig
from kvtier.jobs import JobBook, JobListener, RequestMisses, count_lookup, count_lookups
from kvtier.keys import ChunkKey, check_keys
from kvtier.primary import PrimaryTier
from kvtier.progress import Progress
from kvtier.residency import ResidencyFeed
from kvtier.tiers.base import Lookup, LookupContext, SecondaryTier, TierMetric, TransferJob
from kvtier.tiers.runtime import in_batches

logger = logging.getLogger(__name__)


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


#: Most bytes one promotion job moves. Smaller, and the jobs' own cost
#: shows; larger, and a prefix's first chunks wait longer for its last ones.
PROMOTION_JOB_BYTES = 32 << 20


#: Most keys a look asks the first tier about in one call. A look's first
#: run is of 4 keys and each next one twice as long, up to this: a prompt
#: whose first uncached chunk comes soon looks at few keys past it for nothing.
LOOK_RUN = 64


class _Look(NamedTuple):
    """What one look asks the tiers on behalf of (made once a look)."""

    request_id: str | None
    chain: set[ChunkKey]
    missed: Collection[tuple[int, ChunkKey]]


def _hits_from(index: int, ahead: dict[int, Lookup]) -> list[int]:
    """``index`` (a HIT) and the indices of the HITs right after it in ``ahead``."""
    hits = [index]
    for later, answer in ahead.items():  # in order
        if answer is not Lookup.HIT:
            break
        hits.append(later)
    return hits


def _all_pending(answers: dict[int, Lookup]) -> bool:
    """Whether every answer of a run is PENDING."""
    values = list(answers.values())
    return values.count(Lookup.PENDING) == len(values)


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
        # (tier index, request id) -> [(key, slot)], submitted at step end
        # (whole jobs of the first tier's: at once, by the lookup).
        self._promotions: dict[tuple[int, str | None], list[tuple[ChunkKey, int]]] = defaultdict(
            list
        )
        # Requests told to ask again: their primary hits were counted at the
        # first ask, and what was promoted for them counts as the tier's hit,
        # so a request's chunks count once, however many steps it waits.
        self._asking: set[str] = set()
        # The (tier, chunk) MISSes of requests still waiting, not asked (nor
        # counted) again. Unlike a failed load (JobBook.failed), forgotten
        # once the request stops waiting: the chunk may be stored by then (a
        # preempted request's own chunks).
        self._waiting_misses: RequestMisses[tuple[int, ChunkKey]] = RequestMisses()
        self._promotion_job_chunks = max(1, PROMOTION_JOB_BYTES // primary.buffer.slot_bytes)
        self._closed = False
        #: Services closed, in order, at :meth:`shutdown` (after the drain, before the tiers).
        self.attachments: list[Attachment] = []
        #: Moves whenever a lookup's answer may have changed, so that callers
        #: waiting for promotions sleep until then instead of polling.
        self.progress = Progress()
        for tier in self.tiers:
            self._call(tier, "on_attach", primary)
        self.progress.follow(self.tiers)
        #: Which tier holds which chunk, as it changes (KV events for routers):
        #: add observers with ``residency.add_listener``.
        self.residency = ResidencyFeed([tier.tier_type for tier in self.tiers], primary.watchers)
        self.jobs = JobBook(primary, self.tiers, self.backpressure, self.residency, self.progress)
        self._failed = self.jobs.failed  # read by every lookup: one attribute away
        #: Observers of finished jobs: see :attr:`JobBook.listeners`.
        self.job_listeners: list[JobListener] = self.jobs.listeners
        for index, tier in enumerate(self.tiers):
            tier.removal_listeners.append(functools.partial(self.residency.removed, index))

    # Scheduler side -------------------------------------------------------

    @_serialised
    def lookup(self, keys: Sequence[ChunkKey], request_id: str | None = None) -> LookupResult:
        """How many leading chunks are ready; starts promotions for the rest it finds."""
        asked_before = request_id is not None and request_id in self._asking
        hits = self.primary.lookup(keys, count_hits=not asked_before)
        return LookupResult(hits, self._look_past(keys, hits, request_id, asked_before))

    def lookup_pinned(
        self, keys: Sequence[ChunkKey], request_id: str, *, end_request: bool = False
    ) -> tuple[list[int], bool]:
        """:meth:`lookup`, pinning the leading ready chunks as they are found.

        Returns the slots of the chunks pinned, in order, and whether more may
        be ready once in-flight work ends (a promotion, a store): that end is
        announced on :attr:`progress`. A plain tuple: a named one costs a
        Python-level call to build, once a lookup. ``end_request``: the
        request's lookups are over unless more is pending, and then it ends
        here as by :meth:`on_request_finished`.
        """
        # The lock taken here, not by _serialised: once a request, a call less.
        with self._lock:
            asked_before = request_id in self._asking
            primary = self.primary
            slots = primary.lookup_pinned(keys, count_hits=not asked_before)
            pending = False
            # Most lookups of a cache without secondary tiers: nothing past the prefix.
            if self.tiers or asked_before or primary.has_writes:
                try:
                    pending = self._look_past(keys, len(slots), request_id, asked_before)
                except BaseException:
                    primary.complete_load(keys[: len(slots)])
                    raise
            # Without secondary tiers a request leaves nothing to forget
            # (no failed loads; not pending, it is not among those asking).
            if end_request and not pending and self.tiers:
                self._end_request(request_id)
            return slots, pending

    def _look_past(
        self, keys: Sequence[ChunkKey], hits: int, request_id: str | None, asked_before: bool
    ) -> bool:
        """Under the lock, after the primary tier found ``hits`` leading chunks
        ready: whether more may come (chunks being written or promoted).

        Linear in ``keys``: every promotion protects the same set of the
        chain's keys, made once. The primary tier touched the ready chunks
        first, so that the promotions' evictions meet them at the recent end
        of the policy's order. The first tier is asked a run of keys at a
        time (:meth:`_ask_run`): a request waiting on a long prefix asks
        about all of it at every look.
        """
        if self.tiers and hits < len(keys):
            # Past the ready prefix keys go to the secondary tiers: one that is
            # not a key fails here, not in their checks, where it would open a
            # remote tier's breaker for every request.
            check_keys(keys, hits)
        primary = self.primary
        is_ready, is_writing = primary.is_ready, primary.is_writing
        pending = False
        look: _Look | None = None
        ahead: dict[int, Lookup] = {}  # the first tier's answers for keys to come
        whole_runs = True  # its runs of HITs reserved at once
        run = 4
        # Past the ready prefix, only secondary tiers or writes in flight add anything.
        end = len(keys) if self.tiers or primary.has_writes else hits
        index = hits - 1
        while (index := index + 1) < end:
            key = keys[index]
            if is_ready(key):
                continue
            if is_writing(key):
                pending = True
                continue
            if not self.tiers:
                break
            if look is None:  # the first key a tier is asked about (most lookups: none)
                look = _Look(request_id, set(keys), self._waiting_misses.of(request_id))
            first = ahead.pop(index, None)
            if first is None:
                ahead = self._ask_run(keys, index, look, run)
                run = min(2 * run, LOOK_RUN)
                if ahead and _all_pending(ahead):
                    # A run still being checked, as most of a long cold prefix
                    # is at each look while it waits: nothing to do but wait.
                    # The keys the run passed over are ready or being written.
                    pending = True
                    index = next(reversed(ahead))
                    ahead = {}
                    continue
                first = ahead.pop(index, None)
            if first is Lookup.PENDING:
                pending = True
                continue
            if first is Lookup.HIT and whole_runs:
                hits_ahead = _hits_from(index, ahead)
                if len(hits_ahead) > 1:
                    if self._promote_all(keys, hits_ahead, ahead, look):
                        pending = True
                        continue
                    whole_runs = False  # short of room: one at a time, as many as fit
            found = self._lookup_secondary(key, index, look, first)
            if found is None:
                break
            pending = pending or found
        if request_id is not None:
            if pending:
                self._asking.add(request_id)
            else:
                if asked_before:
                    self._asking.discard(request_id)
                if self._waiting_misses:  # most often none: no call
                    self._waiting_misses.forget(request_id)
        return pending

    def _ask_run(
        self, keys: Sequence[ChunkKey], start: int, look: _Look, most: int
    ) -> dict[int, Lookup]:
        """The first tier's answers, by index, for the keys among the ``most``
        from ``start`` on that are neither ready nor being written, up to one
        it is not to be asked about (see :meth:`_lookup_secondary`)."""
        tier = self.tiers[0]
        window = keys[start : start + most]
        offsets = self.primary.absent(window)
        failed = self._failed.of(look.request_id)
        if failed or look.missed:  # most looks: neither, and no pair is made a key
            for count, offset in enumerate(offsets):
                pair = (0, window[offset])
                if pair in failed or pair in look.missed:
                    del offsets[count:]
                    break
        if not offsets:
            return {}
        whole = len(offsets) == len(window)  # none passed over: most runs
        asked = window if whole else [window[offset] for offset in offsets]
        try:
            ctx = LookupContext(look.request_id, start + offsets[0])
            answers = tier.lookup_run(asked, ctx)
            if not 0 < len(answers) <= len(offsets):
                raise ValueError(f"{len(answers)} answers about {len(offsets)} keys")
        except Exception:
            logger.exception("tier %s: lookup raised; counted as a miss", tier.tier_type)
            count_lookup(tier, None)
            return {}
        count_lookups(tier, answers)
        indices = range(start, start + len(window)) if whole else [start + o for o in offsets]
        return dict(zip(indices, answers, strict=False))

    def _promote_all(
        self, keys: Sequence[ChunkKey], indices: list[int], ahead: dict[int, Lookup], look: _Look
    ) -> bool:
        """Reserve slots at once for the first tier's HITs at ``indices``
        (taken from ``ahead``) and queue their promotions; ``False``, with
        nothing changed, when there is not room for all."""
        reserved = self._reserve([keys[i] for i in indices], protect=look.chain)
        if reserved is None:
            return False
        where = (0, look.request_id)
        promotions = self._promotions[where]
        for index in indices:
            ahead.pop(index, None)
            slot = reserved.pop(keys[index], None)  # a key given twice: promoted once
            if slot is not None:
                promotions.append((keys[index], slot))
        if len(promotions) >= self._promotion_job_chunks:
            self._submit_whole_jobs(where)
        return True

    def _lookup_secondary(
        self, key: ChunkKey, index: int, look: _Look, first: Lookup | None
    ) -> bool | None:
        """``True`` if a tier has or may have ``key`` (pending), ``None`` on a miss.

        ``first`` is the first tier's answer, asked in a run (``None``: it is
        not asked). A promotion never evicts another chunk of the same chain.
        A tier that answered MISS while the request waits (``look.missed``),
        or whose load of the key failed, is not asked again: that would only
        queue another existence check and count the same miss again.
        """
        request_id = look.request_id
        ctx = LookupContext(request_id, index)
        failed = self._failed.of(request_id)
        for tier_index, tier in enumerate(self.tiers):
            asked = (tier_index, key)
            if tier_index == 0:
                if first is None:
                    continue
                answer = first
            else:
                if asked in failed or asked in look.missed:
                    continue
                try:
                    answer = tier.lookup(key, ctx)
                except Exception:
                    logger.exception("tier %s: lookup raised; counted as a miss", tier.tier_type)
                    count_lookup(tier, None)
                    continue
                count_lookup(tier, answer)
            if answer is Lookup.MISS:
                self._waiting_misses.remember(request_id, (asked,))
            if answer is Lookup.PENDING:
                return True
            if answer is Lookup.HIT:
                reserved = self._reserve([key], protect=look.chain)
                if not reserved:
                    return None  # no room to promote into: treat as a miss
                self._promotions[(tier_index, request_id)].append((key, reserved[key]))
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

    def prepare_store(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int] | None:
        """Slots for the chunks not yet resident, or ``None`` if there is no room."""
        with self._lock:  # as _serialised, a call less: once a store
            reserved = self.primary.prepare_store(keys)
            return reserved if reserved is not None else self._reserve_again(keys)

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
        return reserved if reserved is not None else self._reserve_again(keys, protect)

    def _reserve_again(
        self, keys: Sequence[ChunkKey], protect: Collection[ChunkKey] = ()
    ) -> dict[ChunkKey, int] | None:
        """After a reservation found no room: collect the jobs that ended, whose
        chunks may hold that room, and try once more if any did."""
        if not self.jobs.running:
            return None
        self.jobs.collect()
        return self.primary.prepare_store(keys, protect)

    def complete_store(self, keys: Collection[ChunkKey], success: bool = True) -> None:
        """The engine finished writing ``keys``; on success they cascade to the tiers."""
        with self._lock:  # as _serialised, a call less: once a store
            try:
                if not success:
                    self.primary.complete_store(keys, success=False)
                elif not self.tiers:  # nothing to cascade to
                    self.primary.complete_store(keys)
                else:
                    self._cascade(keys)
            finally:
                if keys:
                    self.progress.announce()  # for lookups that found them being written

    def _cascade(self, keys: Collection[ChunkKey]) -> None:
        """Make the chunks written ready and send them to the tiers that admit them."""
        # Which tiers take a store job is known before the chunks are ready
        # (admission only reads the backpressure), so that they come ready
        # already pinned once per tier, with no pass over the keys of its own.
        targets = [i for i, pressure in enumerate(self.backpressure) if pressure.admit()]
        ready = self.primary.complete_store(keys, pins=len(targets))
        if ready and len(targets) < len(self.tiers):
            for index in set(range(len(self.tiers))).difference(targets):
                self.tiers[index].count(backpressure_drops=len(ready))
        self.jobs.cascade(ready, targets)

    @_serialised
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self.primary.touch(keys)
        for tier in self.tiers:
            self._call(tier, "touch", keys)

    @_serialised
    def on_request_finished(self, request_id: str) -> None:
        self._end_request(request_id)

    def _end_request(self, request_id: str) -> None:
        if self._failed:  # most often none: no call
            self._failed.forget(request_id)
        self._asking.discard(request_id)
        if self._waiting_misses:
            self._waiting_misses.forget(request_id)
        for tier in self.tiers:
            self._call(tier, "on_request_finished", request_id)

    @_serialised
    def step(self) -> None:
        """Once per engine step: collect finished jobs, then submit batched promotions."""
        self.jobs.collect()
        promotions, self._promotions = self._promotions, defaultdict(list)
        # A prefix's promotion in jobs of a few MiB: the first ones' chunks are
        # ready (and copied out by a streaming load) while the rest still move.
        size = self._promotion_job_chunks
        self._submit_promotions(
            [
                (where, piece)
                for where, batch in promotions.items()
                for piece in in_batches(batch, size)
            ]
        )
        for tier in self.tiers:
            self._call(tier, "on_step_end")

    def _submit_whole_jobs(self, where: tuple[int, str | None]) -> None:
        """Under the lock, during the lookup that queued them: submit the
        promotions queued for ``where`` that fill whole jobs, so that a long
        cold prefix's first reads run while the rest of it is looked up.
        What is left of a job waits for the step."""
        queued = self._promotions[where]
        whole = len(queued) - len(queued) % self._promotion_job_chunks
        batches = [
            (where, piece) for piece in in_batches(queued[:whole], self._promotion_job_chunks)
        ]
        del queued[:whole]
        self._submit_promotions(batches)
        if batches:
            # The walk goes on holding the interpreter's lock, which a woken
            # worker would get only after the switch interval (5 ms), past the
            # walk's end: a zero sleep gives it up long enough for one to start.
            time.sleep(0)

    def _submit_promotions(
        self, batches: list[tuple[tuple[int, str | None], list[tuple[ChunkKey, int]]]]
    ) -> None:
        """Submit each ``(where, batch)`` of promotions as one job."""
        for done, ((index, request_id), batch) in enumerate(batches, 1):
            keys = tuple(key for key, _ in batch)
            job = TransferJob(keys, tuple(slot for _, slot in batch), request_id=request_id)
            try:
                self.jobs.submit(index, job, loading=True)
            except BaseException:
                # A KeyboardInterrupt out of a tier: the batches not submitted
                # yet wait for the next step instead of holding their slots for ever.
                for where, rest in batches[done:]:
                    self._promotions[where].extend(rest)
                raise

    @_serialised
    def collect(self) -> None:
        """Apply the results of jobs that ended since the last call, as :meth:`step`
        does first, but leave the promotions queued since for the step to submit:
        for an engine that asks again, within a step, about chunks being promoted."""
        if not self._closed:  # a shut-down tier has nothing left to report
            self.jobs.collect()

    @_serialised
    def promote_into_free(self, index: int, keys: Sequence[ChunkKey]) -> TransferJob | None:
        """Promote, as one job from tier ``index``, those of ``keys`` the primary
        tier lacks, into slots that hold nothing: evicting nothing, for no
        request. The job, or ``None`` when none started (every key resident,
        no free slot, or shut down)."""
        primary = self.primary
        free = primary.free_count
        wanted = [key for key in dict.fromkeys(keys) if primary.slot_of(key) is None][:free]
        if self._closed or not wanted:
            return None
        reserved = primary.prepare_store(wanted)  # fits in the free slots: evicts nothing
        if not reserved:
            return None
        job = TransferJob(tuple(reserved), tuple(reserved.values()))
        self.jobs.submit(index, job, loading=True)
        return job

    def running(self, index: int, job: TransferJob) -> bool:
        """Whether ``job``, submitted to tier ``index``, has no result applied yet."""
        return (index, job.job_id) in self.jobs.running

    @property
    def busy(self) -> bool:
        """Whether any job or promotion is still in flight."""
        with self._lock:
            return bool(self.jobs.running or self._promotions)

    # Lifecycle -------------------------------------------------------------

    @_serialised
    def drain(self) -> None:
        """Wait for every in-flight job and apply its result.

        Other threads' calls wait meanwhile: a drain is for resets and shutdown.
        """
        self.step()
        for tier in self.tiers:
            self._call(tier, "drain")
        self.jobs.collect()
        self.jobs.fail_unreported()

    @_serialised
    def reset(self) -> None:
        """Drain, then empty the primary tier (the secondary tiers keep their chunks)."""
        self.drain()
        self._failed.clear()
        self._asking.clear()
        self._waiting_misses.clear()
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

    @property
    def unapplied_results(self) -> int:
        """Results a tier reported that could not be applied (each failed its job)."""
        return self.jobs.unapplied_results

    @staticmethod
    def _call(tier: SecondaryTier, method: str, *args: object) -> None:
        try:
            getattr(tier, method)(*args)
        except Exception:
            logger.exception("tier %s: %s raised", tier.tier_type, method)
