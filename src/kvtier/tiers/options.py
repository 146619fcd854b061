"""The options of the tier runtime: its workers (every tier on threads), and
the guards of a remote backend (deadlines, circuit breaker)."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvtier.tiers.base import TierOptions

#: Longest wait any timeout or backoff option takes (an hour): longer ones are
#: typos, and an infinite one would never recover or would overflow the
#: clients' timers when the tier starts, far from the config that caused it.
MAX_WAIT_S = 3600.0


class ThreadedTierOptions(TierOptions):
    io_threads: int = Field(default=4, ge=1, le=256)
    """Worker threads doing the tier's blocking I/O."""

    codec_timeout_s: float | None = Field(default=None, gt=0, le=3600)
    """Longest wait for the tier's codec to encode or decode one chunk: a
    chunk it takes longer on fails (a miss, counted), and while that call
    is still running every other chunk fails at once instead of waiting
    again. Unset: kvtier's own codecs, which always return, are called
    directly; any other is waited for the tier's ``deadline_s`` where it
    has one, else 5 s. Set, it bounds every codec."""


class RemoteTierOptions(ThreadedTierOptions):
    """Options every remote tier takes: its guards. A backend's ``Options`` subclass it."""

    skip_existing: bool = False
    """Before a store, check which chunks the store already holds (one batched
    round trip) and send only the others. Worth it when many engines compute
    the same chunks at once; otherwise the extra round trip costs more than it
    saves, since the manager never writes a promoted chunk back to its tier."""

    deadline_s: float = Field(default=0.75, gt=0, le=60)
    """Most seconds one job (a request's loads or stores) or existence check
    may take, whatever its number of chunks, threads and retries. A job still
    running then is answered with the chunks done so far (the others fail, and
    the request recomputes them), and the circuit breaker opens. Also bounds
    how long ``shutdown`` waits for workers stuck in a backend call."""

    breaker_failures: int = Field(default=3, ge=1)
    """Failed backend calls in a row that open the circuit breaker (one
    missed deadline opens it at once). While open, lookups answer MISS and
    stores are dropped without a call to the backend."""

    breaker_backoff_s: float = Field(default=0.25, gt=0, le=MAX_WAIT_S)
    """Seconds the breaker stays open before one probe; doubled after each
    failed probe up to ``breaker_max_backoff_s``, shortened by up to 20%
    of random jitter."""

    breaker_max_backoff_s: float = Field(default=1.0, gt=0, le=MAX_WAIT_S)
    """Longest wait between two probes of a backend that stays down, and so
    the longest a recovered backend goes unused. A probe is one cheap request
    (``PING``, a bucket ``HEAD``)."""

    startup_timeout_s: float = Field(default=5.0, gt=0, le=MAX_WAIT_S)
    """Most seconds the tier waits, when it starts, to connect and get a first
    answer; an endpoint that accepts connections but never answers fails then."""

    @model_validator(mode="after")
    def _check_backoff(self) -> RemoteTierOptions:
        if self.breaker_backoff_s > self.breaker_max_backoff_s:
            raise ValueError(
                f"breaker_backoff_s={self.breaker_backoff_s} is above "
                f"breaker_max_backoff_s={self.breaker_max_backoff_s}"
            )
        return self
