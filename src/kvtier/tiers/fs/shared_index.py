"""The ``max_bytes`` bound of one namespace directory, shared by every process
of one host that uses it: an SQLite index (WAL mode) of the chunk files and
writes in flight, changed only under an ``flock``, so that the files on disk
never exceed what it counts and it never counts more than ``max_bytes``.

See docs/fs.md, 'Shared roots'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvtier.tiers.fs.group_commit import GroupCommit
from kvtier.tiers.fs.index_db import immediate, open_index_db
from kvtier.tiers.fs.index_lock import IndexBusyError, IndexLock, path_id
from kvtier.tiers.fs.layout import ChunkFile, write_abandoned
from kvtier.tiers.fs.mounts import NETWORK_FILESYSTEMS, filesystem_type

__all__ = [
    "EVICTION_LOG",
    "INDEX_FILE",
    "LOCK_FILE",
    "NETWORK_FILESYSTEMS",
    "STAMP_FLUSH_COUNT",
    "STAMP_FLUSH_S",
    "IndexBusyError",
    "SharedIndex",
    "Totals",
    "filesystem_type",
]

logger = logging.getLogger(__name__)

INDEX_FILE = "index.sqlite"
LOCK_FILE = "index.lock"

#: Evicted keys kept for other processes to drop from their local key sets.
EVICTION_LOG = 65536
#: Longest a use stamp waits in memory before a loading thread writes it.
STAMP_FLUSH_S = 1.0
#: Pending stamps that make a loading thread write them at once.
STAMP_FLUSH_COUNT = 4096
#: Rows changed per transaction when re-indexing, so others wait little.
_BATCH = 1024
#: Step between uses recorded while the clock is behind the latest use.
_TICK = 1e-6


def _exists(path: str) -> bool:
    """Whether anything is at ``path``. One that cannot be looked at (no
    access to its directory) counts as there: the index must never drop the
    row of a file that still takes space."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


@dataclass(frozen=True)
class Totals:
    """What the index counts, over every process sharing the directory:
    chunk files and writes in flight."""

    nbytes: int
    chunks: int


class SharedIndex:
    """Chunks and writes in flight of one namespace directory, bounded by
    ``max_bytes`` across processes. Thread-safe; see docs/fs.md, 'Shared roots'.

    ``chunk_path`` maps a key to its file; ``abandoned_s`` is how old another
    host's reservation must be to count as abandoned; ``scan`` lists the
    complete chunk files of the directory (to fill an index that lost them);
    ``lock_timeout_s`` bounds every wait for the lock.
    """

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        chunk_path: Callable[[bytes], str],
        abandoned_s: float,
        scan: Callable[[], Iterable[ChunkFile]],
        lock_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_bytes = max_bytes
        self._directory = directory
        self.path = os.path.join(directory, INDEX_FILE)
        self._chunk_path = chunk_path
        self._abandoned_s = abandoned_s
        self._scan = scan
        self._lock_timeout_s = lock_timeout_s
        self._clock = clock
        self._mutex = threading.Lock()
        self._pending_lock = threading.Lock()
        self._commits = GroupCommit(self._change)
        self._stamps: dict[bytes, float] = {}
        self._forget: set[bytes] = set()
        self._done: dict[bytes, str] = {}
        self._last_flush = time.monotonic()
        self._db: sqlite3.Connection | None = None
        self._db_id: tuple[int, int] | None = None
        self._reopened = False
        self._lock = IndexLock(os.path.join(directory, LOCK_FILE), lock_timeout_s)
        try:
            with self._flock():  # opens the index
                pass
        except BaseException:
            if self._db is not None:
                self._db.close()
            self._lock.close()
            raise
        self._reopened = False
        self.evictions_seen = self._last_eviction()

    @property
    def _index(self) -> sqlite3.Connection:
        assert self._db is not None, "opened by the constructor"
        return self._db

    def _open_index(self) -> None:
        """Under the lock: (re)open the index at :attr:`path`, filling it from
        a scan if it never counted the files."""
        if self._db is not None:
            logger.warning("fs index %s was replaced or removed: opening it again", self.path)
        db = open_index_db(self.path, self._lock_timeout_s)
        try:
            db_id = path_id(self.path)
            self._fill(db)
        except BaseException:
            db.close()  # the old connection stays, and this is tried again
            raise
        if self._db is not None:
            self._db.close()
            self._reopened = True
        self._db, self._db_id = db, db_id

    def _fill(self, db: sqlite3.Connection) -> None:
        """Count the chunk files on disk in an index that never counted them
        (new, rebuilt, or made by a process after the old one was deleted), so
        that the bound holds from its first use. Files from the future count
        as used now, so that they do not stay the most recently used."""
        # An index copied from another directory (another root, another
        # namespace) never counted these files.
        directory = os.path.abspath(self._directory)
        if db.execute("SELECT 1 FROM filled WHERE directory = ?", (directory,)).fetchone():
            return
        now = self._clock()
        rows = [(c.key, c.size, min(c.mtime_ns / 1e9, now)) for c in self._scan()]
        with immediate(db):
            db.executemany(
                "INSERT INTO chunks (key, size, used) VALUES (?, ?, ?) "
                "ON CONFLICT (key) DO NOTHING",
                rows,
            )
            db.execute("INSERT INTO filled (at, directory) VALUES (?, ?)", (now, directory))

    @contextlib.contextmanager
    def _flock(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the lock, on the lock file and index that are there now;
        wait at most ``timeout_s`` (the lock timeout if ``None``)."""
        with self._lock.hold(timeout_s):
            if self._db is None or path_id(self.path) != self._db_id:
                self._open_index()
            yield

    @contextlib.contextmanager
    def _change(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, alone among threads and processes; pending
        use stamps and forgotten keys go in with it."""
        with self._mutex, self._flock(), self._transaction() as db:
            yield db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """Under the lock: one transaction, which pending changes go in with."""
        with immediate(self._index) as db:
            self._apply_pending()
            yield db

    # Stores --------------------------------------------------------------------

    def reserve(self, key: bytes, size: int, temp_path: str) -> tuple[str, list[bytes]]:
        """Count a write of ``size`` bytes to ``temp_path`` before it starts.

        Evicts least recently used chunks (unlinking their files) until it
        fits; writes in flight are never evicted. Returns what to do, and the
        keys evicted: ``"write"``; ``"present"`` when the chunk's file is there
        or another live writer is making it; ``"full"`` when writes in flight
        fill ``max_bytes``.
        """
        return self._commits.run(lambda db: self._reserve_one(db, key, size, temp_path))

    def written(self, key: bytes, temp_path: str) -> None:
        """The write to ``temp_path`` renamed its file into place: its row is
        a chunk's now, no longer a write in flight. Recorded in memory and
        written with the next change (see docs/fs.md, 'Shared roots')."""
        with self._pending_lock:
            self._done[key] = temp_path

    def _reserve_one(
        self, db: sqlite3.Connection, key: bytes, size: int, temp_path: str
    ) -> tuple[str, list[bytes]]:
        row = db.execute("SELECT temp FROM chunks WHERE key = ?", (key,)).fetchone()
        if row is not None:
            if not self._files_gone(key, row[0]):
                db.execute("UPDATE chunks SET used = ? WHERE key = ?", (self._use_time(db), key))
                return "present", []
            db.execute("DELETE FROM chunks WHERE key = ?", (key,))  # a dead write's row
        victims = self._evict(db, self._used(db) + size - self.max_bytes)
        if self._used(db) + size > self.max_bytes:
            return "full", victims
        db.execute(
            "INSERT INTO chunks (key, size, used, temp) VALUES (?, ?, ?, ?)",
            (key, size, self._use_time(db), temp_path),
        )
        return "write", victims

    def release(self, key: bytes, temp_path: str) -> None:
        """The write to ``temp_path`` failed and its temp file is gone: drop its
        row, unless the chunk's file is there anyway (another writer's)."""
        with self._change() as db:
            if not _exists(self._chunk_path(key)):
                db.execute("DELETE FROM chunks WHERE key = ? AND temp = ?", (key, temp_path))

    # Loads ---------------------------------------------------------------------

    def touch(self, key: bytes) -> bool:
        """Record a use of ``key``, in memory: it is written with the next
        change. Returns whether the caller (an I/O thread) should :meth:`flush`
        now, because stamps have waited :data:`STAMP_FLUSH_S` or pile up."""
        with self._pending_lock:
            self._stamps[key] = self._clock()
            return (
                len(self._stamps) >= STAMP_FLUSH_COUNT
                or time.monotonic() - self._last_flush > STAMP_FLUSH_S
            )

    def forget(self, key: bytes) -> None:
        """Drop ``key``'s row at the next change if its file is gone by then
        (a load found it missing, or a corrupt file was removed)."""
        with self._pending_lock:
            self._forget.add(key)

    def flush(self) -> None:
        """Write pending use stamps, forgotten keys and finished writes now."""
        with self._change():
            pass

    def flush_if_free(self) -> bool:
        """:meth:`flush` if no thread or process holds the lock now, else
        nothing (the pending changes wait for the next change): a load never
        waits for the lock. Whether it flushed."""
        if not self._mutex.acquire(blocking=False):
            return False
        try:
            with self._flock(timeout_s=0), self._transaction():
                pass
        except IndexBusyError:
            return False
        finally:
            self._mutex.release()
        return True

    def _apply_pending(self) -> None:
        with self._pending_lock:
            stamps, self._stamps = self._stamps, {}
            forget, self._forget = self._forget, set()
            done, self._done = self._done, {}
            self._last_flush = time.monotonic()
        if done:
            # Only the row of that write: another may have replaced it since.
            self._index.executemany(
                "UPDATE chunks SET temp = NULL WHERE key = ? AND temp = ?", list(done.items())
            )
        if stamps:
            # In the order they were taken, each after the latest use recorded.
            latest = self._latest_use(self._index)
            ordered = []
            for key, used in sorted(stamps.items(), key=lambda item: item[1]):
                latest = used if latest is None or used > latest else latest + _TICK
                ordered.append((key, latest))
            stamps = dict(ordered)
            self._index.executemany(
                "UPDATE chunks SET used = max(used, ?) WHERE key = ?",
                [(used, key) for key, used in stamps.items()],
            )
        # Under the lock: a row whose chunk file exists, or whose write is
        # still in flight, stays (the index never under-counts); a writer
        # starting later enters a new row.
        gone = []
        for key in forget:
            row = self._index.execute("SELECT temp FROM chunks WHERE key = ?", (key,)).fetchone()
            if row is not None and self._files_gone(key, row[0]):
                gone.append((key,))
        if gone:
            self._index.executemany("DELETE FROM chunks WHERE key = ?", gone)

    def _write_over(self, key: bytes, temp: str) -> bool:
        """Whether the write of a row still marked in flight is over: it renamed
        its file (and was killed before saying so), or will never finish.
        The temp file is looked at first: a write that creates and renames it
        between the looks is then seen by the second, and its file goes."""
        if _exists(temp):
            return write_abandoned(temp, self._abandoned_s)
        return _exists(self._chunk_path(key)) or write_abandoned(temp, self._abandoned_s)

    def _files_gone(self, key: bytes, temp: str | None) -> bool:
        """Whether a row's chunk file is missing and its write (``temp`` until
        it is known to have finished) will never make it. The write is looked
        at first: one that renames between the two looks is then seen by the
        second."""
        if temp and not write_abandoned(temp, self._abandoned_s):
            return False
        return not _exists(self._chunk_path(key))

    # Other processes' evictions -------------------------------------------------

    def evictions(self) -> list[bytes] | None:
        """Keys evicted by any process since the last call; ``None`` when the
        log was trimmed past them (the caller must forget what it knows)."""
        with self._mutex:
            db = self._index
            oldest, newest = db.execute("SELECT min(seq), max(seq) FROM evicted").fetchone()
            if self._reopened:  # another index: what was logged before is lost
                self._reopened = False
                self.evictions_seen = int(newest or 0)
                return None
            if newest is None or newest <= self.evictions_seen:
                return []
            since, self.evictions_seen = self.evictions_seen, newest
            if oldest > since + 1:
                return None
            rows = self._index.execute(
                "SELECT key FROM evicted WHERE seq > ? AND seq <= ?", (since, newest)
            ).fetchall()
        return [key for (key,) in rows]

    def _last_eviction(self) -> int:
        with self._mutex:
            (newest,) = self._index.execute("SELECT max(seq) FROM evicted").fetchone()
        return int(newest or 0)

    # Restarts ------------------------------------------------------------------

    def reconcile(self, found: Iterable[ChunkFile], stopping: Callable[[], bool]) -> list[bytes]:
        """Make the index agree with a scan of the directory and the bound hold.

        Files it did not count (stored by a process without ``max_bytes``, or
        lost in a power cut) join with their mtime as last use (now, for an
        mtime in the future: it would outrank every use); rows whose
        files are gone are dropped (not those of writes in flight). Returns
        the keys evicted.
        """
        on_disk = {chunk.key: chunk for chunk in found}
        with self._mutex:
            known = {key for (key,) in self._index.execute("SELECT key FROM chunks")}
        now = self._clock()
        new = [
            (c.key, c.size, min(c.mtime_ns / 1e9, now))
            for key, c in on_disk.items()
            if key not in known
        ]
        for start in range(0, len(new), _BATCH):
            if stopping():
                return []
            with self._change() as db:
                db.executemany(
                    "INSERT INTO chunks (key, size, used) VALUES (?, ?, ?) "
                    "ON CONFLICT (key) DO NOTHING",
                    new[start : start + _BATCH],
                )
        for key in known - on_disk.keys():
            self.forget(key)
        victims: list[bytes] = []
        while not stopping():
            with self._change() as db:
                batch = self._evict(db, self._used(db) - self.max_bytes, limit=_BATCH)
            if not batch:
                break
            victims += batch
        return victims

    # Inside a change --------------------------------------------------------------

    @staticmethod
    def _latest_use(db: sqlite3.Connection) -> float | None:
        (latest,) = db.execute("SELECT max(used) FROM chunks").fetchone()
        return None if latest is None else float(latest)

    def _use_time(self, db: sqlite3.Connection) -> float:
        """The time of a use now: the clock, or just after the latest use
        recorded while the clock is behind it (set back, or another host's
        ahead), so that uses keep their order whatever the clock does."""
        now = self._clock()
        latest = self._latest_use(db)
        return now if latest is None or now > latest else latest + _TICK

    @staticmethod
    def _used(db: sqlite3.Connection) -> int:
        (used,) = db.execute("SELECT bytes FROM totals").fetchone()
        return int(used)

    def _evict(self, db: sqlite3.Connection, need: int, limit: int | None = None) -> list[bytes]:
        """Unlink least recently used chunk files until ``need`` bytes are free
        (or ``limit`` files went), then drop their rows and log them. Rows of
        writes in flight are passed over; a dead write's temp file goes too."""
        victims: list[bytes] = []
        examined = 0
        while need > 0 and (limit is None or len(victims) < limit):
            rows = db.execute(
                "SELECT key, size, temp FROM chunks ORDER BY used LIMIT ? OFFSET ?",
                (16, examined),
            ).fetchall()
            if not rows:
                break
            for key, size, temp in rows:
                examined += 1
                if temp and not self._write_over(key, temp):
                    continue  # a write in flight: its file will be counted
                if temp:
                    self._unlink(temp)  # a dead write's
                if not self._unlink(self._chunk_path(key)):
                    continue  # still there (no access): still counted
                victims.append(key)
                need -= size
                if need <= 0 or (limit is not None and len(victims) >= limit):
                    break
        if victims:
            db.executemany("DELETE FROM chunks WHERE key = ?", [(k,) for k in victims])
            db.executemany("INSERT INTO evicted (key) VALUES (?)", [(k,) for k in victims])
            db.execute(
                "DELETE FROM evicted WHERE seq <= (SELECT max(seq) FROM evicted) - ?",
                (EVICTION_LOG,),
            )
        return victims

    @staticmethod
    def _unlink(path: str) -> bool:
        """Remove ``path``; whether nothing is there now."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("fs index: cannot remove %s: %s", path, exc.strerror)
            return False
        return True

    # Reporting and closing -----------------------------------------------------

    def most_recent(self, limit: int) -> list[bytes]:
        """Keys of up to ``limit`` written chunks, most recently used first."""
        with self._mutex:
            rows = self._index.execute(
                "SELECT key FROM chunks WHERE temp IS NULL ORDER BY used DESC LIMIT ?", (limit,)
            ).fetchall()
        return [bytes(key) for (key,) in rows]

    def totals(self) -> Totals:
        """Bytes and counts of chunks and writes in flight, of all processes."""
        with self._mutex:
            nbytes, count = self._index.execute("SELECT bytes, count FROM totals").fetchone()
        return Totals(nbytes, count)

    def close(self) -> None:
        """Write pending changes and close the database."""
        try:
            self.flush()
        except sqlite3.Error as exc:
            logger.warning("fs index %s: last use stamps not written: %s", self.path, exc)
        finally:
            if self._db is not None:
                self._db.close()
            self._lock.close()
