"""The probes of a remote tier's open circuit breaker: one at a time when the
breaker says one is due, each on a thread of its own, and a bound on how many
threads probes stuck in a backend call may hold.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.tiers.circuit import CircuitBreaker

logger = logging.getLogger(__name__)


class Probes:
    """Starts ``probe`` on a thread when ``breaker`` takes one.

    A probe past its deadline is left behind in its call (a thread cannot be
    interrupted) and the next one goes out on a thread of its own after the
    backoff, so a thawed backend is seen at the next probe whatever the stuck
    ones do; :attr:`max_threads` bounds the threads a long freeze strands
    (each ends with its client's timeout).
    """

    def __init__(
        self,
        tier_type: str,
        breaker: CircuitBreaker,
        probe: Callable[[], None],
        max_threads: int = 8,
    ) -> None:
        self.tier_type = tier_type
        self.breaker = breaker
        self.probe = probe
        self.max_threads = max_threads
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._capped = False  # warned that max_threads are stuck

    @property
    def threads(self) -> list[threading.Thread]:
        """Probe threads still alive: the one in flight and those stuck past their deadline."""
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    def start_if_due(self) -> bool:
        """Start a probe if the breaker takes one now; whether one started."""
        # One probe at a time is the breaker's rule (half-open until the probe
        # answers or misses its deadline); a stuck one only holds a thread.
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) >= self.max_threads:
                if not self._capped:
                    self._capped = True
                    logger.warning(
                        "tier %s: %d probes stuck in backend calls; the next waits for one "
                        "to end (the client's own timeouts bound them)",
                        self.tier_type,
                        len(self._threads),
                    )
                return False
            if not self.breaker.take_probe():
                return False
            self._capped = False
            name = f"kvtier-{self.tier_type}-probe"
            thread = threading.Thread(target=self.probe, name=name, daemon=True)
            self._threads.append(thread)
        thread.start()
        return True
