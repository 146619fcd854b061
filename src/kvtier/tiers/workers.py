"""A tier's worker threads, taking queued tasks most urgent first."""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    """Queue priorities of worker tasks: cheaper and more latency-critical work first."""

    #: A load whose values are in memory already (held by existence checks):
    #: a copy, and the memory it gives back is what the next checks read into.
    HELD = 0
    CHECK = 1
    LOAD = 2
    STORE = 3


class Workers:
    """``count`` daemon threads named ``name-i``, started on the first task
    (or :meth:`start`), never by the constructor."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count
        self._lock = threading.Lock()
        # One deque per priority; a worker takes one token per task from a
        # SimpleQueue (C, no Python-level Condition per wait), then the first
        # task of the most urgent non-empty deque. A task is appended before
        # its token is put; the extra tokens of stop() find none and end a worker.
        self._tasks = tuple(collections.deque[Callable[[], None]]() for _ in Priority)
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        #: Whether :meth:`stop` began: no new task is taken.
        self.stopped = False

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads started so far."""
        return list(self._threads)

    def backlog(self) -> int:
        """Tasks queued that no worker has taken yet."""
        return sum(map(len, self._tasks))

    def start(self) -> None:
        with self._lock:
            self._start()

    def submit(self, priority: Priority, task: Callable[[], None]) -> None:
        with self._lock:
            if self.stopped:
                raise RuntimeError(f"{self.name} is shut down")
            if not self._threads:
                self._start()
        self._tasks[priority].append(task)
        self._tokens.put(None)

    def _start(self) -> None:
        """Start the threads unless started or stopped; the caller holds the lock."""
        if not self.stopped and not self._threads:
            self._threads = [
                threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                for i in range(self.count)
            ]
            for thread in self._threads:
                thread.start()

    def stop(self, timeout: float | None) -> None:
        """Stop every worker once the queue empties; wait ``timeout`` at most
        for one still in a task (left behind, a daemon, past it)."""
        with self._lock:
            self.stopped = True
            threads = list(self._threads)
        for _ in threads:
            self._tokens.put(None)
        give_up = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if give_up is None else max(0.0, give_up - time.monotonic()))

    def _work(self) -> None:
        while True:
            self._tokens.get()
            task = self._take()
            if task is None:
                return
            try:
                task()
            except BaseException:  # a worker must survive any backend surprise
                logger.exception("%s: unexpected error in a task", self.name)

    def _take(self) -> Callable[[], None] | None:
        for tasks in self._tasks:
            with contextlib.suppress(IndexError):  # taken meanwhile: the next may hold one
                return tasks.popleft()
        return None
