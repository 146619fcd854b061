"""A circuit breaker: stop asking a backend that is known to be down, and let
one probe through after a backoff. Clock and randomness are injected.

See docs/shared-tiers.md, 'When the backend fails'.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    """Where a breaker stands; ``value`` is what the state gauge exports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


#: Called as ``listener(old, new, reason)`` on every change of state.
StateListener = Callable[[BreakerState, BreakerState, str], None]


class CircuitBreaker:
    """Counts consecutive failures of a backend and decides when to skip it.

    Thread-safe. The owner calls :meth:`record_success` and
    :meth:`record_failure` after each backend call, :meth:`trip` when a call
    missed its deadline, and :meth:`take_probe` to learn whether the time to
    probe has come (at most one probe at a time).
    """

    def __init__(
        self,
        *,
        failures: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 1.0,
        jitter: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_change: StateListener | None = None,
    ) -> None:
        if failures < 1:
            raise ValueError(f"failures must be at least 1, got {failures}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < backoff_s <= max_backoff_s, got {backoff_s}, {max_backoff_s}"
            )
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.failures = failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.jitter = jitter
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_change = on_change
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened = 0  # failed probes since the breaker last closed
        self._probe_at = 0.0
        self.times_opened = 0
        self.probes = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def closed(self) -> bool:
        """Whether calls go to the backend (closed, or a probe is allowed)."""
        return self._state is BreakerState.CLOSED

    @property
    def retry_at(self) -> float:
        """Clock time after which an open breaker lets a probe through."""
        return self._probe_at

    def record_success(self) -> None:
        """A call succeeded: the backend answers."""
        with self._lock:
            self._consecutive = 0
            if self._state is BreakerState.CLOSED:
                return
            self._opened = 0
            change = self._set(BreakerState.CLOSED)
        self._notify(change, "the backend answered")

    def record_failure(self, reason: str = "a call failed") -> None:
        """A call failed; opens the breaker after enough in a row."""
        with self._lock:
            self._consecutive += 1
            if self._state is BreakerState.CLOSED and self._consecutive < self.failures:
                return
            if self._state is BreakerState.OPEN:
                return
            change = self._open()
        self._notify(change, reason)

    def trip(self, reason: str) -> None:
        """Open at once (a missed deadline: waiting is what the breaker prevents)."""
        with self._lock:
            if self._state is BreakerState.OPEN:
                return
            change = self._open()
        self._notify(change, reason)

    def take_probe(self) -> bool:
        """``True`` once per backoff when open: the caller sends the probe.

        The breaker is then half-open until :meth:`record_success` or
        :meth:`record_failure` (or :meth:`trip`) reports how the probe went.
        """
        with self._lock:
            if self._state is not BreakerState.OPEN or self.clock() < self._probe_at:
                return False
            self.probes += 1
            change = self._set(BreakerState.HALF_OPEN)
        self._notify(change, "probing after backoff")
        return True

    # Machinery (callers hold the lock) ----------------------------------------

    def _open(self) -> tuple[BreakerState, BreakerState]:
        backoff = min(self.max_backoff_s, self.backoff_s * 2**self._opened)
        self._opened += 1
        # Jitter shortens, never lengthens: max_backoff_s stays a true bound.
        self._probe_at = self.clock() + backoff * (1 - self.jitter * self.rng.random())
        if self._state is BreakerState.CLOSED:
            self.times_opened += 1
        return self._set(BreakerState.OPEN)

    def _set(self, state: BreakerState) -> tuple[BreakerState, BreakerState]:
        old, self._state = self._state, state
        return old, state

    def _notify(self, change: tuple[BreakerState, BreakerState], reason: str) -> None:
        if self.on_change is not None and change[0] is not change[1]:
            self.on_change(change[0], change[1], reason)
