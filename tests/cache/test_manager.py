"""The tiering manager: promotions, cascades, backpressure, failing tiers."""

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, LookupResult, register_tier
from kvtier.backpressure import Backpressure
from kvtier.config import BackpressureConfig
from kvtier.testing import FaultyTier, small_layout
from kvtier.tiers.base import Lookup, LookupContext, TransferJob
from kvtier.tiers.drive import run_job
from kvtier.tiers.fs import FilesystemTier
from tests.cache.doubles import GatedTier, RecordingTier
from tests.support.cache_tiers import tier_at, tiers_of

LAYOUT = small_layout(chunk_tokens=4)
TOKENS = list(range(40, 56))  # four chunks


@pytest.fixture(autouse=True)
def doubles(registries: None) -> None:
    register_tier("recording", "tests.cache.doubles", "RecordingTier")
    register_tier("gated", "tests.cache.doubles", "GatedTier")


def make_cache(*tiers: dict[str, Any], slots: int = 8, **extra: Any) -> KVCache:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * LAYOUT.slot_bytes,
        "secondary_tiers": list(tiers),
        **extra,
    }
    return KVCache(config, LAYOUT)


def peek(cache: KVCache, tokens: list[int], request_id: str | None = None) -> LookupResult:
    """The manager's non-blocking answer for ``tokens``."""
    return cache.manager.lookup(cache.keys(tokens), request_id)


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (4, LAYOUT.slot_bytes), dtype=np.uint8)


@pytest.fixture
def cache() -> Iterator[KVCache]:
    cache = make_cache({"type": "recording"}, {"type": "recording"})
    yield cache
    cache.close()


def test_store_cascades_to_every_tier_with_slots_pinned_until_collected(
    cache: KVCache, data: np.ndarray
) -> None:
    assert cache.store(TOKENS, data) == 4
    keys = cache.keys(TOKENS)
    primary = cache.manager.primary
    assert [primary.refcount(k) for k in keys] == [2] * 4  # one pin per cascade
    for tier in tiers_of(cache, RecordingTier):
        assert [job.keys for job in tier.stores] == [tuple(keys)]
    cache.step()
    assert [primary.refcount(k) for k in keys] == [0] * 4
    assert [t.stats.chunks_stored for t in cache.manager.tiers] == [4, 4]


def test_secondary_hit_promotes_in_one_batch_per_tier_and_request(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS, data)
    cache.drain()
    cache.manager.reset()
    first = tier_at(cache, 0, RecordingTier)
    result = peek(cache, TOKENS, "r1")
    assert result.hit_chunks == 0 and result.pending
    assert first.loads == []  # submitted at step end
    keys = cache.keys(TOKENS)
    assert all(cache.manager.primary.is_writing(k) for k in keys)
    cache.step()
    assert [job.keys for job in first.loads] == [tuple(keys)]
    assert first.loads[0].request_id == "r1"
    cache.step()  # collect
    assert peek(cache, TOKENS, "r1").hit_chunks == 4
    out = np.zeros_like(data)
    cache.load(TOKENS, 16, out)
    np.testing.assert_array_equal(out, data)
    assert tier_at(cache, 1, RecordingTier).loads == []


def test_collect_makes_ended_promotions_ready_without_submitting_more(data: np.ndarray) -> None:
    cache = make_cache({"type": "gated"}, {"type": "gated"})
    try:
        cache.store(TOKENS, data)
        cache.drain()
        cache.manager.reset()
        first, second = tiers_of(cache, GatedTier)
        assert peek(cache, TOKENS[:8], "r1") == LookupResult(0, True)
        cache.step()  # submits the promotion of the first two chunks
        first.release()  # ...and it ends
        assert peek(cache, TOKENS, "r2") == LookupResult(0, True)  # queued, not submitted
        cache.manager.collect()
        # The ended promotion is ready within the same step...
        assert peek(cache, TOKENS[:8], "r1") == LookupResult(2, False)
        # ...and collecting submitted nothing: r2's promotion waits for the step.
        assert len(first.loads) == 1
        assert second.loads == []
        cache.step()
        assert len(first.loads) == 2
    finally:
        cache.close()


def test_lookup_answers_the_leading_primary_hits_without_io(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS[:8], data[:2])
    assert peek(cache, TOKENS).hit_chunks == 2
    assert not peek(cache, TOKENS).pending


def test_hit_in_a_slower_tier_warms_the_faster_tiers(cache: KVCache, data: np.ndarray) -> None:
    fast, slow = tiers_of(cache, RecordingTier)
    keys = cache.keys(TOKENS)
    cache.manager.primary.buffer.array[:4] = data
    run_job(slow, TransferJob(tuple(keys), (0, 1, 2, 3)), loading=False)
    assert cache.cached_prefix(TOKENS) == 16
    cache.drain()
    assert [job.keys for job in fast.stores] == [tuple(keys)]
    assert fast.stats.chunks_stored == 4


def test_promotions_into_a_full_primary_spare_the_chain_with_one_shared_set(
    cache: KVCache, data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache.store(TOKENS, data)
    cache.drain()
    cache.manager.reset()
    cache.store(TOKENS[:8], data[:2])  # the first two chunks back in the primary tier
    other = list(range(900, 924))  # six other chunks fill it
    cache.store(other, np.zeros((6, LAYOUT.slot_bytes), dtype=np.uint8))
    cache.drain()
    primary = cache.manager.primary
    assert len(primary) == primary.num_slots
    protects: list[object] = []
    real_prepare_store = primary.prepare_store

    def spy(keys: Any, protect: Any = ()) -> Any:
        protects.append(protect)
        return real_prepare_store(keys, protect)

    monkeypatch.setattr(primary, "prepare_store", spy)
    keys = cache.keys(TOKENS)
    assert peek(cache, TOKENS, "r1") == LookupResult(2, True)
    # One promotion per missing chunk, each protecting the same set, made once.
    assert len(protects) == 2 and protects[0] is protects[1]
    assert protects[0] == set(keys)
    assert primary.evictions == 2 and all(primary.is_ready(k) for k in keys[:2])
    cache.drain()
    out = np.zeros_like(data)
    assert cache.load(TOKENS, 16, out) == 16
    np.testing.assert_array_equal(out, data)


def test_promotion_without_room_is_a_miss(data: np.ndarray) -> None:
    cache = make_cache({"type": "recording"}, slots=4)
    try:
        cache.store(TOKENS, data)
        cache.drain()
        cache.manager.reset()
        other = list(range(900, 916))
        cache.store(other, data)
        cache.manager.primary.prepare_load(cache.keys(other))  # pin everything
        assert peek(cache, TOKENS) == LookupResult(0, False)
    finally:
        cache.manager.primary.complete_load(cache.keys(list(range(900, 916))))
        cache.close()


def test_a_broken_tier_costs_only_hits(data: np.ndarray) -> None:
    faulty = {"type": "FaultyTier", "module_path": "kvtier.testing.faults"}
    cache = make_cache(faulty, {"type": "memory"})
    try:
        broken = tier_at(cache, 0, FaultyTier)
        broken.broken = True
        assert cache.store(TOKENS, data) == 4  # the cascade to it fails, counted
        cache.drain()
        assert broken.stats.store_failures == 4
        assert cache.manager.primary.refcount(cache.keys(TOKENS)[0]) == 0  # pin released
        cache.manager.reset()
        # Lookups to the broken tier raise inside; the healthy tier still serves.
        assert cache.cached_prefix(TOKENS) == 16
        assert broken.stats.load_failures >= 1 and broken.stats.misses >= 1
        out = np.zeros_like(data)
        cache.load(TOKENS, 16, out)
        np.testing.assert_array_equal(out, data)
    finally:
        cache.close()


def test_failed_promotions_fall_back_to_recompute_and_are_not_retried(data: np.ndarray) -> None:
    faulty = {
        "type": "FaultyTier",
        "module_path": "kvtier.testing.faults",
        "inner": {"type": "example"},
    }
    cache = make_cache(faulty)
    try:
        cache.store(TOKENS, data)
        cache.drain()
        cache.manager.reset()
        tier = tier_at(cache, 0, FaultyTier)
        tier.fail_rate = 1.0
        assert cache.cached_prefix(TOKENS, request_id="r") == 0
        assert tier.stats.load_failures == 4
        assert len(cache.manager.primary) == 0  # reserved slots were freed
        # Another request tries again, and succeeds once the tier heals.
        tier.fail_rate = 0.0
        assert cache.cached_prefix(TOKENS, request_id="r") == 0
        assert cache.cached_prefix(TOKENS, request_id="r2") == 16
        cache.manager.on_request_finished("r")
        assert "r" not in cache.manager._failed
    finally:
        cache.close()


def test_backpressure_drops_stores_to_a_tier_that_falls_behind(data: np.ndarray) -> None:
    cache = make_cache(
        {"type": "gated"}, {"type": "recording"}, backpressure={"max_inflight_stores": 1}
    )
    try:
        gated, healthy = tier_at(cache, 0, GatedTier), tier_at(cache, 1, RecordingTier)
        cache.store(TOKENS[:4], data[:1])
        cache.step()  # the healthy tier's job is collected; the gated one still runs
        cache.store(TOKENS, data)
        assert gated.stats.backpressure_drops == 3
        assert len(gated.stores) == 1 and len(healthy.stores) == 2
        gated.release()
        cache.step()
        assert gated.stats.chunks_stored == 1
        # Pressured again, the tier still serves loads.
        cache.store(list(range(500, 504)), data[:1])
        assert not cache.manager.backpressure[0].admit()
        cache.manager.primary.remove_idle(cache.keys(TOKENS[:4]))
        assert peek(cache, TOKENS[:4]).pending
        cache.step()
        assert len(gated.loads) == 1
    finally:
        cache.close()


def test_backpressure_hysteresis_and_probe() -> None:
    pressure = Backpressure(
        BackpressureConfig(
            max_inflight_stores=4, high_latency_s=1.0, low_latency_s=0.2, smoothing=1
        )
    )
    assert pressure.admit()
    pressure.started()
    pressure.finished(2.0)
    assert pressure.pressured and pressure.admit()  # idle: one probe may go
    pressure.started()
    assert not pressure.admit()
    pressure.finished(0.5)  # between the marks: still pressured
    assert pressure.pressured
    pressure.started()
    pressure.finished(0.1)
    assert not pressure.pressured


def test_reset_and_shutdown_drain_in_flight_work(data: np.ndarray) -> None:
    cache = make_cache({"type": "gated"})
    gated = tier_at(cache, 0, GatedTier)
    cache.store(TOKENS, data)
    assert gated.held
    cache.manager.reset()
    assert not gated.held and gated.stats.chunks_stored == 4
    assert len(cache.manager.primary) == 0
    cache.store(TOKENS, data)
    cache.close()
    assert gated.stats.chunks_stored == 8
    cache.close()  # idempotent


def test_store_skips_resident_chunks_and_partial_tails(cache: KVCache, data: np.ndarray) -> None:
    assert cache.store(TOKENS[:8], data[:2]) == 2
    assert cache.store([*TOKENS, 1, 2], data) == 2  # two new chunks; the tail has no key
    assert len(cache.manager.primary) == 4


def test_a_failed_copy_releases_every_reserved_slot(cache: KVCache) -> None:
    def explode(index: int, chunk: np.ndarray) -> None:
        raise RuntimeError("engine copy failed")

    with pytest.raises(RuntimeError, match="engine copy failed"):
        cache.store(TOKENS, explode)
    assert len(cache.manager.primary) == 0


def test_a_drained_slow_tier_has_reported_every_job(
    data: np.ndarray, caplog: pytest.LogCaptureFixture
) -> None:
    slow = {"type": "FaultyTier", "module_path": "kvtier.testing.faults", "latency_s": 0.05}
    with make_cache(slow) as cache:
        cache.store(TOKENS, data)
        cache.drain()
        assert cache.manager.tiers[0].stats.chunks_stored == 4
        assert not cache.manager.busy
    assert not [r for r in caplog.records if "unreported" in r.getMessage()]


@pytest.mark.parametrize("tier_type", ["memory", "fs"])
def test_a_chunk_gone_between_lookup_and_load_is_a_miss_not_a_failure(
    tier_type: str, data: np.ndarray, tmp_path: Any
) -> None:
    """Another process (or the tier's own bound) evicted it after the lookup said HIT."""
    entry: dict[str, Any] = {"type": tier_type}
    if tier_type == "fs":
        entry["root_dir"] = str(tmp_path)
    cache = make_cache(entry)
    try:
        cache.store(TOKENS, data)
        cache.drain()
        cache.manager.reset()
        tier = cache.manager.tiers[0]
        keys = cache.keys(TOKENS)
        # fs re-indexes its root in the background; until it is done a lookup
        # checks each chunk's existence first, and no promotion is queued yet.
        if isinstance(tier, FilesystemTier):
            assert tier.wait_index(timeout=60)
        assert peek(cache, TOKENS, "r1").pending  # all four found: promotions queued
        for key in keys[2:]:
            tier.discard([key])  # gone before the load runs, as another process would do
        cache.drain()
        assert peek(cache, TOKENS, "r1").hit_chunks == 2
        assert tier.stats.chunks_loaded == 2
        assert tier.stats.load_failures == 0
        out = np.zeros_like(data)
        assert cache.load(TOKENS, 8, out[:2]) == 8
        np.testing.assert_array_equal(out[:2], data[:2])
    finally:
        cache.close()


def test_a_request_asked_again_asks_no_tier_again_about_a_chunk_it_missed(
    data: np.ndarray,
) -> None:
    # Chunks 0 and 1 only in the gated tier, whose loads wait for the test:
    # the request asks again while they are promoted. A tier's MISS stands for
    # the rest of the request: asked again, a remote tier would check again
    # (a request to its backend), and its misses would count once per ask.
    cache = make_cache({"type": "memory"}, {"type": "gated"})
    try:
        first, gated = cache.manager.tiers[0], tier_at(cache, 1, GatedTier)
        cache.store(TOKENS[:8], data[:2])
        gated.release()
        cache.drain()
        keys = cache.keys(TOKENS)
        first.discard(keys[:2])
        cache.manager.reset()
        asked: Counter[tuple[int, int]] = Counter()  # (tier, chunk) -> asks

        def counting(index: int, lookup: Any) -> Any:
            def counted(key: Any, ctx: LookupContext) -> Lookup:
                asked[(index, keys.index(key))] += 1
                return lookup(key, ctx)

            return counted

        for index, tier in enumerate(cache.manager.tiers):
            tier.lookup = counting(index, tier.lookup)  # type: ignore[method-assign]
        for _ in range(3):
            assert peek(cache, TOKENS, "r1") == LookupResult(0, True)
            cache.step()
        assert asked == {(0, 0): 1, (1, 0): 1, (0, 1): 1, (1, 1): 1, (0, 2): 1, (1, 2): 1}
        assert (first.stats.misses, first.stats.hits) == (3, 0)
        assert (gated.stats.misses, gated.stats.hits) == (1, 2)
        gated.release()
        cache.drain()
        assert peek(cache, TOKENS, "r1") == LookupResult(2, False)
        assert asked[(0, 2)] == asked[(1, 2)] == 1
        # Not pending, the request is over: asked again, it is a new one.
        assert peek(cache, TOKENS, "r1") == LookupResult(2, False)
        assert asked[(0, 2)] == asked[(1, 2)] == 2
        assert (first.stats.misses, gated.stats.misses) == (4, 2)
    finally:
        cache.close()


def test_a_request_asked_again_counts_its_primary_hits_once(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS, data)
    cache.drain()
    cache.manager.reset()  # the tiers keep all four chunks
    cache.store(TOKENS[:8], data[:2])  # two of them back in the primary tier
    cache.drain()
    fast = cache.manager.tiers[0]
    hits_before = fast.stats.hits
    primary = cache.manager.primary
    before = primary.hits
    assert peek(cache, TOKENS, "r1") == LookupResult(2, True)  # the rest is being promoted
    assert peek(cache, TOKENS, "r1").pending  # asked again before the step
    cache.step()
    cache.step()
    assert peek(cache, TOKENS, "r1") == LookupResult(4, False)
    # r1's two resident chunks count once; its two promoted ones are the tier's hits.
    assert primary.hits - before == 2
    assert fast.stats.hits - hits_before == 2
    # A later request finds all four resident: its own four hits.
    assert peek(cache, TOKENS, "r2") == LookupResult(4, False)
    assert primary.hits - before == 6
    # Finished, a request id is forgotten: used again, it is a new request.
    cache.manager.on_request_finished("r1")
    assert peek(cache, TOKENS, "r1") == LookupResult(4, False)
    assert primary.hits - before == 10
