"""``RequestBudgets``: one deadline per request, shared by its existence checks
and the load that follows, counting only the backend's time.

See docs/shared-tiers.md, 'When the backend fails'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat

from kvtier.keys import ChunkKey
from kvtier.tiers.bounded import drop_oldest


@dataclass
class _Wait:
    first: float  # the request's first PENDING answer of this wait
    last: float  # its latest PENDING answer
    spent: float = 0.0  # backend time until the checks that found its chunks answered


class RequestBudgets:
    """Thread-safe; ``clock`` is injected for tests."""

    def __init__(
        self,
        deadline_s: float,
        clock: Callable[[], float] = time.perf_counter,
        max_entries: int = 65536,
    ) -> None:
        self.deadline_s = deadline_s
        self.clock = clock
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._waits: dict[str, _Wait] = {}
        self._answered: dict[ChunkKey, float] = {}  # when each key's check answered

    def waiting(self, request_id: str) -> None:
        """A lookup of ``request_id`` answered PENDING: it waits on the backend."""
        now = self.clock()
        with self._lock:
            wait = self._waits.get(request_id)
            if wait is None or now - wait.last > self.deadline_s:
                # A new wait, or one after a pause of the engine's own.
                self._waits[request_id] = _Wait(first=now, last=now)
                drop_oldest(self._waits, self.max_entries)
            else:
                wait.last = now

    def checked(self, keys: Iterable[ChunkKey]) -> None:
        """The check of ``keys`` answered now."""
        now = self.clock()
        with self._lock:
            for key in keys:
                self._answered[key] = now
            drop_oldest(self._answered, self.max_entries)

    def found(self, request_id: str | None, keys: Iterable[ChunkKey]) -> None:
        """A lookup of ``request_id`` took the check answers of ``keys``: it waited until then."""
        with self._lock:
            taken = map(self._answered.pop, keys, repeat(None))
            answered = [when for when in taken if when is not None]
            wait = self._waits.get(request_id) if request_id is not None else None
            if wait is not None and answered:
                wait.spent = max(wait.spent, max(answered) - wait.first)

    def take(self, request_id: str | None) -> tuple[float, float | None]:
        """Seconds left to a load of ``request_id``, and since when it waits (or
        ``None``). Every load of one wait gets the same: a prefix promoted as
        several jobs is bounded as one."""
        with self._lock:
            wait = self._waits.get(request_id) if request_id is not None else None
        if wait is None:
            return self.deadline_s, None
        return max(0.0, self.deadline_s - wait.spent), wait.first

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._waits.pop(request_id, None)
