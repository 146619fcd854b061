"""An example out-of-tree kvtier tier: chunks in one SQLite database file."""

from acme_kvtier.sqlite_tier import SQLiteTier, SQLiteTierOptions

__all__ = ["SQLiteTier", "SQLiteTierOptions"]
