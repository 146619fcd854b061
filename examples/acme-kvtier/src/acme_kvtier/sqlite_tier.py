"""``acme_sqlite``: kvtier chunks in one SQLite database file, as a kvtier
:class:`~kvtier.tiers.backend.Backend`: a few blocking, batched calls. kvtier's
remote-tier runtime adds the worker threads, checksummed framing, deadlines,
the circuit breaker and the existence-check cache.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from pydantic import ByteSize, Field

from kvtier.tiers.backend import (
    Backend,
    BackendRuntime,
    Exists,
    Fetched,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.base import TierMetric
from kvtier.tiers.remote import RemoteTier

_SCHEMA = "CREATE TABLE IF NOT EXISTS chunks (name TEXT PRIMARY KEY, value BLOB, used INTEGER)"


class SQLiteTierOptions(RemoteTierOptions):
    path: Path
    """SQLite database file holding the chunks; created (with its directory) if missing."""

    max_bytes: ByteSize | None = Field(default=None, gt=0)
    """Bound on the bytes of stored values; least recently used ones go
    beyond it. Less than one value fails at start."""

    io_threads: int = Field(default=2, ge=1, le=16)
    """Worker threads; SQLite serialises writers, so a few are plenty."""


class SQLiteBackend(Backend[SQLiteTierOptions]):
    """Chunks as rows of one table, a batch per transaction."""

    Options: ClassVar[type[RemoteTierOptions]] = SQLiteTierOptions
    io_batch: ClassVar[int] = 8
    variable_payloads: ClassVar[bool] = True  # a row holds a value of any length

    def __init__(self, options: SQLiteTierOptions, runtime: BackendRuntime) -> None:
        super().__init__(options, runtime)
        runtime.require_room(None if options.max_bytes is None else int(options.max_bytes))
        self.path = options.path.expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._db().execute(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        """This thread's connection (a connection serves one thread at a time)."""
        if not hasattr(self._local, "db"):
            self._local.db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
            self._connections.append(self._local.db)
        db: sqlite3.Connection = self._local.db
        return db

    def exists_many(self, names: Sequence[str]) -> list[Exists]:
        marks = ",".join("?" * len(names))
        rows = self._db().execute(f"SELECT name FROM chunks WHERE name IN ({marks})", names)
        held = {name for (name,) in rows}
        return [name in held for name in names]

    def get_many(self, names: Sequence[str]) -> list[Fetched]:
        with self._db() as db:  # a transaction: values read and marked used together
            query = "UPDATE chunks SET used = ? WHERE name = ? RETURNING value"
            rows = [db.execute(query, (time.time_ns(), name)).fetchone() for name in names]
        return [None if row is None else row[0] for row in rows]

    def put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        evicted: list[str] = []
        with self._db() as db:
            now = time.time_ns()
            rows = [(name, bytes(value), now) for name, value in zip(names, values, strict=True)]
            db.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?)", rows)
            if self.options.max_bytes is not None:
                evicted = self._evict(db, int(self.options.max_bytes))
        if evicted:  # once committed: routers then learn the chunks are gone
            self.runtime.count(evictions=len(evicted))
            self.runtime.report_removed(evicted)
        return [None] * len(names)

    def _evict(self, db: sqlite3.Connection, max_bytes: int) -> list[str]:
        """Delete least recently used rows until the values fit in ``max_bytes``;
        the names deleted."""
        (held,) = db.execute("SELECT COALESCE(SUM(LENGTH(value)), 0) FROM chunks").fetchone()
        evicted = []
        for name, size in db.execute(
            "SELECT name, LENGTH(value) FROM chunks ORDER BY used"
        ).fetchall():
            if held <= max_bytes:
                break
            db.execute("DELETE FROM chunks WHERE name = ?", (name,))
            held -= size
            evicted.append(name)
        return evicted

    def delete(self, name: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM chunks WHERE name = ?", (name,))

    def ping(self) -> None:
        self._db().execute("SELECT 1 FROM chunks LIMIT 1")

    def close(self) -> None:
        for db in self._connections:
            db.close()

    def describe(self) -> dict[str, object]:
        return {"path": str(self.path), "max_bytes": self.options.max_bytes}

    def metrics(self) -> Sequence[TierMetric]:
        (held,) = (
            self._db().execute("SELECT COALESCE(SUM(LENGTH(value)), 0) FROM chunks").fetchone()
        )
        return (TierMetric("sqlite_held_bytes", held, "Bytes of stored values."),)


class SQLiteTier(RemoteTier[SQLiteTierOptions]):
    """The tier class of :class:`SQLiteBackend`, for type hints (``TierHarness[SQLiteTier]``)."""

    backend_class = SQLiteBackend
