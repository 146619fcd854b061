"""The SQLite backend passes kvtier's whole tier contract, keeps its own
promises, and gets the runtime's guards without a line of its own."""

from __future__ import annotations

import sqlite3
from typing import Any, ClassVar

import numpy as np
import pytest
from acme_kvtier import SQLiteTier

from kvtier import KVCache
from kvtier.integrity import HEADER_BYTES
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.tiers import Lookup


class TestSQLiteTier(TierContractTests[SQLiteTier]):
    tier_config: ClassVar[dict[str, Any]] = {"type": "acme_sqlite", "path": "chunks.sqlite3"}
    persistent = True


def test_a_corrupt_row_is_never_served_and_is_deleted() -> None:
    harness = TierHarness[SQLiteTier](
        {"type": "acme_sqlite", "path": "chunks.sqlite3"}, small_layout()
    )
    try:
        key, other = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store([key, other], [0, 1]).success
        name = harness.tier.store_name(key)
        with sqlite3.connect("chunks.sqlite3") as db:
            (value,) = db.execute("SELECT value FROM chunks WHERE name = ?", (name,)).fetchone()
            flipped = bytes(value[:-1]) + bytes([value[-1] ^ 0xFF])
            db.execute("UPDATE chunks SET value = ? WHERE name = ?", (flipped, name))
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
    harness = TierHarness[SQLiteTier](config, layout)
    removed: list[bytes] = []
    harness.tier.removal_listeners.append(removed.extend)
    try:
        keys = harness.keys(4)
        harness.fill(range(4))
        for index in range(3):
            assert harness.store([keys[index]], [index]).success
        assert harness.load([keys[0]], [8]).success  # keys[0] is now the most recent
        assert harness.store([keys[3]], [3]).success
        assert harness.tier.stats.evictions == 1
        assert removed == [keys[1]]  # named, for the engine's KV events
        assert [harness.lookup(k) for k in keys] == [
            Lookup.HIT, Lookup.MISS, Lookup.HIT, Lookup.HIT
        ]  # fmt: skip
        with sqlite3.connect("chunks.sqlite3") as db:
            (held,) = db.execute("SELECT SUM(LENGTH(value)) FROM chunks").fetchone()
        assert 3 * layout.slot_bytes < held <= max_bytes
    finally:
        harness.close()


def test_max_bytes_below_one_value_fails_at_start() -> None:
    layout = small_layout()
    one_value = TierHarness[SQLiteTier]({"type": "acme_sqlite", "path": "a.sqlite3"}, layout)
    value_bytes = one_value.tier.value_bytes
    one_value.close()
    config = {"type": "acme_sqlite", "path": "b.sqlite3", "max_bytes": value_bytes - 1}
    with pytest.raises(
        ValueError,
        match=f"acme_sqlite: max_bytes={value_bytes - 1} cannot hold one value of {value_bytes}",
    ):
        TierHarness(config, layout)


def test_an_eviction_reaches_the_engines_kv_events() -> None:
    """What routers learn: the chunk the backend evicted is announced gone."""
    layout = small_layout(chunk_tokens=4)
    value_bytes = HEADER_BYTES + layout.slot_bytes
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * layout.slot_bytes,
        "secondary_tiers": [
            {"type": "acme_sqlite", "path": "chunks.sqlite3", "max_bytes": 2 * value_bytes}
        ],
    }
    told: list[tuple[str, bytes, bool]] = []
    with KVCache(config, layout) as cache:
        cache.watch_residency(
            lambda tier, keys, stored: told.extend((tier, key, stored) for key in keys)
        )
        rows = np.random.default_rng(0).integers(0, 256, (3, layout.slot_bytes), dtype=np.uint8)
        for index, row in enumerate(rows):  # one prompt a chunk: the first is the oldest
            cache.store(list(range(4 * index, 4 * index + 4)), row[None])
            cache.drain()
        keys = [cache.keys(list(range(4 * i, 4 * i + 4)))[0] for i in range(3)]
        # The third store evicted the first chunk, told before the store's own result.
        assert [(key, stored) for tier, key, stored in told if tier == "acme_sqlite"] == [
            (keys[0], True),
            (keys[1], True),
            (keys[0], False),
            (keys[2], True),
        ]
        assert cache.manager.tiers[0].stats.evictions == 1


def test_health_checks_pass_on_a_writable_directory() -> None:
    harness = TierHarness({"type": "acme_sqlite", "path": "db/chunks.sqlite3"}, small_layout())
    try:
        checks = {check.name: check for check in harness.tier.health()}
        assert set(checks) == {"backend answers"}
        assert all(check.ok for check in checks.values()), checks
    finally:
        harness.close()


def test_a_locked_database_costs_one_deadline_then_lookups_miss_without_calls() -> None:
    """Deadlines and the circuit breaker come with the runtime: the backend
    wrote none of them, and its SQLite call waits for the lock far longer."""
    config = {
        "type": "acme_sqlite",
        "path": "chunks.sqlite3",
        "deadline_s": 0.5,
        "breaker_backoff_s": 60,
        "breaker_max_backoff_s": 60,
    }
    harness = TierHarness[SQLiteTier](config, small_layout())
    locker = sqlite3.connect("chunks.sqlite3", timeout=0)
    try:
        key, other = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store([key], [0]).success
        locker.execute("BEGIN EXCLUSIVE")  # no other connection may read or write now
        assert not harness.store([other], [1]).success  # answered at its deadline
        assert harness.tier.stats.deadline_misses == 1
        assert harness.tier.backend_down
        assert harness.lookup(key) is Lookup.MISS  # answered without asking SQLite
        assert harness.tier.stats.outage_skipped_lookups >= 1
    finally:
        locker.close()
        harness.close()


def test_a_backend_class_is_named_in_configuration_like_a_tier() -> None:
    config = {
        "type": "SQLiteBackend",
        "module_path": "acme_kvtier.sqlite_tier",
        "path": "chunks.sqlite3",
    }
    harness = TierHarness(config, small_layout())
    try:
        [key] = harness.keys(1)
        harness.fill([0])
        assert harness.store([key], [0]).success
        assert harness.lookup(key) is Lookup.HIT
        assert harness.tier.describe()["path"] == "chunks.sqlite3"
    finally:
        harness.close()
