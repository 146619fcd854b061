"""A warm start: a restarted cache brings the chunks ``fs`` used most recently
back into free CPU slots in the background, evicting nothing, and serves
them as it serves any chunk: every byte checked, a corrupt one a miss."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.specs.warm_start import WarmStart
from kvtier.testing import small_layout
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs.backend import FsBackend
from tests.support.cache_tiers import tier_at

LAYOUT = small_layout(chunk_tokens=4)
SLOT = LAYOUT.slot_bytes
PREFIX = 6  # chunks of each prefix
OLD = list(range(100, 100 + PREFIX * 4))
NEW = list(range(500, 500 + PREFIX * 4))


def config(root: Path, *, slots: int = 4 * PREFIX, warm: int = 0, **tier: Any) -> dict[str, Any]:
    return {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * SLOT,
        "warm_start_bytes": warm,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "io_threads": 4, **tier}],
    }


def prefix_data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (PREFIX, SLOT), dtype=np.uint8)


@pytest.fixture(params=["files", "shared index"])
def tier_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Recency from the files' times, or from the index that holds ``max_bytes``."""
    return {} if request.param == "files" else {"max_bytes": 64 * SLOT}


@pytest.fixture
def root(tmp_path: Path, tier_options: dict[str, Any]) -> Path:
    """An fs root holding OLD, then NEW, written by a cache that is closed;
    OLD's files are made older, as a restart finds chunks used long ago."""
    with KVCache(config(tmp_path, **tier_options), LAYOUT) as writer:
        assert writer.store(OLD, prefix_data(1)) == PREFIX
        writer.drain()
        assert writer.store(NEW, prefix_data(2)) == PREFIX
        writer.drain()
        old_files = [tier_at(writer, 0, FilesystemTier).dir.chunk_path(k) for k in writer.keys(OLD)]
    for path in old_files:
        os.utime(path, (1_000_000, 1_000_000))
    return tmp_path


def warm_start(cache: KVCache) -> WarmStart:
    (warm,) = [a for a in cache.manager.attachments if isinstance(a, WarmStart)]
    assert warm.done.wait(30), "the warm start never ended"
    return warm


def loaded(cache: KVCache, tokens: list[int]) -> np.ndarray:
    out = np.zeros((PREFIX, SLOT), dtype=np.uint8)
    assert cache.load(tokens, len(tokens), out) == len(tokens)
    return out


def test_a_restart_finds_the_most_recent_prefix_in_memory(
    root: Path, tier_options: dict[str, Any]
) -> None:
    with KVCache(config(root, warm=PREFIX * SLOT, **tier_options), LAYOUT) as cache:
        warm = warm_start(cache)
        assert warm.chunks == PREFIX
        registry = cache.metrics.registry
        assert registry.get_sample_value("kvtier_warm_start_chunks_total") == PREFIX
        assert warm.seconds is not None  # set once done
        assert registry.get_sample_value("kvtier_warm_start_seconds") == warm.seconds > 0
        primary = cache.manager.primary
        # In memory before any request asked: the newer prefix, not the older one.
        assert primary.lookup(cache.keys(NEW), count_hits=False) == PREFIX
        assert primary.lookup(cache.keys(OLD), count_hits=False) == 0
        np.testing.assert_array_equal(loaded(cache, NEW), prefix_data(2))
        assert cache.manager.tiers[0].stats.chunks_loaded == PREFIX
        # The older prefix still comes from fs on request, whole.
        assert cache.cached_prefix(OLD) == len(OLD)
        np.testing.assert_array_equal(loaded(cache, OLD), prefix_data(1))


@pytest.mark.parametrize("policy", ["leaf-lru", "lru", "arc", "s3fifo"])
def test_new_stores_evict_the_older_warmed_prefix_first(
    root: Path, tier_options: dict[str, Any], policy: str
) -> None:
    # Both prefixes warmed into a CPU tier that holds exactly them: the
    # warmed chunks keep the order they were used in, whatever the policy,
    # so a new prefix takes the older one's room.
    slots = 2 * PREFIX
    with KVCache(
        {**config(root, slots=slots, warm=slots * SLOT, **tier_options), "eviction_policy": policy},
        LAYOUT,
    ) as cache:
        assert warm_start(cache).chunks == slots
        primary = cache.manager.primary
        assert cache.store(list(range(900, 900 + 4 * PREFIX)), prefix_data(3)) == PREFIX
        assert primary.lookup(cache.keys(NEW), count_hits=False) == PREFIX
        assert primary.lookup(cache.keys(OLD), count_hits=False) == 0
        assert primary.hits == 0  # the warm start is no request's hit


def test_a_warm_start_fills_free_slots_only(
    root: Path, tier_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = threading.Event()
    real = FilesystemTier.recent_keys

    def after_the_store(self: FilesystemTier, limit: int) -> Any:
        assert stored.wait(30)
        return real(self, limit)

    monkeypatch.setattr(FilesystemTier, "recent_keys", after_the_store)
    slots = PREFIX + 2
    with KVCache(config(root, slots=slots, warm=slots * SLOT, **tier_options), LAYOUT) as cache:
        assert cache.store(list(range(900, 900 + 8)), np.ones((2, SLOT), np.uint8)) == 2
        stored.set()
        assert warm_start(cache).chunks == PREFIX
        primary = cache.manager.primary
        assert primary.evictions == 0
        assert primary.lookup(cache.keys(list(range(900, 908))), count_hits=False) == 2
        assert len(primary) == slots
        # The free slots went to the most recently used chunks.
        assert primary.lookup(cache.keys(NEW), count_hits=False) == PREFIX


def test_a_request_during_the_warm_start_gets_each_chunk_once(root: Path) -> None:
    with KVCache(config(root, warm=2 * PREFIX * SLOT), LAYOUT) as cache:
        assert cache.cached_prefix(NEW) == len(NEW)  # maybe before the warm start reached it
        np.testing.assert_array_equal(loaded(cache, NEW), prefix_data(2))
        warm_start(cache)
        np.testing.assert_array_equal(loaded(cache, OLD), prefix_data(1))
        # A chunk in flight for the warm start is waited for, never read twice.
        assert cache.manager.tiers[0].stats.chunks_loaded == 2 * PREFIX


def test_a_corrupt_chunk_is_not_warmed(root: Path) -> None:
    with KVCache(config(root), LAYOUT) as probe:
        bad = tier_at(probe, 0, FilesystemTier).dir.chunk_path(probe.keys(NEW)[2])
    with open(bad, "r+b") as file:
        file.seek(5)
        byte = file.read(1)
        file.seek(5)
        file.write(bytes([byte[0] ^ 0xFF]))
    with KVCache(config(root, warm=PREFIX * SLOT), LAYOUT) as cache:
        assert warm_start(cache).chunks == PREFIX - 1
        tier = cache.manager.tiers[0]
        assert tier.stats.corrupt_chunks == 1
        assert not os.path.exists(bad)
        # The chunks before it are served; the prefix stops at the damage.
        assert cache.cached_prefix(NEW) == 2 * 4
        out = np.zeros((PREFIX, SLOT), dtype=np.uint8)
        assert cache.load(NEW, 8, out) == 8
        np.testing.assert_array_equal(out[:2], prefix_data(2)[:2])


def test_closing_during_a_warm_start_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = list(range(2000, 2000 + 40 * 4))
    data = np.random.default_rng(3).integers(0, 256, (40, SLOT), dtype=np.uint8)
    with KVCache(config(tmp_path, slots=64), LAYOUT) as writer:
        assert writer.store(many, data) == 40
        writer.drain()
    entered, gate = threading.Event(), threading.Event()
    real = FsBackend.load_many

    def gated(self: FsBackend, *args: Any) -> Any:
        entered.set()
        assert gate.wait(30)
        return real(self, *args)

    monkeypatch.setattr(FsBackend, "load_many", gated)
    cache = KVCache(config(tmp_path, slots=64, warm=64 * SLOT), LAYOUT)
    (warm,) = [a for a in cache.manager.attachments if isinstance(a, WarmStart)]
    assert entered.wait(30)
    closing = threading.Thread(target=cache.close)
    closing.start()
    gate.set()
    closing.join(30)
    assert not closing.is_alive()
    assert warm.done.wait(30)
    # The batch in flight when the cache closed was the last one.
    assert cache.manager.tiers[0].stats.chunks_loaded <= 16 < 40


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"warm_start_bytes": 2 * 4 * PREFIX * SLOT}, "exceed cpu_bytes_to_use"),
        ({"secondary_tiers": [{"type": "memory", "max_bytes": 1 << 20}]}, "nothing to warm from"),
        ({"secondary_tiers": []}, "nothing to warm from"),
        ({"warm_start_bytes": SLOT - 1}, f"cannot hold one {SLOT}-byte chunk"),
    ],
)
def test_a_warm_start_that_cannot_work_fails_at_startup(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match="warm_start_bytes") as error:
        KVCache({**config(tmp_path, warm=SLOT), **overrides}, LAYOUT)
    assert message in str(error.value)


def test_a_configuration_built_by_hand_is_checked_at_start_too(tmp_path: Path) -> None:
    valid = load_config(config(tmp_path, warm=SLOT))
    unchecked = valid.model_copy(update={"warm_start_bytes": 10**12})  # no validation
    with pytest.raises(ConfigError, match=r"warm_start_bytes.*exceed cpu_bytes_to_use"):
        KVCache(unchecked, LAYOUT)
