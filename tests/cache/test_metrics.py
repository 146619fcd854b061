"""Prometheus metrics follow a scripted workload through KVCache."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from kvtier import ConfigError, KVCache
from kvtier.testing import FaultyTier, restore_registries, small_layout
from kvtier.tiers import TierMetric, TierStats, register_tier
from kvtier.tiers.memory import MemoryTier

CHUNK_TOKENS = 4
LAYOUT = small_layout(chunk_tokens=CHUNK_TOKENS)
SLOT = LAYOUT.slot_bytes


def config(*tiers: dict[str, Any], slots: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "cpu_bytes_to_use": slots * SLOT,
        "secondary_tiers": list(tiers),
        **extra,
    }


def chunks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SLOT), dtype=np.uint8)


def value(cache: KVCache, name: str, tier: int | None = 0, **labels: str) -> float:
    if tier is not None:
        labels = {"tier": str(tier), "tier_type": cache.manager.tiers[tier].tier_type, **labels}
    sample = cache.metrics.registry.get_sample_value(name, labels)
    assert sample is not None, f"no sample {name}{labels}"
    return sample


@pytest.fixture
def cache() -> Iterator[KVCache]:
    with KVCache(config({"type": "memory"}), LAYOUT) as cache:
        yield cache


def test_store_then_promote_counts_chunks_bytes_hits_and_durations(cache: KVCache) -> None:
    tokens = list(range(5 * CHUNK_TOKENS))
    assert cache.store(tokens, chunks(5)) == 5
    cache.drain()
    assert value(cache, "kvtier_tier_chunks_stored_total") == 5
    assert value(cache, "kvtier_tier_bytes_stored_total") == 5 * SLOT
    assert value(cache, "kvtier_tier_jobs_total", direction="store", outcome="ok") == 1
    assert value(cache, "kvtier_tier_hits_total") == 0

    cache.manager.reset()
    assert cache.cached_prefix(tokens) == len(tokens)
    assert value(cache, "kvtier_tier_hits_total") == 5
    assert value(cache, "kvtier_tier_lookups_total") == 5
    assert value(cache, "kvtier_tier_misses_total") == 0
    assert value(cache, "kvtier_tier_chunks_loaded_total") == 5
    assert value(cache, "kvtier_tier_bytes_loaded_total") == 5 * SLOT
    assert value(cache, "kvtier_tier_transfer_seconds_count", direction="load") == 1
    assert value(cache, "kvtier_tier_transfer_seconds_sum", direction="load") > 0
    bucket = value(cache, "kvtier_tier_transfer_seconds_bucket", direction="load", le="+Inf")
    assert bucket == 1

    # The promoted chunks count as the tier's hits only, however often the
    # request asked again while they came; a new request finds them in the
    # primary tier without a secondary lookup: each chunk served counts once.
    assert value(cache, "kvtier_primary_hits_total", None) == 0
    assert cache.cached_prefix(tokens[: 2 * CHUNK_TOKENS]) == 2 * CHUNK_TOKENS
    assert value(cache, "kvtier_primary_hits_total", None) == 2
    assert value(cache, "kvtier_tier_lookups_total") == 5
    assert cache.metrics.snapshot()["primary"]["hits"] == 2

    # An unknown prefix: the primary tier misses, so does the memory tier.
    assert cache.cached_prefix(list(range(100, 100 + CHUNK_TOKENS))) == 0
    assert value(cache, "kvtier_tier_misses_total") == 1
    assert value(cache, "kvtier_tier_lookups_total") == 6


def test_primary_slot_states_add_up_and_follow_pins(cache: KVCache) -> None:
    tokens = list(range(3 * CHUNK_TOKENS))
    cache.store(tokens, chunks(3))
    cache.drain()

    def states() -> dict[str, float]:
        names = ("free", "idle", "pinned", "writing")
        return {s: value(cache, "kvtier_primary_slots", None, state=s) for s in names}

    assert states() == {"free": 5, "idle": 3, "pinned": 0, "writing": 0}
    keys = cache.keys(tokens)
    cache.manager.prepare_load(keys[:2])
    assert states() == {"free": 5, "idle": 1, "pinned": 2, "writing": 0}
    cache.manager.complete_load(keys[:2])
    assert value(cache, "kvtier_primary_slot_bytes", None) == SLOT
    # Eight slots, eleven chunks: the policy evicts three from the primary tier.
    cache.store(list(range(1000, 1000 + 8 * CHUNK_TOKENS)), chunks(8, seed=1))
    cache.drain()
    assert value(cache, "kvtier_primary_evictions_total", None) == 3


def test_tier_extra_metrics_are_exported(cache: KVCache) -> None:
    assert value(cache, "kvtier_tier_held_bytes") == 0
    cache.store(list(range(2 * CHUNK_TOKENS)), chunks(2))
    cache.drain()
    memory = cache.manager.tiers[0]
    assert isinstance(memory, MemoryTier)
    assert value(cache, "kvtier_tier_held_bytes") == memory.held_bytes > 2 * SLOT
    assert value(cache, "kvtier_tier_max_bytes") == memory.backend.max_bytes


def test_injected_failures_are_counted_and_fall_back_to_recompute() -> None:
    faulty = {
        "type": "FaultyTier",
        "module_path": "kvtier.testing.faults",
        "inner": {"type": "memory"},
    }
    with restore_registries(), KVCache(config(faulty), LAYOUT) as cache:
        tier = cache.manager.tiers[0]
        assert isinstance(tier, FaultyTier)
        tokens = list(range(4 * CHUNK_TOKENS))

        tier.fail_rate = 1.0  # every store job fails
        cache.store(tokens, chunks(4))
        cache.drain()
        assert value(cache, "kvtier_tier_store_failures_total") == 4
        assert value(cache, "kvtier_tier_chunks_stored_total") == 0
        assert value(cache, "kvtier_tier_jobs_total", direction="store", outcome="failed") == 1

        tier.fail_rate = 0.0
        cache.manager.reset()
        cache.store(tokens, chunks(4))
        cache.drain()
        assert value(cache, "kvtier_tier_chunks_stored_total") == 4

        tier.fail_rate = 1.0  # now the promotion fails: the prefix is recomputed
        cache.manager.reset()
        assert cache.cached_prefix(tokens) == 0
        assert value(cache, "kvtier_tier_hits_total") >= 1
        assert value(cache, "kvtier_tier_load_failures_total") >= 1
        assert value(cache, "kvtier_tier_jobs_total", direction="load", outcome="failed") >= 1

        tier.broken = True  # a client library that raises on every call
        failures = value(cache, "kvtier_tier_load_failures_total")
        misses = value(cache, "kvtier_tier_misses_total")
        assert cache.cached_prefix(list(range(500, 500 + CHUNK_TOKENS))) == 0
        assert value(cache, "kvtier_tier_load_failures_total") == failures + 1
        assert value(cache, "kvtier_tier_misses_total") == misses + 1
        tier.broken = False


def test_corrupt_chunk_is_counted_and_not_served(cache: KVCache) -> None:
    tokens = list(range(2 * CHUNK_TOKENS))
    cache.store(tokens, chunks(2))
    cache.drain()
    memory = cache.manager.tiers[0]
    assert isinstance(memory, MemoryTier)
    memory.backend.corrupt_for_tests(cache.keys(tokens)[0])
    cache.manager.reset()
    assert cache.cached_prefix(tokens) == 0
    assert value(cache, "kvtier_tier_corrupt_chunks_total") == 1
    assert value(cache, "kvtier_tier_load_failures_total") == 1


def test_backpressure_drops_are_counted() -> None:
    settings = config({"type": "memory"}, backpressure={"max_inflight_stores": 1})
    with KVCache(settings, LAYOUT) as cache:
        # Two cascades in one step: the second finds one store in flight.
        cache.store(list(range(CHUNK_TOKENS)), chunks(1))
        cache.store(list(range(100, 100 + 2 * CHUNK_TOKENS)), chunks(2))
        assert value(cache, "kvtier_tier_stores_inflight") == 1
        cache.drain()
        assert value(cache, "kvtier_tier_backpressure_drops_total") == 2
        assert value(cache, "kvtier_tier_stores_inflight") == 0


def test_metrics_are_served_over_http_on_loopback() -> None:
    with KVCache(config({"type": "memory"}, metrics={"port": 0}), LAYOUT) as cache:
        port = cache.metrics.port
        assert port
        cache.store(list(range(CHUNK_TOKENS)), chunks(1))
        cache.drain()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            body = reply.read().decode()
        assert 'kvtier_tier_chunks_stored_total{tier="0",tier_type="memory"} 1.0' in body
        assert 'kvtier_primary_slots{state="idle"} 1.0' in body
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)


def test_a_port_metrics_cannot_be_served_on_fails_at_start_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            KVCache(config({"type": "memory"}, metrics={"port": port}), LAYOUT)
    ((where, problem),) = info.value.problems
    assert where == "metrics.port"
    assert problem == f"cannot serve /metrics on 127.0.0.1:{port}: Address already in use"


def test_each_cache_has_its_own_registry_unless_told() -> None:
    with KVCache(config({"type": "memory"}), LAYOUT) as one, KVCache(config(), LAYOUT) as two:
        assert one.metrics.registry is not two.metrics.registry
        assert two.metrics.registry.get_sample_value("kvtier_primary_slots", {"state": "free"}) == 8
    shared = CollectorRegistry()
    with KVCache(config(), LAYOUT, metrics_registry=shared):
        assert shared.get_sample_value("kvtier_primary_slots", {"state": "free"}) == 8
    assert shared.get_sample_value("kvtier_primary_slots", {"state": "free"}) is None

    with KVCache(config(metrics={"global_registry": True}), LAYOUT) as cache:
        assert cache.metrics.registry is REGISTRY
        assert REGISTRY.get_sample_value("kvtier_primary_slots", {"state": "free"}) == 8
    assert REGISTRY.get_sample_value("kvtier_primary_slots", {"state": "free"}) is None


class _BadMetricsTier(MemoryTier):
    def metrics(self) -> Sequence[TierMetric]:
        raise RuntimeError("backend gone")


class _OddMetricsTier(MemoryTier):
    def metrics(self) -> Sequence[TierMetric]:
        return (
            TierMetric("Bad-Name", 1.0),
            TierMetric("hits", 5.0),  # clashes with a TierStats counter
            TierMetric("queue_depth", 3.0, "Queued requests."),
            TierMetric("reconnects", 2.0, counter=True),
        )


@dataclass
class _AcmeStats(TierStats):
    reconnects: int = 0


class _CountingTier(MemoryTier):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stats = _AcmeStats()


def test_extra_tier_stats_fields_become_counters() -> None:
    with restore_registries():
        register_tier("counting", __name__, "_CountingTier")
        with KVCache(config({"type": "counting"}), LAYOUT) as cache:
            assert value(cache, "kvtier_tier_reconnects_total") == 0
            cache.manager.tiers[0].count(reconnects=2)
            assert value(cache, "kvtier_tier_reconnects_total") == 2
            assert cache.metrics.snapshot()["tiers"][0]["reconnects"] == 2


def test_a_tier_metrics_hook_never_breaks_a_scrape(caplog: pytest.LogCaptureFixture) -> None:
    with restore_registries():
        register_tier("bad_metrics", __name__, "_BadMetricsTier")
        register_tier("odd_metrics", __name__, "_OddMetricsTier")
        settings = config({"type": "bad_metrics"}, {"type": "odd_metrics"})
        with KVCache(settings, LAYOUT) as cache:
            assert value(cache, "kvtier_tier_lookups_total", tier=0) == 0
            assert value(cache, "kvtier_tier_queue_depth", tier=1) == 3
            assert value(cache, "kvtier_tier_reconnects_total", tier=1) == 2
            assert value(cache, "kvtier_tier_hits_total", tier=1) == 0
            assert value(cache, "kvtier_primary_slots", None, state="free") == 8
    assert "metrics() raised" in caplog.text
    assert "'Bad-Name' rejected" in caplog.text and "'hits' rejected" in caplog.text


def test_snapshot_is_plain_numbers(cache: KVCache) -> None:
    cache.store(list(range(CHUNK_TOKENS)), chunks(1))
    cache.drain()
    snapshot = cache.metrics.snapshot()
    assert snapshot["primary"]["idle"] == 1
    assert snapshot["tiers"][0]["tier_type"] == "memory"
    assert snapshot["tiers"][0]["chunks_stored"] == 1


def test_a_raising_job_listener_does_not_disturb_the_manager(cache: KVCache) -> None:
    def broken(tier_index: int, loading: bool, result: object) -> None:
        raise RuntimeError("observer bug")

    cache.manager.job_listeners.insert(0, broken)
    cache.store(list(range(CHUNK_TOKENS)), chunks(1))
    cache.drain()
    assert value(cache, "kvtier_tier_chunks_stored_total") == 1
    assert value(cache, "kvtier_tier_jobs_total", direction="store", outcome="ok") == 1


def test_a_second_cache_in_a_shared_registry_fails_clearly_and_cleanly() -> None:
    shared = CollectorRegistry()
    with KVCache(config({"type": "memory"}), LAYOUT, metrics_registry=shared) as first:
        with pytest.raises(ValueError, match="one kvtier cache per registry"):
            KVCache(config(), LAYOUT, metrics_registry=shared)
        first.store(list(range(CHUNK_TOKENS)), chunks(1))
        first.drain()
        labels = {"tier": "0", "tier_type": "memory"}
        assert shared.get_sample_value("kvtier_tier_chunks_stored_total", labels) == 1
        assert shared.get_sample_value("kvtier_primary_slots", {"state": "idle"}) == 1
