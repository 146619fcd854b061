"""``Deadlines``: run callbacks when their time comes, on one thread per tier;
:class:`BoundedCalls`: wait a bounded time for calls that may never return
(a codec's, per chunk); :func:`call_within`: the same for one call.

A remote tier answers for every job within its deadline, even while its
workers are stuck in a socket read: this thread fires the deadline and the
tier reports the job then.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CallTimeout(TimeoutError):
    """:func:`call_within`'s call did not return in time (the call's own
    ``TimeoutError`` stays apart from it)."""


def call_within(
    call: Callable[[], T],
    timeout_s: float,
    *,
    name: str,
    dispose: Callable[[T], None] | None = None,
) -> T:
    """``call()`` on a helper thread of its own, waiting at most ``timeout_s``
    (a :class:`BoundedCalls` for one call).

    A call stuck in a client library cannot be interrupted, only left behind:
    :class:`CallTimeout` then, and a result that comes later goes to
    ``dispose`` (a client to close).
    """
    calls = BoundedCalls(name, timeout_s)
    try:
        return calls(call, dispose=dispose)
    finally:
        calls.close()


class _Call:
    """One call handed to a :class:`BoundedCalls` helper, and its outcome."""

    __slots__ = ("abandoned", "call", "dispose", "done", "outcome")

    def __init__(self, call: Callable[[], Any], dispose: Callable[[Any], None] | None) -> None:
        self.call = call
        self.dispose = dispose
        self.done = threading.Event()
        self.outcome: tuple[bool, Any] = (False, None)
        self.abandoned = False


class BoundedCalls:
    """Run calls on helper threads and wait for each at most ``timeout_s``.

    Each calling thread has a helper of its own, reused call after call (a
    hand-over costs microseconds, not a thread start as :func:`call_within`
    does). A call that misses its bound raises :class:`CallTimeout` and is
    left to its helper, which ends when it returns. While any call is still
    running past its bound, every new call raises at once: a call that
    never returns costs one bounded wait, not one per call after it.
    """

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._overdue = 0
        self._helpers: list[tuple[threading.Thread, queue.SimpleQueue[_Call | None]]] = []

    @property
    def overdue(self) -> int:
        """Calls still running past their bound."""
        return self._overdue

    def __call__(self, call: Callable[[], T], dispose: Callable[[T], None] | None = None) -> T:
        """``call()``'s result within the bound; one that comes after it goes
        to ``dispose`` (a client to close), if given."""
        if self._overdue:
            raise CallTimeout(f"{self.name}: an earlier call is still running past its bound")
        helper: queue.SimpleQueue[_Call | None] | None = getattr(self._local, "helper", None)
        if helper is None:
            helper = self._local.helper = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(helper,), name=self.name)
            thread.daemon = True
            with self._lock:
                self._helpers.append((thread, helper))
            thread.start()
        task = _Call(call, dispose)
        helper.put(task)
        if not task.done.wait(self.timeout_s):
            with self._lock:
                if not task.done.is_set():
                    task.abandoned = True
                    self._overdue += 1
                    # Busy for good, maybe: the next call gets another helper.
                    self._helpers = [h for h in self._helpers if h[1] is not helper]
                    self._local.helper = None
                    raise CallTimeout(f"{self.name}: no answer within {self.timeout_s}s")
        succeeded, value = task.outcome
        if not succeeded:
            raise value
        return cast(T, value)

    def close(self) -> None:
        """Stop the helpers. One still in a call is waited for no longer
        than that call's bound (a caller left behind at shutdown may not
        have abandoned it yet); it ends when the call returns."""
        with self._lock:
            helpers, self._helpers = self._helpers, []
        for _, tasks in helpers:
            tasks.put(None)
        give_up = time.monotonic() + self.timeout_s
        for thread, _ in helpers:
            thread.join(max(0.0, give_up - time.monotonic()))

    def _serve(self, tasks: queue.SimpleQueue[_Call | None]) -> None:
        while True:
            task = tasks.get()
            if task is None:
                return
            try:
                task.outcome = (True, task.call())
            except BaseException as exc:
                task.outcome = (False, exc)
            with self._lock:
                task.done.set()
                if task.abandoned:  # its caller moved on to another helper
                    self._overdue -= 1
            if task.abandoned:
                self._dispose_late(task)
                return

    def _dispose_late(self, task: _Call) -> None:
        succeeded, value = task.outcome
        if succeeded and task.dispose is not None:
            try:
                task.dispose(value)
            except Exception:
                logger.debug("%s: disposing a late result failed", self.name)


class Deadlines:
    """A heap of ``(when, callback)`` served by one daemon thread."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        # Started with the first callback: a tier whose constructor fails
        # after building this leaves no thread behind.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def after(self, seconds: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on this thread) ``seconds`` from now."""
        with self._wake:
            if self._closed:
                return
            if self._thread.ident is None:  # never started
                self._thread.start()
            entry = (self._clock() + seconds, next(self._sequence), callback)
            heapq.heappush(self._heap, entry)
            # Only a new earliest deadline changes the thread's wait: most
            # come later than the head (a step's checks all share one bound),
            # and waking the thread for each only makes it contend for the lock.
            if self._heap[0] is entry:
                self._wake.notify()

    def close(self) -> None:
        """Stop; callbacks not yet due are dropped."""
        with self._wake:
            self._closed = True
            self._heap.clear()
            self._wake.notify()
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    now = self._clock()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._wake.wait(self._heap[0][0] - now if self._heap else None)
                if self._closed:
                    return
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # the thread must outlive any callback
                logger.exception("deadline callback failed")
