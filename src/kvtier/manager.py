"""The tiering manager: lookups across tiers, promotions, write-through cascades.

Single-threaded by design: the engine's scheduler calls it, and
:meth:`TieringManager.step` once per engine step collects finished jobs
(before any eviction decision of the step) and submits batched promotions.
Tiers do their I/O on their own workers. A tier that raises, fails jobs or
falls behind only ever costs cache hits: its keys count as misses, its
failures are counted, and the engine recomputes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.backpressure import Backpressure
from kvtier.config import BackpressureConfig
from kvtier.keys import ChunkKey
from kvtier.primary import PrimaryTier
from kvtier.tiers.base import JobResult, Lookup, LookupContext, SecondaryTier, TransferJob

logger = logging.getLogger(__name__)


_ANSWER_COUNTER = {Lookup.HIT: "hits", Lookup.MISS: "misses", Lookup.PENDING: "pending"}

#: Called with ``(tier_index, loading, result)`` for every finished job (see
#: :attr:`TieringManager.job_listeners`).
JobListener = Callable[[int, bool, JobResult], None]


@dataclass(frozen=True)
class LookupResult:
    """``hit_chunks`` leading chunks are ready in the primary tier now;
    ``pending`` means more may be once in-flight work ends: ask again next step."""

    hit_chunks: int
    pending: bool


@dataclass(frozen=True)
class _Job:
    tier_index: int
    loading: bool
    keys: tuple[ChunkKey, ...]
    request_id: str | None


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
        self._jobs: dict[tuple[int, int], _Job] = {}
        # (tier index, request id) -> [(key, slot)], submitted at step end.
        self._promotions: dict[tuple[int, str | None], list[tuple[ChunkKey, int]]] = defaultdict(
            list
        )
        # Promotions that failed, per request, so a request never retries a bad
        # chunk; forgotten when the request finishes. Anonymous lookups retry.
        self._failed: dict[str, set[tuple[int, ChunkKey]]] = defaultdict(set)
        self._closed = False
        #: Observers of finished jobs (metrics, engine statistics). Called on the
        #: manager's thread once a result is applied; an observer that raises is
        #: logged and never disturbs the manager.
        self.job_listeners: list[JobListener] = []
        for tier in self.tiers:
            self._call(tier, "on_attach", primary)

    # Scheduler side -------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey], request_id: str | None = None) -> LookupResult:
        """How many leading chunks are ready; starts promotions for the rest it finds."""
        hits = 0
        pending = False
        for index, key in enumerate(keys):
            if self.primary.is_ready(key):
                hits += 0 if pending else 1
                continue
            if self.primary.is_writing(key):
                pending = True
                continue
            found = self._lookup_secondary(key, LookupContext(request_id, index), keys)
            if found is None:
                break
            pending = pending or found
        if hits:
            self.primary.touch(keys[:hits])
        return LookupResult(hits, pending)

    def _lookup_secondary(
        self, key: ChunkKey, ctx: LookupContext, chain: Sequence[ChunkKey]
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
                reserved = self.primary.prepare_store([key], protect=chain)
                if not reserved:
                    return None  # no room to promote into: treat as a miss
                self._promotions[(index, ctx.request_id)].append((key, reserved[key]))
                return True
        return None

    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin ready chunks for the engine to copy out; returns their slots."""
        return self.primary.prepare_load(keys)

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        self.primary.complete_load(keys)

    def prepare_store(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int] | None:
        """Slots for the chunks not yet resident, or ``None`` if there is no room."""
        return self.primary.prepare_store(keys)

    def complete_store(self, keys: Sequence[ChunkKey], success: bool = True) -> None:
        """The engine finished writing ``keys``; on success they cascade to the tiers."""
        written = [k for k in keys if self.primary.is_writing(k)]
        self.primary.complete_store(written, success)
        if success and written:
            self._cascade(written, range(len(self.tiers)))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self.primary.touch(keys)
        for tier in self.tiers:
            self._call(tier, "touch", keys)

    def on_request_finished(self, request_id: str) -> None:
        self._failed.pop(request_id, None)
        for tier in self.tiers:
            self._call(tier, "on_request_finished", request_id)

    def step(self) -> None:
        """Once per engine step: collect finished jobs, then submit batched promotions."""
        self._collect()
        promotions, self._promotions = self._promotions, defaultdict(list)
        for (index, request_id), batch in promotions.items():
            keys = tuple(key for key, _ in batch)
            job = TransferJob(keys, tuple(slot for _, slot in batch), request_id=request_id)
            if not self._submit(index, job, loading=True):
                self.primary.complete_store(keys, success=False)
                self._remember_failures(request_id, index, keys)
        for tier in self.tiers:
            self._call(tier, "on_step_end")

    @property
    def busy(self) -> bool:
        """Whether any job or promotion is still in flight."""
        return bool(self._jobs or self._promotions)

    # Lifecycle -------------------------------------------------------------

    def drain(self) -> None:
        """Wait for every in-flight job and apply its result."""
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
            self._apply(tier, job, JobResult(job_id, False, frozenset(), 0, 0.0))

    def reset(self) -> None:
        """Drain, then empty the primary tier (the secondary tiers keep their chunks)."""
        self.drain()
        self._failed.clear()
        self.primary.clear()

    def shutdown(self) -> None:
        """Drain, stop every tier, release the primary buffer. Idempotent."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        for tier in self.tiers:
            self._call(tier, "shutdown")
        self.primary.buffer.close()

    # Machinery -------------------------------------------------------------

    def _cascade(self, keys: Sequence[ChunkKey], tier_indexes: range) -> None:
        """Write-through: copy resident chunks out to tiers, pinned until each job ends."""
        for index in tier_indexes:
            tier, pressure = self.tiers[index], self.backpressure[index]
            if not pressure.admit():
                tier.count(backpressure_drops=len(keys))
                continue
            slots = self.primary.prepare_load(keys)
            if self._submit(index, TransferJob(tuple(keys), tuple(slots)), loading=False):
                pressure.started()
            else:
                self.primary.complete_load(keys)

    def _submit(self, index: int, job: TransferJob, *, loading: bool) -> bool:
        tier = self.tiers[index]
        try:
            (tier.submit_load if loading else tier.submit_store)(job)
        except Exception:
            logger.exception("tier %s: submit raised; job %d failed", tier.tier_type, job.job_id)
            tier.count(**{"load_failures" if loading else "store_failures": len(job.keys)})
            return False
        self._jobs[(index, job.job_id)] = _Job(index, loading, job.keys, job.request_id)
        return True

    def _collect(self) -> None:
        for index, tier in enumerate(self.tiers):
            try:
                results = tier.get_finished_jobs()
            except Exception:
                logger.exception("tier %s: get_finished_jobs raised", tier.tier_type)
                continue
            for result in results:
                job = self._jobs.pop((index, result.job_id), None)
                if job is None:
                    logger.warning(
                        "tier %s: result for unknown job %d", tier.tier_type, result.job_id
                    )
                    continue
                self._apply(tier, job, result)

    def _apply(self, tier: SecondaryTier, job: _Job, result: JobResult) -> None:
        good = [key for key in job.keys if key in result.succeeded]
        bad = [key for key in job.keys if key not in result.succeeded]
        if job.loading:
            self.primary.complete_store(good, success=True)
            self.primary.complete_store(bad, success=False)
            self._remember_failures(job.request_id, job.tier_index, bad)
            tier.count(chunks_loaded=len(good), bytes_loaded=result.nbytes, load_failures=len(bad))
            if good and job.tier_index:
                # A hit in a slower tier warms the faster tiers in front of it.
                self._cascade(good, range(job.tier_index))
        else:
            self.primary.complete_load(job.keys)
            self.backpressure[job.tier_index].finished(result.seconds / max(1, len(job.keys)))
            tier.count(chunks_stored=len(good), bytes_stored=result.nbytes, store_failures=len(bad))
        for listener in self.job_listeners:
            try:
                listener(job.tier_index, job.loading, result)
            except Exception:
                logger.exception("job listener %r raised", listener)

    def _remember_failures(
        self, request_id: str | None, index: int, keys: Sequence[ChunkKey]
    ) -> None:
        if request_id is not None and keys:
            self._failed[request_id].update((index, key) for key in keys)

    @staticmethod
    def _call(tier: SecondaryTier, method: str, *args: object) -> None:
        try:
            getattr(tier, method)(*args)
        except Exception:
            logger.exception("tier %s: %s raised", tier.tier_type, method)
