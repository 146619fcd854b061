"""The lock file that serialises every change to a shared index across
processes: an ``flock`` taken with a timeout, on the file that is at its path
now (one removed or replaced is opened again)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
import time
from collections.abc import Iterator

from kvtier.tiers.fs.layout import clear_odd_entry

#: First and longest pause between tries of a lock another process holds.
_LOCK_POLL_S = (20e-6, 1e-3)


class IndexBusyError(sqlite3.OperationalError):
    """The index lock stayed taken by another process for longer than the
    timeout: that process is stopped or hung inside a change."""


def file_id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def path_id(path: str) -> tuple[int, int] | None:
    """The identity of what is at ``path`` (not following a link), or ``None``."""
    try:
        return file_id(os.stat(path, follow_symlinks=False))
    except OSError:
        return None


class IndexLock:
    """An exclusive ``flock`` on the file at ``path``; every wait for it is
    bounded by ``timeout_s``. Not thread-safe: callers hold their own mutex."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._fd = self._open()

    @contextlib.contextmanager
    def hold(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the lock on the lock file that is there now; wait at most
        ``timeout_s`` (the lock's timeout if ``None``)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            self._lock_until(deadline)
            if path_id(self.path) == file_id(os.fstat(self._fd)):
                break
            # Removed or replaced: a lock on a file no one else opens excludes no one.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = self._open()
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)

    def _open(self) -> int:
        """Open (creating) the lock file, never through a symlink, making room
        for it if something else is at its path."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        for attempt in (1, 2):
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError:
                if attempt == 2:
                    raise
                clear_odd_entry(self.path)
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            clear_odd_entry(self.path)
        raise OSError(f"fs index: cannot make a lock file at {self.path}")

    def _lock_until(self, deadline: float) -> None:
        """Take the lock, or raise :class:`IndexBusyError` at ``deadline``. A
        blocking ``flock`` cannot be given up, so a taken lock is tried again
        after short, growing pauses."""
        pause, longest = _LOCK_POLL_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise IndexBusyError(
                    f"fs index lock {self.path} held by another process for more "
                    f"than {self.timeout_s} s"
                )
            time.sleep(min(pause, left))
            pause = min(2 * pause, longest)
