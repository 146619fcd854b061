"""The ``max_bytes`` bound of one namespace directory, shared by every process
that uses it: an SQLite database (WAL mode) next to the chunk files.

::

    <namespace hex>/index.sqlite   chunks (key, size, last use), writes in flight
                                   (key, size, temp path, host, pid), totals, and
                                   a log of evicted keys
    <namespace hex>/index.lock     flock(2) taken around every change

Every store reserves its file's bytes in ``writes`` before the temp file is
created, evicting least recently used chunks (any process's, also those of
processes that exited) until chunks plus writes in flight fit in
``max_bytes``; evicted files are unlinked *before* the transaction that drops
their rows commits. So the chunk and temp files on disk never exceed what the
index counts, and the index never counts more than ``max_bytes``. A process
killed mid-transaction leaves rows whose files are gone (the index
over-counts, never under-counts); a process killed mid-write leaves a
reservation that the next process needing room (or starting) clears once its
writer is known to be dead.

Cost is kept off the load path: a load records its use in memory, and uses
are written in batches (with the next store's transaction, or at most once a
second by a loading thread). A store costs two short transactions. The flock
queues processes in the kernel (woken at once on release) instead of
SQLite's sleeping busy handler; a mutex queues this process's threads.

SQLite's WAL needs memory shared between the processes: all of them must run
on one host (see ``docs/fs.md``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvtier.tiers.fs.layout import HOST, ChunkFile, abandoned

logger = logging.getLogger(__name__)

INDEX_FILE = "index.sqlite"
LOCK_FILE = "index.lock"

#: Evicted keys kept for other processes to drop from their local key sets.
EVICTION_LOG = 65536
#: Longest a use stamp waits in memory before a loading thread writes it.
STAMP_FLUSH_S = 1.0
#: Pending stamps that make a loading thread write them at once.
STAMP_FLUSH_COUNT = 4096
#: How often a store also clears reservations of dead writers, which would
#: otherwise keep their bytes from use until room ran out.
DEAD_WRITES_EVERY_S = 5.0
#: Rows changed per transaction when re-indexing, so others wait little.
_BATCH = 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key BLOB PRIMARY KEY, size INTEGER NOT NULL, used REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used);
CREATE TABLE IF NOT EXISTS writes (
    id INTEGER PRIMARY KEY, key BLOB NOT NULL, size INTEGER NOT NULL, temp TEXT NOT NULL,
    host TEXT NOT NULL, pid INTEGER NOT NULL, started REAL NOT NULL);
CREATE TABLE IF NOT EXISTS evicted (seq INTEGER PRIMARY KEY AUTOINCREMENT, key BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS totals (
    name TEXT PRIMARY KEY, bytes INTEGER NOT NULL, count INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES ('chunks', 0, 0), ('writes', 0, 0);
CREATE TRIGGER IF NOT EXISTS chunk_added AFTER INSERT ON chunks BEGIN
    UPDATE totals SET bytes = bytes + new.size, count = count + 1 WHERE name = 'chunks'; END;
CREATE TRIGGER IF NOT EXISTS chunk_dropped AFTER DELETE ON chunks BEGIN
    UPDATE totals SET bytes = bytes - old.size, count = count - 1 WHERE name = 'chunks'; END;
CREATE TRIGGER IF NOT EXISTS chunk_resized AFTER UPDATE OF size ON chunks BEGIN
    UPDATE totals SET bytes = bytes + new.size - old.size WHERE name = 'chunks'; END;
CREATE TRIGGER IF NOT EXISTS write_added AFTER INSERT ON writes BEGIN
    UPDATE totals SET bytes = bytes + new.size, count = count + 1 WHERE name = 'writes'; END;
CREATE TRIGGER IF NOT EXISTS write_dropped AFTER DELETE ON writes BEGIN
    UPDATE totals SET bytes = bytes - old.size, count = count - 1 WHERE name = 'writes'; END;
"""
# An upsert, not INSERT OR REPLACE: REPLACE deletes without firing triggers.
_PUT_CHUNK = (
    "INSERT INTO chunks (key, size, used) VALUES (?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET size = excluded.size, used = excluded.used"
)


@dataclass(frozen=True)
class Totals:
    """What the index counts, over every process sharing the directory."""

    chunk_bytes: int
    chunks: int
    write_bytes: int
    writes: int


class SharedIndex:
    """Chunks and writes in flight of one namespace directory, bounded by
    ``max_bytes`` across processes. Thread-safe; see the module docstring.

    ``chunk_path`` maps a key to its file; ``abandoned_s`` is how old another
    host's reservation must be to count as abandoned.
    """

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        chunk_path: Callable[[bytes], str],
        abandoned_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_bytes = max_bytes
        self.path = os.path.join(directory, INDEX_FILE)
        self._chunk_path = chunk_path
        self._abandoned_s = abandoned_s
        self._clock = clock
        self._mutex = threading.Lock()
        self._pending_lock = threading.Lock()
        self._stamps: dict[bytes, float] = {}
        self._forget: set[bytes] = set()
        self._last_flush = time.monotonic()
        self._last_dead_check = time.monotonic()
        self._lock_fd = os.open(
            os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        try:
            self._db = self._open()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.evictions_seen = self._last_eviction()

    def _open(self) -> sqlite3.Connection:
        with self._flock():
            try:
                return self._connect()
            except sqlite3.DatabaseError as exc:
                # Only an index: what it knew is rebuilt from a scan of the files.
                logger.warning("fs index %s unusable (%s): starting a new one", self.path, exc)
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path + suffix)
                return self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode = WAL")
            # Commits skip fsync (checkpoints do it): a power cut may lose the
            # last changes, which the re-index at the next start puts back.
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(_SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _change(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, alone among threads and processes; pending
        use stamps and forgotten keys go in with it."""
        with self._mutex, self._flock():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._apply_pending()
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # Stores --------------------------------------------------------------------

    def reserve(self, key: bytes, size: int, temp_path: str) -> tuple[int | None, list[bytes]]:
        """Count a write of ``size`` bytes to ``temp_path`` before it starts.

        Evicts least recently used chunks (unlinking their files) until it
        fits. Returns the reservation's id, or ``None`` when writes in flight
        leave no room, and the keys evicted either way.
        """
        with self._change() as db:
            if time.monotonic() - self._last_dead_check > DEAD_WRITES_EVERY_S:
                self._clear_dead_writes(db)
            victims = self._evict(db, self._used(db) + size - self.max_bytes)
            if self._used(db) + size > self.max_bytes and self._clear_dead_writes(db):
                victims += self._evict(db, self._used(db) + size - self.max_bytes)
            if self._used(db) + size > self.max_bytes:
                return None, victims
            cursor = db.execute(
                "INSERT INTO writes (key, size, temp, host, pid, started) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (key, size, temp_path, HOST, os.getpid(), self._clock()),
            )
            return cursor.lastrowid, victims

    def commit(self, write: int, key: bytes, size: int) -> None:
        """The write renamed its file into place: it is now a chunk, just used."""
        with self._change() as db:
            db.execute("DELETE FROM writes WHERE id = ?", (write,))
            db.execute(_PUT_CHUNK, (key, size, self._clock()))

    def release(self, write: int) -> None:
        """The write failed and its temp file is gone."""
        with self._change() as db:
            db.execute("DELETE FROM writes WHERE id = ?", (write,))

    # Loads ---------------------------------------------------------------------

    def touch(self, key: bytes) -> None:
        """Record a use of ``key``; written with the next change, or by this
        call once stamps have waited :data:`STAMP_FLUSH_S` or pile up."""
        with self._pending_lock:
            self._stamps[key] = self._clock()
            due = (
                len(self._stamps) >= STAMP_FLUSH_COUNT
                or time.monotonic() - self._last_flush > STAMP_FLUSH_S
            )
        if due:
            self.flush()

    def forget(self, key: bytes) -> None:
        """Drop ``key``'s row at the next change if its file is gone by then
        (a load found it missing, or a corrupt file was removed)."""
        with self._pending_lock:
            self._forget.add(key)

    def flush(self) -> None:
        """Write pending use stamps and forgotten keys now."""
        with self._change():
            pass

    def _apply_pending(self) -> None:
        with self._pending_lock:
            stamps, self._stamps = self._stamps, {}
            forget, self._forget = self._forget, set()
            self._last_flush = time.monotonic()
        if stamps:
            self._db.executemany(
                "UPDATE chunks SET used = max(used, ?) WHERE key = ?",
                [(used, key) for key, used in stamps.items()],
            )
        # The check runs under the lock, and a writer renames before it
        # commits: a file that exists now keeps its row (the index never
        # under-counts); a rename after this check commits its own row.
        gone = [(k,) for k in forget if not os.path.lexists(self._chunk_path(k))]
        if gone:
            self._db.executemany("DELETE FROM chunks WHERE key = ?", gone)

    # Other processes' evictions -------------------------------------------------

    def evictions(self) -> list[bytes] | None:
        """Keys evicted by any process since the last call; ``None`` when the
        log was trimmed past them (the caller must forget what it knows)."""
        with self._mutex:
            oldest, newest = self._db.execute("SELECT min(seq), max(seq) FROM evicted").fetchone()
            if newest is None or newest <= self.evictions_seen:
                return []
            since, self.evictions_seen = self.evictions_seen, newest
            if oldest > since + 1:
                return None
            rows = self._db.execute(
                "SELECT key FROM evicted WHERE seq > ? AND seq <= ?", (since, newest)
            ).fetchall()
        return [key for (key,) in rows]

    def _last_eviction(self) -> int:
        with self._mutex:
            (newest,) = self._db.execute("SELECT max(seq) FROM evicted").fetchone()
        return int(newest or 0)

    # Restarts ------------------------------------------------------------------

    def reconcile(self, found: Iterable[ChunkFile], stopping: Callable[[], bool]) -> list[bytes]:
        """Make the index agree with a scan of the directory and the bound hold.

        Files it did not count (stored by a process without ``max_bytes``, or
        lost in a power cut) join with their mtime as last use; rows whose
        file is gone are dropped. Returns the keys evicted.
        """
        on_disk = {chunk.key: chunk for chunk in found}
        with self._mutex:
            known = {key for (key,) in self._db.execute("SELECT key FROM chunks")}
        new = [(c.key, c.size, c.mtime_ns / 1e9) for k, c in on_disk.items() if k not in known]
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
        with self._change() as db:
            self._clear_dead_writes(db)
        while not stopping():
            with self._change() as db:
                batch = self._evict(db, self._used(db) - self.max_bytes, limit=_BATCH)
            if not batch:
                break
            victims += batch
        return victims

    # Inside a change --------------------------------------------------------------

    @staticmethod
    def _used(db: sqlite3.Connection) -> int:
        (used,) = db.execute("SELECT sum(bytes) FROM totals").fetchone()
        return int(used)

    def _evict(self, db: sqlite3.Connection, need: int, limit: int | None = None) -> list[bytes]:
        """Unlink least recently used chunk files until ``need`` bytes are free
        (or ``limit`` files went), then drop their rows and log them."""
        victims: list[bytes] = []
        while need > 0 and (limit is None or len(victims) < limit):
            rows = db.execute(
                "SELECT key, size FROM chunks ORDER BY used LIMIT ? OFFSET ?", (16, len(victims))
            ).fetchall()
            if not rows:
                break
            for key, size in rows:
                self._unlink(self._chunk_path(key))
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

    def _clear_dead_writes(self, db: sqlite3.Connection) -> int:
        """Drop reservations of writers that will never finish; their temp file
        goes, and a file they renamed into place but never committed becomes
        a chunk. How many were dropped."""
        self._last_dead_check = time.monotonic()
        now = self._clock()
        dead = [
            (write, key, size, temp, started)
            for write, key, size, temp, host, pid, started in db.execute(
                "SELECT id, key, size, temp, host, pid, started FROM writes"
            )
            if abandoned(host, pid, now - started, self._abandoned_s)
        ]
        for write, key, size, temp, started in dead:
            self._unlink(temp)
            with contextlib.suppress(OSError):
                if os.lstat(self._chunk_path(key)).st_size == size:
                    db.execute(
                        "INSERT INTO chunks (key, size, used) VALUES (?, ?, ?) "
                        "ON CONFLICT (key) DO NOTHING",
                        (key, size, started),
                    )
            db.execute("DELETE FROM writes WHERE id = ?", (write,))
        return len(dead)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("fs index: cannot remove %s: %s", path, exc.strerror)

    # Reporting and closing -----------------------------------------------------

    def totals(self) -> Totals:
        """Bytes and counts of chunks and writes in flight, of all processes."""
        with self._mutex:
            rows = dict(
                (name, (nbytes, count))
                for name, nbytes, count in self._db.execute("SELECT name, bytes, count FROM totals")
            )
        return Totals(*rows["chunks"], *rows["writes"])

    def close(self) -> None:
        """Write pending stamps and close the database."""
        try:
            self.flush()
        except sqlite3.Error as exc:
            logger.warning("fs index %s: last use stamps not written: %s", self.path, exc)
        finally:
            self._db.close()
            os.close(self._lock_fd)
