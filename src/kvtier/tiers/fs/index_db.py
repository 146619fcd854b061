"""The SQLite database of a shared index: its schema, how it is opened (and
rebuilt when damaged), and its write transactions."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterator

from kvtier.tiers.fs.layout import clear_odd_entry, remove_entry

logger = logging.getLogger(__name__)

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

#: SQLite's primary result codes of errors that say nothing about the index's
#: state (a full disk, no access, no memory): rebuilding would only lose it.
_NOT_DAMAGE = frozenset({3, 7, 8, 13, 14})  # PERM, NOMEM, READONLY, FULL, CANTOPEN

_FILES = ("", "-wal", "-shm")


def _not_damage(error: sqlite3.DatabaseError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _NOT_DAMAGE


def open_index_db(path: str, timeout_s: float) -> sqlite3.Connection:
    """Under the index lock: open the database at ``path``, creating it, or
    starting a new one when it is damaged (only an index: what it knew is
    rebuilt from a scan of the files)."""
    for suffix in _FILES:
        clear_odd_entry(path + suffix)  # SQLite would follow a link, block on a FIFO
    try:
        return _connect(path, timeout_s)
    except sqlite3.DatabaseError as exc:
        if _not_damage(exc):
            raise  # the index is kept: other processes use it
        logger.warning("fs index %s unusable (%s): starting a new one", path, exc)
        for suffix in _FILES:
            remove_entry(path + suffix)
        return _connect(path, timeout_s)


def _connect(path: str, timeout_s: float) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
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
def immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction on ``db``, rolled back if anything raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
