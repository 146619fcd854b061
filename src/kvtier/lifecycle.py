"""Open until closed: calls run while open, and closing waits for the running ones."""

from __future__ import annotations

import threading
from types import TracebackType

from kvtier.errors import ClosedError, KVTierError


class Lifecycle:
    """Admits calls until :meth:`close`; ``close`` then waits for those still running.

    What runs inside :meth:`running` may touch the primary buffer: closing
    unmaps it, so it must never happen under a copy in progress.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        # Calls running now, per thread (a close from within one would wait
        # for itself); their total is what a close waits for.
        self._running: dict[int, int] = {}
        # Set by a close while calls still run; the last call to end sets it.
        self._idle: threading.Event | None = None
        self._running_call = _Running(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        """Raise :class:`ClosedError` once closed: a closed object says so
        before it looks at a call's arguments."""
        if self._closed:
            raise ClosedError(f"{self.name} is closed")

    def running(self) -> _Running:
        """Run the ``with`` block as a call of the open object; raises
        :class:`ClosedError` once closed."""
        return self._running_call

    def close(self) -> bool:
        """Refuse new calls and wait for the running ones to end.

        Returns ``True`` for the call that closed it, ``False`` if already closed.
        """
        with self._lock:
            if threading.get_ident() in self._running:
                raise KVTierError(f"{self.name}: close() called from inside one of its own calls")
            if self._closed:
                return False
            self._closed = True
            if not self._running:
                return True
            idle = self._idle = threading.Event()
        idle.wait()
        return True


class _Running:
    """The context manager of :meth:`Lifecycle.running`: one per lifecycle,
    holding no state of its own, so that entering a call allocates nothing."""

    __slots__ = ("_lifecycle",)

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    # Entered a few times by every request: the bookkeeping inline, one lock
    # entry each way.
    def __enter__(self) -> None:
        lifecycle = self._lifecycle
        thread = threading.get_ident()
        with lifecycle._lock:
            if lifecycle._closed:
                raise ClosedError(f"{lifecycle.name} is closed")
            running = lifecycle._running
            running[thread] = running.get(thread, 0) + 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lifecycle = self._lifecycle
        thread = threading.get_ident()
        with lifecycle._lock:
            running = lifecycle._running
            depth = running[thread] - 1
            if depth:
                running[thread] = depth
                return
            del running[thread]
            if not running and lifecycle._idle is not None:
                lifecycle._idle.set()
