"""Values an existence check read whole, held for the promotion that follows,
so a cold chunk costs one request, not two. Held bytes are bounded; values
nobody claims are dropped once older than :data:`UNCLAIMED_S`. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

#: Seconds after which a held value nobody took gives its room to newer
#: checks: a promotion follows its check within a step or two.
UNCLAIMED_S = 10.0


class Prefetched:
    """Values read by existence checks, by store name, up to ``budget_bytes``."""

    def __init__(
        self,
        budget_bytes: int,
        on_expired: Callable[[int], None] = lambda count: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._on_expired = on_expired
        self._clock = clock
        self._lock = threading.Lock()
        #: name -> (when held, value), oldest first.
        self._values: dict[str, tuple[float, bytes]] = {}
        self._held_bytes = 0
        #: Bytes promised to checks still reading.
        self._reserved_bytes = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes

    def reserve(self, nbytes: int) -> bool:
        """Room for a check to read ``nbytes``, or ``False`` (then it only asks
        for existence). A reservation is ended by :meth:`keep`."""
        with self._lock:
            expired = 0 if self._fits(nbytes) else self._expire()
            fits = self._fits(nbytes)
            if fits:
                self._reserved_bytes += nbytes
        if expired:
            self._on_expired(expired)
        return fits

    def keep(self, reserved: int, values: Sequence[tuple[str, bytes]]) -> None:
        """End a reservation of ``reserved`` bytes, holding ``values`` (read
        within it: they are at most that long together)."""
        with self._lock:
            self._reserved_bytes -= reserved
            now = self._clock()
            for name, value in values:
                self._pop(name)
                self._values[name] = (now, value)
                self._held_bytes += len(value)

    def holds(self, names: Sequence[str]) -> bool:
        """Whether a value is held for every one of ``names``."""
        with self._lock:
            return all(name in self._values for name in names)

    def take(self, name: str) -> bytes | None:
        """The value held for ``name``, no longer held; ``None`` if there is none."""
        with self._lock:
            return self._pop(name)

    def drop(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                self._pop(name)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._held_bytes = 0

    def _fits(self, nbytes: int) -> bool:
        return self._held_bytes + self._reserved_bytes + nbytes <= self.budget_bytes

    def _pop(self, name: str) -> bytes | None:
        held = self._values.pop(name, None)
        if held is None:
            return None
        self._held_bytes -= len(held[1])
        return held[1]

    def _expire(self) -> int:
        """Drop the values held longer than :data:`UNCLAIMED_S` (the oldest
        come first); how many."""
        limit = self._clock() - UNCLAIMED_S
        stale = []
        for name, (since, _) in self._values.items():
            if since > limit:
                break
            stale.append(name)
        for name in stale:
            self._pop(name)
        return len(stale)
