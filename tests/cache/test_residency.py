"""The residency feed: every tier's stores and removals, in order, for observers."""

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.integrity import HEADER_BYTES
from kvtier.keys import ChunkKey
from kvtier.residency import ResidencyFeed, tier_names
from kvtier.testing import small_layout
from kvtier.tiers.memory import MemoryTier
from tests.support.cache_tiers import tier_at

LAYOUT = small_layout(chunk_tokens=4)
FRAMED = HEADER_BYTES + LAYOUT.slot_bytes


class Changes:
    """What a listener was told: ``(tier, key, stored)`` per key, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ChunkKey, bool]] = []

    def __call__(self, tier: str, keys: Sequence[ChunkKey], stored: bool) -> None:
        self.seen.extend((tier, key, stored) for key in keys)

    def of(self, tier: str) -> list[tuple[ChunkKey, bool]]:
        return [(key, stored) for name, key, stored in self.seen if name == tier]

    def held(self, tier: str) -> set[ChunkKey]:
        """The keys ``tier`` holds according to what was told."""
        held: set[ChunkKey] = set()
        for key, stored in self.of(tier):
            (held.add if stored else held.discard)(key)
        return held


def make_cache(*tiers: dict[str, Any], slots: int = 8) -> tuple[KVCache, Changes]:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * LAYOUT.slot_bytes,
        "secondary_tiers": list(tiers),
    }
    cache = KVCache(config, LAYOUT)
    changes = Changes()
    cache.manager.residency.add_listener(changes)
    return cache, changes


def chunks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.slot_bytes), dtype=np.uint8)


@pytest.fixture
def two_tiers() -> Iterator[tuple[KVCache, Changes]]:
    cache, changes = make_cache(
        {"type": "memory", "max_bytes": 3 * FRAMED, "io_threads": 1},
        {"type": "memory"},
    )
    yield cache, changes
    cache.close()


def test_names_are_types_numbered_only_where_a_type_repeats() -> None:
    assert tier_names(["fs", "redis", "fs", "obj"]) == ["fs:1", "redis", "fs:2", "obj"]


def test_every_tier_announces_the_chunks_it_stores(two_tiers: tuple[KVCache, Changes]) -> None:
    cache, changes = two_tiers
    tokens = list(range(12))
    cache.store(tokens, chunks(3))
    keys = cache.keys(tokens)
    assert changes.of("cpu") == [(key, True) for key in keys]
    assert changes.of("memory:1") == []  # not before the tiers' jobs end
    cache.drain()
    assert changes.held("memory:1") == changes.held("memory:2") == set(keys)


def test_evictions_from_the_primary_and_a_secondary_tier_are_removals(
    two_tiers: tuple[KVCache, Changes],
) -> None:
    cache, changes = two_tiers
    first, second, third = list(range(16)), list(range(100, 116)), list(range(200, 208))
    cache.store(first, chunks(4, 1))
    cache.drain()
    cache.store(second, chunks(4, 2))  # fills the 8 slots
    cache.drain()
    cache.store(third, chunks(2, 3))  # evicts two of the first prompt's chunks
    cache.drain()
    resident = set(cache.manager.primary.slots())
    assert changes.held("cpu") == resident
    assert {key for key, stored in changes.of("cpu") if not stored} == set(cache.keys(first)[:2])
    # The 3-chunk tier keeps the last three chunks it was given.
    last_three = set((cache.keys(second) + cache.keys(third))[-3:])
    assert changes.held("memory:1") == last_three
    assert cache.manager.tiers[0].stats.evictions == 7
    every = set(cache.keys(first) + cache.keys(second) + cache.keys(third))
    assert changes.held("memory:2") == every


def test_a_tier_that_evicts_a_chunk_before_its_job_ends_never_announces_it() -> None:
    """One job larger than the tier: its first chunks are gone before the result."""
    cache, changes = make_cache({"type": "memory", "max_bytes": 2 * FRAMED, "io_threads": 1})
    try:
        tokens = list(range(16))
        cache.store(tokens, chunks(4))
        cache.drain()
        keys = cache.keys(tokens)
        assert changes.held("memory") == set(keys[2:])
        # Nothing stale either way: every stored chunk announced was held then.
        assert [key for key, stored in changes.of("memory") if stored] == keys[2:]
    finally:
        cache.close()


def test_a_corrupt_chunk_deleted_and_a_chunk_found_gone_are_removals() -> None:
    cache, changes = make_cache({"type": "memory", "io_threads": 1}, slots=4)
    try:
        tokens = list(range(8))
        cache.store(tokens, chunks(2))
        cache.drain()
        keys = cache.keys(tokens)
        cache.manager.reset()  # empties the primary tier: removals there
        assert changes.held("cpu") == set()
        tier = tier_at(cache, 0, MemoryTier)
        tier.backend.corrupt_for_tests(keys[1])
        assert cache.cached_prefix(tokens, timeout=5) == 4  # the corrupt chunk is a miss
        assert changes.held("memory") == {keys[0]}
        cache.manager.reset()
        failures = tier.stats.load_failures
        assert cache.manager.lookup(keys, "r").pending  # a promotion, submitted next step
        tier.discard([keys[0]])  # gone behind the tier's back
        cache.drain()
        assert tier.stats.load_failures == failures  # a miss: found gone
        assert changes.held("memory") == set()
    finally:
        cache.close()


def test_no_listener_no_followed_stores_and_a_raising_listener_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    feed = ResidencyFeed(["fs"])
    assert feed.job_started(0, [ChunkKey(b"k" * 16)]) is False

    def broken(tier: str, keys: Sequence[ChunkKey], stored: bool) -> None:
        raise RuntimeError("listener down")

    changes = Changes()
    feed.add_listener(broken)
    feed.add_listener(changes)
    key = ChunkKey(b"k" * 16)
    assert feed.job_started(0, [key])
    feed.job_ended(0, [key], [key])
    assert changes.of("fs") == [(key, True)]
    assert "listener down" in caplog.text


def test_a_chunk_read_from_a_tier_is_announced_there_though_stored_unseen() -> None:
    """Chunks a tier held before anyone listened (an earlier engine's) are
    announced once a promotion reads them."""
    cache, changes = make_cache({"type": "memory", "io_threads": 1}, slots=4)
    try:
        tokens = list(range(8))
        cache.manager.residency.remove_listener(changes)
        cache.store(tokens, chunks(2))
        cache.drain()
        cache.manager.reset()
        cache.manager.residency.add_listener(changes)
        assert cache.cached_prefix(tokens, timeout=5) == 8
        keys = cache.keys(tokens)
        assert changes.held("memory") == set(keys) == changes.held("cpu")
    finally:
        cache.close()


def test_the_feed_watches_the_primary_tier_only_while_someone_listens() -> None:
    """Unheard, a store or an eviction calls nothing; a listener hears the
    primary tier from the moment it is added until it is removed."""
    with KVCache({"chunk_tokens": 4, "cpu_bytes_to_use": 2 * LAYOUT.slot_bytes}, LAYOUT) as cache:
        primary, feed = cache.manager.primary, cache.manager.residency
        assert primary.watchers == []
        cache.store(list(range(4)), chunks(1))
        changes = Changes()
        cache.watch_residency(changes)
        assert primary.watchers == [feed.primary_changed]
        assert feed.listeners == (changes,)
        cache.store(list(range(8)), chunks(2))  # one new chunk, ready
        cache.store(list(range(100, 104)), chunks(1))  # evicts one of the two
        [added] = cache.keys(list(range(8)))[1:]
        assert changes.of("cpu")[0] == (added, True)
        assert [stored for _, stored in changes.of("cpu")] == [True, False, True]
        feed.remove_listener(changes)
        assert primary.watchers == [] and feed.listeners == ()
        told = len(changes.seen)
        cache.store(list(range(200, 208)), chunks(2))
        assert len(changes.seen) == told
        with pytest.raises(ValueError):
            feed.remove_listener(changes)
