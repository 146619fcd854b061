"""Open until closed: calls run while open, and closing waits for the running ones."""

from __future__ import annotations

import threading
from _thread import get_ident  # a global name: one lookup less per call
from types import TracebackType

from kvtier.errors import ClosedError, KVTierError

#: Longest a close sleeps between looks at the calls still running: the last
#: one to end wakes it at once; the bound only guards against a missed wake.
_CLOSE_POLL_S = 0.05


class Lifecycle:
    """Admits calls until :meth:`close`; ``close`` then waits for those still running.

    What runs inside :meth:`running` may touch the primary buffer: closing
    unmaps it, so it must never happen under a copy in progress.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Serialises closes only: entering and leaving a call take no lock.
        self._lock = threading.Lock()
        #: Set once :meth:`close` begins (a plain attribute: read by every call).
        self.closed = False
        # Calls running now, per thread (a close from within one would wait
        # for itself); only a thread changes its own entry, so no lock guards
        # it. A call counts itself, then looks at closed; a close sets
        # closed, then looks at the counts: one of the two always sees the
        # other, so a close never misses a call that goes on.
        self._running: dict[int, int] = {}
        # Set by the last call to end once closed.
        self._idle = threading.Event()
        self._running_call = _Running(self)

    def check(self) -> None:
        """Raise :class:`ClosedError` once closed: a closed object says so
        before it looks at a call's arguments."""
        if self.closed:
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
            if self.closed:
                return False
            self.closed = True
        while self._running:
            self._idle.wait(_CLOSE_POLL_S)
        return True


class _Running:
    """The context manager of :meth:`Lifecycle.running`: one per lifecycle,
    holding no state of its own, so that entering a call allocates nothing."""

    __slots__ = ("_lifecycle",)

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    # Entered a few times by every request: no lock, a dict entry of the
    # thread's own each way.
    def __enter__(self) -> None:
        lifecycle = self._lifecycle
        running = lifecycle._running
        thread = get_ident()
        running[thread] = running.get(thread, 0) + 1
        if lifecycle.closed:  # looked at after counting itself (see Lifecycle)
            self.__exit__(None, None, None)
            raise ClosedError(f"{lifecycle.name} is closed")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lifecycle = self._lifecycle
        running = lifecycle._running
        thread = get_ident()
        depth = running[thread] - 1
        if depth:
            running[thread] = depth
            return
        del running[thread]
        if lifecycle.closed and not running:
            lifecycle._idle.set()
