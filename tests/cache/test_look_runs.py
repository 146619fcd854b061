"""A look asks the first tier about a run of keys in one call
(``lookup_run``) and reserves a run of its hits at once: the answers, the
counts and the promotions are those of asking key by key."""

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, LookupResult, register_tier
from kvtier.keys import ChunkKey
from kvtier.manager import LOOK_RUN
from kvtier.testing import small_layout
from kvtier.tiers.base import Lookup, LookupContext
from kvtier.tiers.memory import MemoryTier
from tests.support.cache_tiers import tier_at

LAYOUT = small_layout(chunk_tokens=4)


class KeyByKeyTier(MemoryTier):
    """A memory tier with a lookup of its own, counting the keys it is asked about."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[ChunkKey] = []

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        self.asked.append(key)
        return super().lookup(key, ctx)


@pytest.fixture(autouse=True)
def key_by_key(registries: None) -> None:
    register_tier("key-by-key", "tests.cache.test_look_runs", "KeyByKeyTier")


def make_cache(*tiers: dict[str, Any], slots: int) -> KVCache:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * LAYOUT.slot_bytes,
        "secondary_tiers": list(tiers),
    }
    return KVCache(config, LAYOUT)


def prompt(chunks: int) -> tuple[list[int], np.ndarray]:
    tokens = list(range(1000, 1000 + 4 * chunks))
    data = np.random.default_rng(chunks).integers(0, 256, (chunks, LAYOUT.slot_bytes), np.uint8)
    return tokens, data


def stored_only_in_tiers(cache: KVCache, tokens: list[int], data: np.ndarray) -> list[ChunkKey]:
    """Store through to every tier, then empty the primary tier."""
    assert cache.store(tokens, data) == len(data)
    cache.drain()
    cache.manager.reset()
    return cache.keys(tokens)


def peek(cache: KVCache, tokens: list[int]) -> LookupResult:
    return cache.manager.lookup(cache.keys(tokens), "r")


def loaded(cache: KVCache, tokens: list[int], data: np.ndarray, chunks: int) -> None:
    """The first ``chunks`` chunks are served, byte for byte."""
    out = np.zeros_like(data)
    assert cache.load(tokens, 4 * chunks, out[:chunks]) == 4 * chunks
    np.testing.assert_array_equal(out[:chunks], data[:chunks])


def spy(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple[Any, ...]]:
    """Record the positional arguments of each call of ``owner.name``."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


@pytest.fixture
def long_prefix() -> Iterator[tuple[KVCache, list[int], np.ndarray]]:
    chunks = 150
    tokens, data = prompt(chunks)
    cache = make_cache({"type": "memory"}, slots=chunks + 8)
    stored_only_in_tiers(cache, tokens, data)
    yield cache, tokens, data
    cache.close()


def test_a_long_prefix_is_asked_in_growing_runs_and_reserved_a_run_at_a_time(
    long_prefix: tuple[KVCache, list[int], np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, tokens, data = long_prefix
    tier = cache.manager.tiers[0]
    runs = spy(monkeypatch, tier, "lookup_run")
    reservations = spy(monkeypatch, cache.manager.primary, "prepare_store")
    assert peek(cache, tokens) == LookupResult(0, True)
    sizes = [4, 8, 16, 32, LOOK_RUN, 150 - 124]
    assert [len(keys) for keys, _ in runs] == sizes
    assert [ctx.index for _, ctx in runs] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert [len(keys) for keys, *_ in reservations] == sizes
    # Counted as key by key: one lookup and one hit a chunk.
    chunks = len(data)
    assert (tier.stats.lookups, tier.stats.hits, tier.stats.misses) == (chunks, chunks, 0)
    cache.drain()
    assert peek(cache, tokens) == LookupResult(chunks, False)
    loaded(cache, tokens, data, chunks)


def test_a_look_stops_at_the_first_chunk_no_tier_holds() -> None:
    tokens, data = prompt(20)
    cache = make_cache({"type": "memory"}, slots=24)
    try:
        keys = stored_only_in_tiers(cache, tokens, data)
        tier = cache.manager.tiers[0]
        tier.discard(keys[10:12])
        assert peek(cache, tokens) == LookupResult(0, True)
        # Asked up to the miss and no further; nothing reserved past it.
        assert (tier.stats.lookups, tier.stats.hits, tier.stats.misses) == (11, 10, 1)
        assert not any(cache.manager.primary.is_writing(key) for key in keys[10:])
        cache.drain()
        assert peek(cache, tokens).hit_chunks == 10
        loaded(cache, tokens, data, 10)
    finally:
        cache.close()


def test_the_first_tiers_miss_is_asked_of_the_next_and_its_run_goes_on() -> None:
    tokens, data = prompt(12)
    cache = make_cache({"type": "memory"}, {"type": "memory"}, slots=16)
    try:
        keys = stored_only_in_tiers(cache, tokens, data)
        first, second = cache.manager.tiers
        first.discard([keys[5]])
        assert peek(cache, tokens) == LookupResult(0, True)
        assert (first.stats.lookups, first.stats.hits, first.stats.misses) == (12, 11, 1)
        assert (second.stats.lookups, second.stats.hits) == (1, 1)
        cache.drain()
        assert (first.stats.chunks_loaded, second.stats.chunks_loaded) == (11, 1)
        assert peek(cache, tokens).hit_chunks == 12
        loaded(cache, tokens, data, 12)
    finally:
        cache.close()


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(RuntimeError("injected"), id="raises"),
        pytest.param([], id="no-answer"),
        pytest.param([Lookup.HIT] * (LOOK_RUN + 1), id="too-many-answers"),
    ],
)
def test_a_first_tier_whose_run_fails_costs_each_key_a_miss_and_the_next_tier_serves(
    answer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tokens, data = prompt(6)
    cache = make_cache({"type": "memory"}, {"type": "memory"}, slots=8)
    try:
        stored_only_in_tiers(cache, tokens, data)
        first, second = cache.manager.tiers

        def failing(keys: Any, ctx: Any) -> Any:
            if isinstance(answer, BaseException):
                raise answer
            return answer

        monkeypatch.setattr(first, "lookup_run", failing)
        assert peek(cache, tokens) == LookupResult(0, True)
        assert "lookup raised" in caplog.text
        assert (first.stats.lookups, first.stats.load_failures, first.stats.hits) == (6, 6, 0)
        assert (second.stats.lookups, second.stats.hits) == (6, 6)
        cache.drain()
        loaded(cache, tokens, data, 6)
    finally:
        cache.close()


def test_hits_without_room_for_the_whole_run_promote_as_many_as_fit() -> None:
    tokens, data = prompt(12)
    cache = make_cache({"type": "memory"}, slots=16)
    primary = cache.manager.primary
    other = list(range(5000, 5032))
    try:
        keys = stored_only_in_tiers(cache, tokens, data)
        cache.store(other, np.zeros((8, LAYOUT.slot_bytes), np.uint8))
        primary.prepare_load(cache.keys(other))  # 8 of the 16 slots pinned: room for 8
        assert peek(cache, tokens) == LookupResult(0, True)
        assert [primary.is_writing(key) for key in keys] == [True] * 8 + [False] * 4
        cache.drain()
        assert peek(cache, tokens).hit_chunks == 8
        loaded(cache, tokens, data, 8)
    finally:
        primary.complete_load(cache.keys(other))
        cache.close()


def test_a_tier_with_a_lookup_of_its_own_is_asked_key_by_key() -> None:
    tokens, data = prompt(10)
    cache = make_cache({"type": "key-by-key"}, slots=12)
    try:
        keys = stored_only_in_tiers(cache, tokens, data)
        tier = tier_at(cache, 0, KeyByKeyTier)
        tier.asked.clear()
        assert peek(cache, tokens) == LookupResult(0, True)
        assert tier.asked == keys
        cache.drain()
        loaded(cache, tokens, data, 10)
    finally:
        cache.close()


def test_a_key_given_twice_in_a_run_is_promoted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, data = prompt(8)
    cache = make_cache({"type": "memory"}, slots=12)
    try:
        keys = stored_only_in_tiers(cache, tokens, data)
        submitted = spy(monkeypatch, cache.manager.tiers[0], "submit_load")
        twice = keys[:3] + keys[:3] + keys[3:]
        assert cache.manager.lookup(twice, "r") == LookupResult(0, True)
        cache.drain()
        assert sorted(key for (job,) in submitted for key in job.keys) == sorted(keys)
        assert cache.manager.lookup(twice, "r2") == LookupResult(len(twice), False)
        loaded(cache, tokens, data, 8)
    finally:
        cache.close()
