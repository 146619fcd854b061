"""An example out-of-tree kvtier tier: chunks in one SQLite database file."""

from acme_kvtier.sqlite_tier import SQLiteBackend, SQLiteTier, SQLiteTierOptions

__all__ = ["SQLiteBackend", "SQLiteTier", "SQLiteTierOptions"]
