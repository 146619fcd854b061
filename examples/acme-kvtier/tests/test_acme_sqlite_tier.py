"""The SQLite tier passes kvtier's whole tier contract, and keeps its own promises."""

from __future__ import annotations

import sqlite3
from typing import Any, ClassVar

from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.tiers import Lookup


class TestSQLiteTier(TierContractTests):
    tier_config: ClassVar[dict[str, Any]] = {"type": "acme_sqlite", "path": "chunks.sqlite3"}
    persistent = True


def test_a_corrupt_row_is_never_served_and_is_deleted() -> None:
    harness = TierHarness({"type": "acme_sqlite", "path": "chunks.sqlite3"}, small_layout())
    try:
        key, other = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store([key, other], [0, 1]).success
        with sqlite3.connect("chunks.sqlite3") as db:
            (value,) = db.execute("SELECT value FROM chunks WHERE key = ?", (key,)).fetchone()
            flipped = bytes(value[:-1]) + bytes([value[-1] ^ 0xFF])
            db.execute("UPDATE chunks SET value = ? WHERE key = ?", (flipped, key))
        harness.buffer.array[2] = 0
        result = harness.load([key], [2])
        assert not result.success
        assert not harness.buffer.array[2].any()  # the slot never saw the bad bytes
        assert harness.tier.stats.corrupt_chunks == 1
        assert harness.lookup(key) is Lookup.MISS
        assert harness.lookup(other) is Lookup.HIT
    finally:
        harness.close()


def test_max_bytes_evicts_least_recently_used_rows() -> None:
    layout = small_layout()
    # Room for three framed chunks, not four.
    max_bytes = 3 * layout.slot_bytes + 1000
    config = {"type": "acme_sqlite", "path": "chunks.sqlite3", "max_bytes": max_bytes}
    harness = TierHarness(config, layout)
    try:
        keys = harness.keys(4)
        harness.fill(range(4))
        for index in range(3):
            assert harness.store([keys[index]], [index]).success
        assert harness.load([keys[0]], [8]).success  # keys[0] is now the most recent
        assert harness.store([keys[3]], [3]).success
        assert harness.tier.stats.evictions == 1
        assert [harness.lookup(k) for k in keys] == [
            Lookup.HIT, Lookup.MISS, Lookup.HIT, Lookup.HIT
        ]  # fmt: skip
        held = {m.name: m.value for m in harness.tier.metrics()}["sqlite_held_bytes"]
        assert 3 * layout.slot_bytes < held <= max_bytes
    finally:
        harness.close()


def test_health_checks_pass_on_a_writable_directory() -> None:
    harness = TierHarness({"type": "acme_sqlite", "path": "db/chunks.sqlite3"}, small_layout())
    try:
        checks = {check.name: check for check in harness.tier.health()}
        assert set(checks) == {"writable", "free space", "database"}
        assert all(check.ok for check in checks.values()), checks
    finally:
        harness.close()
