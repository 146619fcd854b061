"""``example``: the smallest complete secondary tier, for tier authors to read.

It implements :class:`SecondaryTier` directly, with no helper base, to show
the whole contract in one screen. It keeps chunks in a dict and does its
"I/O" synchronously inside ``submit_*`` — acceptable only because a dict copy
is fast. A real backend does its I/O on its own threads: start from
:class:`kvtier.tiers.threaded.ThreadedTier` instead, which handles that.
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.tiers.base import JobResult, Lookup, LookupContext, SecondaryTier, TransferJob


class ExampleTier(SecondaryTier):
    """Unbounded, synchronous, in-process: a reference, not a production tier."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._chunks: dict[ChunkKey, bytes] = {}
        self._finished: list[JobResult] = []

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        # A dict answers at once; a remote tier would answer PENDING and check
        # in the background.
        return Lookup.HIT if key in self._chunks else Lookup.MISS

    def submit_store(self, job: TransferJob) -> None:
        started = time.perf_counter()
        stored = set()
        for key, slot in zip(job.keys, job.slots, strict=True):
            try:
                # Copy out of the primary slot: it is reused once the job ends.
                self._chunks.setdefault(key, bytes(self.slot(slot)))
            except IndexError:  # a slot outside the primary view: that chunk fails
                continue
            stored.add(key)
        self._finish(job, stored, started)

    def submit_load(self, job: TransferJob) -> None:
        started = time.perf_counter()
        loaded = set()
        for key, slot in zip(job.keys, job.slots, strict=True):
            data = self._chunks.get(key)
            if data is None:  # partial success is allowed: report what made it
                continue
            try:
                self.slot(slot)[:] = data
            except IndexError:
                continue
            loaded.add(key)
        self._finish(job, loaded, started)

    def _finish(self, job: TransferJob, succeeded: set[ChunkKey], started: float) -> None:
        self._finished.append(
            JobResult(
                job_id=job.job_id,
                success=len(succeeded) == len(job.keys),
                succeeded=frozenset(succeeded),
                nbytes=len(succeeded) * self.slot_bytes,
                seconds=time.perf_counter() - started,
            )
        )

    def get_finished_jobs(self) -> list[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def drain(self) -> None:
        """Nothing runs in the background."""

    def shutdown(self) -> None:
        self._chunks.clear()
