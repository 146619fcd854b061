"""Flow control shared by the peer server and client: a byte budget and a pacer."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class ByteBudget:
    """At most ``limit`` bytes in flight; a transfer larger than the whole
    budget still runs, alone, so no chunk size can deadlock it."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget must be positive, got {limit}")
        self.limit = limit
        self._used = 0
        self._changed = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    @contextlib.contextmanager
    def hold(self, nbytes: int, timeout: float | None = None) -> Iterator[None]:
        """Reserve ``nbytes`` for the ``with`` block; ``TimeoutError`` if none frees up."""
        size = min(nbytes, self.limit)
        with self._changed:
            if not self._changed.wait_for(lambda: self._used + size <= self.limit, timeout):
                raise TimeoutError(f"{size} bytes did not fit the in-flight budget in time")
            self._used += size
        try:
            yield
        finally:
            with self._changed:
                self._used -= size
                self._changed.notify_all()


class SendPacer:
    """Caps the bytes per second sent by every connection together.

    Each piece books the next free interval of the shared line, then
    sleeps until its turn: a token bucket with no burst.
    """

    def __init__(
        self,
        bytes_per_second: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"send rate must be positive, got {bytes_per_second}")
        self.rate = bytes_per_second
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_free = 0.0

    def wait(self, nbytes: int) -> None:
        """Block until ``nbytes`` more may go out."""
        with self._lock:
            now = self._clock()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.rate
        if start > now:
            self._sleep(start - now)
