"""``FaultyTier``: wraps another tier and injects failures and latency.

Load it like any out-of-tree tier::

    {type: FaultyTier, module_path: kvtier.testing.faults,
     inner: {type: memory}, fail_rate: 0.2, latency_s: 0.05, seed: 7}

Tests may also flip :attr:`FaultyTier.broken` at run time: every call then
raises, as a crashed client library would.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import Field

from kvtier.keys import ChunkKey
from kvtier.tiers.base import (
    HealthCheck,
    JobResult,
    Lookup,
    LookupContext,
    SecondaryTier,
    TierOptions,
    TransferJob,
)
from kvtier.tiers.factory import SecondaryTierFactory


class FaultyTierOptions(TierOptions):
    inner: dict[str, Any] = Field(default_factory=lambda: {"type": "memory"})
    """The wrapped tier's configuration entry."""

    fail_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability that a job fails as a whole (every key failed)."""

    latency_s: float = Field(default=0.0, ge=0.0)
    """Extra seconds before a finished job is reported."""

    seed: int = 0
    """Seed of the failure dice."""

    hang_in: Literal["constructor", "health"] | None = None
    """Block forever in that step, as a tier stuck on an unanswering backend would."""


class FaultyTier(SecondaryTier[FaultyTierOptions]):
    """A tier that fails on purpose."""

    Options: ClassVar[type[TierOptions]] = FaultyTierOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = self.options
        self.hang_in = options.hang_in
        if self.hang_in == "constructor":
            threading.Event().wait()
        self.inner = SecondaryTierFactory.create_secondary_tier(
            options.inner, self.primary_kv_view, self.spec, entry=f"{self.tier_type}.inner"
        )
        self.fail_rate = options.fail_rate
        self.latency_s = options.latency_s
        self.broken = False
        self._dice = random.Random(options.seed)
        self._lock = threading.Lock()
        self._held: list[tuple[float, JobResult]] = []

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError(f"{self.tier_type} is broken (injected)")

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        self._check()
        return self.inner.lookup(key, ctx)

    def submit_store(self, job: TransferJob) -> None:
        self._submit(job, self.inner.submit_store)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job, self.inner.submit_load)

    def _submit(self, job: TransferJob, submit: Any) -> None:
        self._check()
        if self._dice.random() < self.fail_rate:
            with self._lock:
                self._held.append(
                    (time.monotonic(), JobResult(job.job_id, False, frozenset(), 0, 0.0))
                )
            return
        submit(job)

    def get_finished_jobs(self) -> list[JobResult]:
        self._check()
        now = time.monotonic()
        with self._lock:
            self._held += [(now, r) for r in self.inner.get_finished_jobs()]
            # Report the injected latency in the job's seconds, as a slow backend would.
            ready = [
                replace(r, seconds=r.seconds + now - t)
                for t, r in self._held
                if now - t >= self.latency_s
            ]
            self._held = [(t, r) for t, r in self._held if now - t < self.latency_s]
        return ready

    def drain(self) -> None:
        """Drain the inner tier, then wait out the latency of every result it
        reported: after a drain, all results are ready to collect."""
        self.inner.drain()
        now = time.monotonic()
        with self._lock:
            self._held += [(now, r) for r in self.inner.get_finished_jobs()]
            newest = max((t for t, _ in self._held), default=None)
        if newest is not None:
            time.sleep(max(0.0, newest + self.latency_s - time.monotonic()))

    def shutdown(self) -> None:
        self.inner.shutdown()

    def on_step_end(self) -> None:
        self._check()
        self.inner.on_step_end()

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self.inner.touch(keys)

    def health(self) -> Sequence[HealthCheck]:
        if self.hang_in == "health":
            threading.Event().wait()
        return self.inner.health()
