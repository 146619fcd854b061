"""Drive one tier synchronously, outside the manager: for tools and tests.

``kvtier check``, ``kvtier bench`` and the contract suite all need "submit
this job and wait for its result" on a lone tier; this is that, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from kvtier.keys import ChunkKey
from kvtier.tiers.base import JobResult, Lookup, LookupContext, SecondaryTier, TransferJob

T = TypeVar("T")


class TierTimeout(TimeoutError):
    """A tier did not finish within the time a tool gave it."""


class Invoke(Protocol):
    """Makes one call into the tier: ``invoke("drain", tier.drain)``. The
    contract suites pass one that bounds each call (a hang guard)."""

    def __call__(self, step: str, call: Callable[[], T], /) -> T: ...


def directly(step: str, call: Callable[[], T], /) -> T:
    """The default :class:`Invoke`: just make the call."""
    return call()


def run_job(
    tier: SecondaryTier,
    job: TransferJob,
    *,
    loading: bool,
    timeout: float = 30.0,
    poll_s: float = 0.0002,
    invoke: Invoke = directly,
) -> JobResult:
    """Submit ``job`` and block until the tier reports its result."""
    if loading:
        invoke("submit_load", lambda: tier.submit_load(job))
    else:
        invoke("submit_store", lambda: tier.submit_store(job))
    deadline = time.monotonic() + timeout
    while True:
        for result in invoke("get_finished_jobs", tier.get_finished_jobs):
            if result.job_id != job.job_id:
                raise RuntimeError(
                    f"tier {tier.tier_type!r} reported job {result.job_id}, "
                    f"expected only {job.job_id}"
                )
            return result
        if time.monotonic() > deadline:
            raise TierTimeout(f"tier {tier.tier_type!r}: job {job.job_id} not done in {timeout}s")
        time.sleep(poll_s)


def resolve_lookup(
    tier: SecondaryTier,
    key: ChunkKey,
    *,
    timeout: float = 30.0,
    ctx: LookupContext | None = None,
    poll_s: float = 0.0002,
    invoke: Invoke = directly,
) -> Lookup:
    """Ask until the tier answers HIT or MISS (ending steps in between)."""
    context = ctx or LookupContext()
    deadline = time.monotonic() + timeout
    while True:
        answer = invoke("lookup", lambda: tier.lookup(key, context))
        if answer is not Lookup.PENDING:
            return answer
        if time.monotonic() > deadline:
            raise TierTimeout(f"tier {tier.tier_type!r}: lookup still pending after {timeout}s")
        invoke("on_step_end", tier.on_step_end)
        time.sleep(poll_s)
