"""Recording a workload as a trace ``kvtier simulate`` replays, keys
anonymised; the request path only enqueues, a writer thread does the I/O.

See docs/policies-and-specs.md for the format, rotation and drops.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from kvtier.config.sections import TraceRecordingConfig
from kvtier.errors import ConfigError
from kvtier.inputs import unwritable_file_problem
from kvtier.keys import ChunkKey

logger = logging.getLogger(__name__)

_STOP = object()
#: How long a recorded request may wait for the writer thread: woken by the
#: first request after a pause, it lets the requests of this long gather (or
#: until the queue is half full) and writes them as one batch. A wake-up per
#: request cost the request path more than the rest of its recording.
_WRITE_EVERY_S = 0.05


class TraceRecorder:
    """Appends requests' chunk keys, anonymised, to a JSONL trace off the request path."""

    def __init__(
        self,
        path: Path | str,
        *,
        block_size: int,
        max_bytes: int = 1 << 30,
        queue_size: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1 or max_bytes < 1 or queue_size < 1:
            raise ValueError("block_size, max_bytes and queue_size must be positive")
        self.path = Path(path)
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._clock = clock
        self._started = clock()
        self.queue_size = queue_size
        # Requests, flush marks (events) and the stop, from any thread. A
        # SimpleQueue: one C call a request (a Queue's put is several Python
        # calls under a lock), and the idle writer blocks in its get.
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        # Cuts the writer's gathering short: a burst, a flush, the stop.
        self._hurry = threading.Event()
        # Requests come from any thread: the drop count takes a lock (only when dropping).
        self._drop_lock = threading.Lock()
        #: Requests dropped because the queue was full, and writes that failed.
        self.dropped = 0
        self.failed_writes = 0
        #: Requests written, and files rotated away.
        self.written = 0
        self.rotations = 0
        self._ids: dict[ChunkKey, int] = {}
        self._file: IO[str] | None = None
        self._size = 0
        self._warned: set[str] = set()
        self._writer = threading.Thread(target=self._run, name="kvtier-trace", daemon=True)
        self._writer.start()

    def record(self, keys: Sequence[ChunkKey], input_length: int, output_length: int = 0) -> None:
        """Queue one request: its full chunks' keys, in order, and its tokens. Never blocks."""
        timestamp = int((self._clock() - self._started) * 1000)
        waiting = self._queue
        if waiting.qsize() >= self.queue_size:
            with self._drop_lock:
                self.dropped += 1
            self._warn_once(
                "full", "trace queue full: requests are dropped (counted), not waited for"
            )
            return
        waiting.put((tuple(keys), input_length, output_length, timestamp))
        if waiting.qsize() * 2 >= self.queue_size:
            self._hurry.set()  # a burst: written now rather than dropped

    @classmethod
    def from_config(cls, config: TraceRecordingConfig, block_size: int) -> TraceRecorder | None:
        """The recorder ``config`` asks for, or ``None`` when recording is off."""
        if config.path is None:
            return None
        problem = unwritable_file_problem(config.path)
        if problem is not None:  # else every request's record would fail, counted, unseen
            raise ConfigError([("trace_recording.path", problem)])
        return cls(
            config.path,
            block_size=block_size,
            max_bytes=int(config.max_bytes),
            queue_size=config.queue_size,
        )

    def flush(self) -> None:
        """Wait until every queued request is written (or has failed)."""
        written = threading.Event()
        self._queue.put(written)
        self._hurry.set()
        while not written.wait(_WRITE_EVERY_S):
            if not self._writer.is_alive():  # closed: nothing will be written
                return

    def close(self) -> None:
        """Write what is queued, then stop the writer and close the file."""
        self._queue.put(_STOP)
        self._hurry.set()
        self._writer.join()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread -------------------------------------------------------

    def _run(self) -> None:
        waiting = self._queue
        while True:
            item = waiting.get()  # idle: blocked here, never woken
            # Busy: the requests that follow gather while the writer sleeps
            # (a put with no reader blocked in get wakes nobody).
            self._hurry.wait(_WRITE_EVERY_S)
            self._hurry.clear()  # whatever is put from here on is taken below
            while True:  # one at a time: the queue's bound covers all not yet written
                if item is _STOP:
                    if self._file is not None:
                        self._file.close()
                    return
                if isinstance(item, threading.Event):
                    item.set()  # a flush: everything queued before it is written
                else:
                    self._write(item)  # type: ignore[arg-type]
                try:
                    item = waiting.get_nowait()
                except queue.Empty:
                    break

    def _write(self, item: tuple[tuple[ChunkKey, ...], int, int, int]) -> None:
        keys, input_length, output_length, timestamp = item
        if self._file is not None and self._size >= self.max_bytes:
            self._rotate()
        ids = self._ids
        line = json.dumps(
            {
                "timestamp": timestamp,
                "input_length": input_length,
                "output_length": output_length,
                "hash_ids": [ids.setdefault(key, len(ids)) for key in keys],
                "block_size": self.block_size,
            }
        )
        try:
            file = self._file if self._file is not None else self._open()
            file.write(line + "\n")
            file.flush()
        except OSError as exc:
            self.failed_writes += 1
            self._warn_once(
                "write", f"cannot write trace {self.path}: {exc}; requests are counted as failed"
            )
            self._close_quietly()
            return
        self._size += len(line) + 1
        self.written += 1

    def _open(self) -> IO[str]:
        if not self.written and self.path.exists() and self.path.stat().st_size:
            # Another process numbered that file: its ids mean nothing to ours.
            self._rotate()
        self._file = self.path.open("a", encoding="utf-8")
        self._size = self.path.stat().st_size
        return self._file

    def _rotate(self) -> None:
        self._close_quietly()
        try:
            self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            self._warn_once("rotate", f"cannot rotate trace {self.path}: {exc}")
        self.rotations += 1
        # A fresh file numbers afresh, so it replays alone and the map stays bounded.
        self._ids.clear()

    def _close_quietly(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("%s", message)
