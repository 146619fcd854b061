"""``acme_sqlite``: kvtier chunks in one SQLite database file.

A complete out-of-tree tier in about two hundred lines. It builds on
:class:`kvtier.ThreadedTier`, so it writes plain blocking code and kvtier runs
it on worker threads; it frames every chunk with kvtier's integrity header,
so a corrupt or foreign row is never served. It is bounded (least recently
used rows go first), survives restarts, and reports health checks and an
extra metric.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ByteSize, Field

from kvtier import integrity
from kvtier.keys import ChunkKey
from kvtier.tiers import HealthCheck, ThreadedTier, TierMetric, TierOptions
from kvtier.tiers.threaded import ThreadedTierOptions

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key BLOB PRIMARY KEY,
    value BLOB NOT NULL,
    size INTEGER NOT NULL,
    used INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used);
"""


class SQLiteTierOptions(ThreadedTierOptions):
    path: Path
    """SQLite database file holding the chunks; created (with its directory) if missing."""

    max_bytes: ByteSize | None = Field(default=None, gt=0)
    """Bound on the bytes of stored chunks; least recently used ones are deleted
    beyond it. Unset: no bound."""

    io_threads: int = Field(default=2, ge=1, le=16)
    """Worker threads; SQLite serialises writers, so a few are plenty."""

    busy_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds a worker waits for another writer's lock before the chunk fails."""


class SQLiteTier(ThreadedTier[SQLiteTierOptions]):
    """Chunks as rows of one SQLite table, framed with kvtier's integrity header."""

    Options: ClassVar[type[TierOptions]] = SQLiteTierOptions
    # One existence query answers many keys.
    check_batch: ClassVar[int] = 256

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = self.options
        self.path = options.path.expanduser()
        self.max_bytes = None if options.max_bytes is None else int(options.max_bytes)
        self.busy_timeout_s = options.busy_timeout_s
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = self._db()
        db.executescript(_SCHEMA)
        db.execute("PRAGMA journal_mode=WAL")
        (held,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks").fetchone()
        self._held_bytes = int(held)

    def _db(self) -> sqlite3.Connection:
        """This thread's connection (SQLite connections are not shared between threads)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout_s,
                isolation_level=None,  # autocommit; explicit BEGIN where it matters
                check_same_thread=False,  # closed by shutdown, from another thread
            )
            self._local.db = db
            with self._connections_lock:
                self._connections.append(db)
        return db

    # ThreadedTier hooks: blocking, on worker threads ------------------------

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        marks = ",".join("?" * len(keys))
        rows = self._db().execute(f"SELECT key FROM chunks WHERE key IN ({marks})", list(keys))
        present = {bytes(key) for (key,) in rows}
        return [bytes(key) in present for key in keys]

    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        value = integrity.frame(self.namespace, key, payload)
        if self.max_bytes is not None and len(value) > self.max_bytes:
            raise ValueError(f"a {len(value)}-byte chunk exceeds max_bytes={self.max_bytes}")
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            old = db.execute("SELECT size FROM chunks WHERE key = ?", (key,)).fetchone()
            db.execute(
                "INSERT OR REPLACE INTO chunks (key, value, size, used) VALUES (?, ?, ?, ?)",
                (key, value, len(value), time.time_ns()),
            )
            grown = len(value) - (old[0] if old else 0)
            evicted, freed = self._evict(db, key, self._held_bytes + grown)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        with self._connections_lock:
            self._held_bytes += grown - freed
        if evicted:
            self.count(evictions=evicted)

    def _evict(self, db: sqlite3.Connection, keep: ChunkKey, held: int) -> tuple[int, int]:
        """Delete least recently used rows until ``held`` fits; returns (rows, bytes)."""
        if self.max_bytes is None or held <= self.max_bytes:
            return 0, 0
        evicted = freed = 0
        victims = db.execute("SELECT key, size FROM chunks WHERE key != ? ORDER BY used", (keep,))
        for victim, size in victims.fetchall():
            if held - freed <= self.max_bytes:
                break
            db.execute("DELETE FROM chunks WHERE key = ?", (victim,))
            evicted += 1
            freed += size
        return evicted, freed

    def _load_chunk(self, key: ChunkKey, out: memoryview) -> None:
        db = self._db()
        row = db.execute("SELECT value FROM chunks WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise KeyError("chunk not in the database")
        # Raises CorruptChunkError before touching ``out`` if the row is bad;
        # ThreadedTier then counts it and calls _discard.
        integrity.unframe_into(row[0], out, namespace=self.namespace, key=key)
        db.execute("UPDATE chunks SET used = ? WHERE key = ?", (time.time_ns(), key))

    def _discard(self, key: ChunkKey) -> None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT size FROM chunks WHERE key = ?", (key,)).fetchone()
            db.execute("DELETE FROM chunks WHERE key = ?", (key,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if row is not None:
            with self._connections_lock:
                self._held_bytes -= row[0]

    def _close(self) -> None:
        with self._connections_lock:
            for db in self._connections:
                db.close()
            self._connections.clear()

    # Optional hooks -----------------------------------------------------------

    def health(self) -> Sequence[HealthCheck]:
        directory = self.path.parent
        writable = os.access(directory, os.W_OK)
        free = shutil.disk_usage(directory).free
        try:
            (verdict,) = self._db().execute("PRAGMA quick_check").fetchone()
        except sqlite3.Error as exc:
            verdict = f"{type(exc).__name__}: {exc}"
        return (
            HealthCheck(
                "writable", writable, f"{directory} is {'' if writable else 'not '}writable"
            ),
            HealthCheck("free space", free > 0, f"{free / 2**30:.1f} GiB free in {directory}"),
            HealthCheck("database", verdict == "ok", f"quick_check: {verdict}"),
        )

    def metrics(self) -> Sequence[TierMetric]:
        return (TierMetric("sqlite_held_bytes", self._held_bytes, "Bytes of stored chunk rows."),)

    def describe(self) -> dict[str, object]:
        return {"type": self.tier_type, "path": str(self.path), "max_bytes": self.max_bytes}
