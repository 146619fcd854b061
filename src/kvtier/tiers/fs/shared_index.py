"""The ``max_bytes`` bound of one namespace directory, shared by every process
of one host that uses it: an SQLite index (WAL mode) of the chunk files and
writes in flight, changed only under an ``flock``, so that the files on disk
never exceed what it counts and it never counts more than ``max_bytes``.

See docs/fs.md, 'Shared roots'.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from kvtier.tiers.fs.layout import ChunkFile, mode_kind, remove_entry, write_abandoned

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
#: First and longest pause between tries of a lock another process holds.
_LOCK_POLL_S = (20e-6, 1e-3)

# ``temp``: the temp file of the write that made the row (gone once renamed).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key BLOB PRIMARY KEY, size INTEGER NOT NULL, used REAL NOT NULL, temp TEXT) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used);
CREATE TABLE IF NOT EXISTS evicted (seq INTEGER PRIMARY KEY AUTOINCREMENT, key BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS totals (bytes INTEGER NOT NULL, count INTEGER NOT NULL);
INSERT INTO totals SELECT 0, 0 WHERE NOT EXISTS (SELECT 1 FROM totals);
CREATE TABLE IF NOT EXISTS filled (at REAL NOT NULL, directory TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS chunk_added AFTER INSERT ON chunks BEGIN
    UPDATE totals SET bytes = bytes + new.size, count = count + 1; END;
CREATE TRIGGER IF NOT EXISTS chunk_dropped AFTER DELETE ON chunks BEGIN
    UPDATE totals SET bytes = bytes - old.size, count = count - 1; END;
"""


#: Filesystems that may be mounted by several hosts, where SQLite's WAL (and
#: so the shared bound) cannot span the processes of different hosts.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "9p"}
)


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (Linux), or ``None``."""
    target = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                # id parent major:minor root mountpoint options [optional...] - type source
                fields = line.split()
                mountpoint = fields[4].replace("\\040", " ")
                inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
                if inside and len(mountpoint) >= len(best):
                    best, fstype = mountpoint, fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return None
    return fstype


_T = TypeVar("_T")


class IndexBusyError(sqlite3.OperationalError):
    """The index lock stayed taken by another process for longer than the
    timeout: that process is stopped or hung inside a change."""


def _file_id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _path_id(path: str) -> tuple[int, int] | None:
    try:
        return _file_id(os.stat(path, follow_symlinks=False))
    except OSError:
        return None


#: SQLite's primary result codes of errors that say nothing about the index's
#: state (a full disk, no access, no memory): rebuilding would only lose it.
_NOT_DAMAGE = frozenset({3, 7, 8, 13, 14})  # PERM, NOMEM, READONLY, FULL, CANTOPEN


def _not_damage(error: sqlite3.DatabaseError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _NOT_DAMAGE


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction on ``db``, rolled back if anything raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


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


def _clear_odd_entry(path: str) -> None:
    """Make room at ``path`` for a regular file: anything else there (symlink,
    FIFO, directory, device) is removed, or moved aside when that is not safe
    (a directory with something in it). Raises ``OSError`` naming the path
    when neither works."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kind = mode_kind(mode)
    if remove_entry(path):
        logger.warning("fs index: removed %s at %s", kind, path)
        return
    aside = f"{path}.{secrets.token_hex(4)}.moved-aside"
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise OSError(
            exc.errno, f"fs index: {kind} at {path} can be neither removed nor moved aside"
        ) from exc
    logger.warning("fs index: moved %s at %s to %s", kind, path, aside)


@dataclass
class _Queued(Generic[_T]):
    """A change waiting for a transaction; ``result`` or ``error`` once done."""

    change: Callable[[sqlite3.Connection], _T]
    done: bool = False
    result: _T | None = None
    error: BaseException | None = None


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
        self._lock_path = os.path.join(directory, LOCK_FILE)
        self._chunk_path = chunk_path
        self._abandoned_s = abandoned_s
        self._scan = scan
        self._lock_timeout_s = lock_timeout_s
        self._clock = clock
        self._mutex = threading.Lock()
        self._batch_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._queued: list[_Queued[Any]] = []
        self._stamps: dict[bytes, float] = {}
        self._forget: set[bytes] = set()
        self._done: dict[bytes, str] = {}
        self._last_flush = time.monotonic()
        self._db: sqlite3.Connection | None = None
        self._db_id: tuple[int, int] | None = None
        self._reopened = False
        self._lock_fd = self._open_lock()
        try:
            with self._flock():  # opens the index
                pass
        except BaseException:
            if self._db is not None:
                self._db.close()
            os.close(self._lock_fd)
            raise
        self._reopened = False
        self.evictions_seen = self._last_eviction()

    @property
    def _index(self) -> sqlite3.Connection:
        assert self._db is not None, "opened by the constructor"
        return self._db

    def _open_lock(self) -> int:
        """Open (creating) the lock file, never through a symlink, making room
        for it if something else is at its path."""
        os.makedirs(self._directory, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        for attempt in (1, 2):
            try:
                fd = os.open(self._lock_path, flags, 0o644)
            except OSError:
                if attempt == 2:
                    raise
                _clear_odd_entry(self._lock_path)
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            _clear_odd_entry(self._lock_path)
        raise OSError(f"fs index: cannot make a lock file at {self._lock_path}")

    def _open_index(self) -> None:
        """Under the lock: (re)open the index at :attr:`path`, rebuilding it if
        it is damaged and filling it from a scan if it never was."""
        if self._db is not None:
            logger.warning("fs index %s was replaced or removed: opening it again", self.path)
        for suffix in ("", "-wal", "-shm"):
            _clear_odd_entry(self.path + suffix)  # SQLite would follow a link, block on a FIFO
        try:
            db = self._connect()
        except sqlite3.DatabaseError as exc:
            if _not_damage(exc):
                raise  # the index is kept: other processes use it
            # Only an index: what it knew is rebuilt from a scan of the files.
            logger.warning("fs index %s unusable (%s): starting a new one", self.path, exc)
            for suffix in ("", "-wal", "-shm"):
                remove_entry(self.path + suffix)
            db = self._connect()
        try:
            db_id = _path_id(self.path)
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
        with _immediate(db):
            db.executemany(
                "INSERT INTO chunks (key, size, used) VALUES (?, ?, ?) "
                "ON CONFLICT (key) DO NOTHING",
                rows,
            )
            db.execute("INSERT INTO filled (at, directory) VALUES (?, ?)", (now, directory))

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.path, timeout=self._lock_timeout_s, isolation_level=None, check_same_thread=False
        )
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
    def _flock(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the lock, on the lock file and index that are there now;
        wait at most ``timeout_s`` (the lock timeout if ``None``)."""
        deadline = time.monotonic() + (self._lock_timeout_s if timeout_s is None else timeout_s)
        while True:
            self._lock_until(deadline)
            if _path_id(self._lock_path) == _file_id(os.fstat(self._lock_fd)):
                break
            # Removed or replaced: a lock on a file no one else opens excludes no one.
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = self._open_lock()
        try:
            if self._db is None or _path_id(self.path) != self._db_id:
                self._open_index()
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _lock_until(self, deadline: float) -> None:
        """Take the lock, or raise :class:`IndexBusyError` at ``deadline``. A
        blocking ``flock`` cannot be given up, so a taken lock is tried again
        after short, growing pauses."""
        pause, longest = _LOCK_POLL_S
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise IndexBusyError(
                    f"fs index lock {self._lock_path} held by another process for more "
                    f"than {self._lock_timeout_s} s"
                )
            time.sleep(min(pause, left))
            pause = min(2 * pause, longest)

    @contextlib.contextmanager
    def _change(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, alone among threads and processes; pending
        use stamps and forgotten keys go in with it."""
        with self._mutex, self._flock(), self._transaction() as db:
            yield db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """Under the lock: one transaction, which pending changes go in with."""
        with _immediate(self._index) as db:
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
        return self._batched(lambda db: self._reserve_one(db, key, size, temp_path))

    def written(self, key: bytes, temp_path: str) -> None:
        """The write to ``temp_path`` renamed its file into place: its row is
        a chunk's now, no longer a write in flight. Recorded in memory and
        written with the next change (see docs/fs.md, 'Shared roots')."""
        with self._pending_lock:
            self._done[key] = temp_path

    def _batched(self, change: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``change`` in a transaction. Group commit: whoever gets the lock
        first runs every change queued by then in one transaction, so threads
        storing at once share it."""
        request: _Queued[_T] = _Queued(change)
        with self._pending_lock:
            self._queued.append(request)
        with self._batch_lock:
            if not request.done:
                with self._pending_lock:
                    batch, self._queued = self._queued, []
                try:
                    with self._change() as db:
                        for queued in batch:
                            queued.result = queued.change(db)
                except BaseException as exc:
                    for queued in batch:  # rolled back: none of them holds
                        queued.error = exc
                for queued in batch:
                    queued.done = True
        if request.error is not None:
            raise request.error
        # Done without an error: the change returned its result (None is a result too).
        return cast(_T, request.result)

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
            os.close(self._lock_fd)
