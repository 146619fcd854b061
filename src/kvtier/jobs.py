"""What the manager keeps of each job a tier runs, and a tier's result checked against it."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.tiers.base import JobResult

__all__ = ["JobOutcome", "JobRecord"]


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


@dataclass(frozen=True)
class JobOutcome:
    """A tier's :class:`JobResult`, checked against its job."""

    good: list[ChunkKey]
    bad: list[ChunkKey]
    nbytes: int
    seconds: float
    #: Of ``bad``: keys the tier no longer held (misses, not failures).
    gone: list[ChunkKey]

    @classmethod
    def of(cls, job: JobRecord, result: JobResult) -> JobOutcome:
        """Raises ``TypeError`` or ``ValueError`` on a malformed result."""
        succeeded = frozenset(result.succeeded)
        bad = [key for key in job.keys if key not in succeeded]
        vanished = frozenset(result.vanished)
        return cls(
            good=[key for key in job.keys if key in succeeded],
            bad=bad,
            nbytes=int(result.nbytes),
            seconds=float(result.seconds),
            gone=[key for key in bad if key in vanished] if vanished else [],
        )
