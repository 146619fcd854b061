"""Open until closed: calls run while open, and closing waits for the running ones."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.errors import ClosedError, KVTierError


class Lifecycle:
    """Admits calls until :meth:`close`; ``close`` then waits for those still running.

    What runs inside :meth:`running` may touch the primary buffer: closing
    unmaps it, so it must never happen under a copy in progress.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._changed = threading.Condition()
        self._running = 0
        self._closed = False
        # Calls of this thread now inside running(): a close from within one
        # would wait for itself.
        self._local = threading.local()

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        """Raise :class:`ClosedError` once closed: a closed object says so
        before it looks at a call's arguments."""
        if self._closed:
            raise ClosedError(f"{self.name} is closed")

    @contextmanager
    def running(self) -> Iterator[None]:
        """Run the block as a call of the open object; raises :class:`ClosedError` once closed."""
        with self._changed:
            if self._closed:
                raise ClosedError(f"{self.name} is closed")
            self._running += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._changed:
                self._running -= 1
                if not self._running:
                    self._changed.notify_all()

    def close(self) -> bool:
        """Refuse new calls and wait for the running ones to end.

        Returns ``True`` for the call that closed it, ``False`` if already closed.
        """
        if getattr(self._local, "depth", 0):
            raise KVTierError(f"{self.name}: close() called from inside one of its own calls")
        with self._changed:
            if self._closed:
                return False
            self._closed = True
            self._changed.wait_for(lambda: not self._running)
            return True
