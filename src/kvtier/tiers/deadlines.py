"""``Deadlines``: run callbacks when their time comes, on one thread per tier;
:func:`call_within`: wait a bounded time for a call that may never return.

A remote tier answers for every job within its deadline, even while its
workers are stuck in a socket read: this thread fires the deadline and the
tier reports the job then.
"""

from __future__ import annotations

import heapq
import itertools
import logging
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
    """``call()`` on a daemon thread of its own, waiting at most ``timeout_s``.

    A call stuck in a client library cannot be interrupted, only left behind:
    :class:`CallTimeout` then, and a result that comes later goes to
    ``dispose`` (a client to close).
    """
    outcome: list[tuple[bool, Any]] = []
    lock = threading.Lock()
    abandoned = False

    def run() -> None:
        try:
            result: tuple[bool, Any] = (True, call())
        except BaseException as exc:
            result = (False, exc)
        with lock:
            outcome.append(result)
            late = abandoned
        if late and result[0] and dispose is not None:
            try:
                dispose(result[1])
            except Exception:
                logger.debug("%s: disposing a late result failed", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        if not outcome:
            abandoned = True
            raise CallTimeout(f"no answer within {timeout_s}s")
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return cast(T, value)


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
            heapq.heappush(self._heap, (self._clock() + seconds, next(self._sequence), callback))
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
