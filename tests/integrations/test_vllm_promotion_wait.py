"""The vLLM connector's lookup waits in place for promotions only while the engine is idle."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

from tests.support.cache_tiers import tier_at
from vllm_requests import request

from kvtier import KVCache
from kvtier.integrations.vllm.engine_config import VllmGeometry
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.testing import FaultyTier, small_layout

CHUNK = 4
PREFIX = list(range(12))  # three chunks, held by the secondary tier only


@pytest.fixture
def cache() -> Iterator[KVCache]:
    """A cache whose secondary tier holds :data:`PREFIX` and whose CPU tier is empty."""
    layout = small_layout(chunk_tokens=CHUNK, head_dim=4)
    config = {
        "chunk_tokens": CHUNK,
        "shared_memory_name": f"kvtier-test-{uuid.uuid4().hex[:12]}",
        "secondary_tiers": [
            {
                "type": "FaultyTier",
                "module_path": "kvtier.testing.faults",
                "inner": {"type": "memory"},
            }
        ],
    }
    kv = KVCache(config, layout)
    try:
        rows = np.full((len(PREFIX) // CHUNK, layout.slot_bytes), 7, dtype=np.uint8)
        assert kv.store(PREFIX, rows) == 3
        kv.reset()  # drains the cascade, then empties the CPU tier
        assert kv.status.holds(kv.keys(PREFIX)) == [False] * 3
        yield kv
    finally:
        kv.close()


@contextlib.contextmanager
def scheduler_of(
    kv: KVCache, *, idle_wait_s: float, lookup_timeout_s: float = 60.0
) -> Iterator[SchedulerSide]:
    """The connector's scheduler side over ``kv``, shut down afterwards."""
    shape = VllmGeometry(("layer",), CHUNK, 1, kv.layout.slot_bytes, 64)
    scheduler = SchedulerSide(kv, shape, lookup_timeout_s=lookup_timeout_s, idle_wait_s=idle_wait_s)
    try:
        yield scheduler
    finally:
        scheduler.shutdown()


def test_an_idle_engine_gets_the_promoted_prefix_in_its_first_lookup(cache: KVCache) -> None:
    with scheduler_of(cache, idle_wait_s=60.0) as scheduler:
        # No "ask again", so no empty engine step: the three chunks at once.
        assert scheduler.get_num_new_matched_tokens(request("a", [*PREFIX, 99]), 0) == (12, False)
        assert cache.status.holds(cache.keys(PREFIX)) == [True] * 3
        assert scheduler.counters.promotion_timeouts == 0


def test_a_busy_engine_is_told_to_ask_again_and_then_served(cache: KVCache) -> None:
    with scheduler_of(cache, idle_wait_s=60.0) as scheduler:
        other = request("other", [50, 51, 52, 53, 54])
        assert scheduler.get_num_new_matched_tokens(other, 0) == (0, False)  # a miss, running
        waiting = request("a", [*PREFIX, 99])
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (None, False)
        cache.drain()  # the promotions the step submits
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (12, False)


def test_without_the_wait_an_idle_engine_asks_again(cache: KVCache) -> None:
    with scheduler_of(cache, idle_wait_s=0) as scheduler:
        waiting = request("a", [*PREFIX, 99])
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (None, False)
        cache.drain()
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (12, False)


def test_the_wait_never_outlasts_the_lookup_timeout(cache: KVCache) -> None:
    with scheduler_of(cache, idle_wait_s=60.0, lookup_timeout_s=0) as scheduler:
        # A timeout of 0: go ahead with what is ready now, without waiting.
        assert scheduler.get_num_new_matched_tokens(request("a", [*PREFIX, 99]), 0) == (0, False)
        assert scheduler.counters.promotion_timeouts == 1


def test_a_failed_promotion_ends_the_wait_as_a_miss(cache: KVCache) -> None:
    tier_at(cache, 0, FaultyTier).fail_rate = 1.0
    with scheduler_of(cache, idle_wait_s=60.0) as scheduler:
        # The wait ends with the failed job, not at its bound: vLLM computes the prefix.
        assert scheduler.get_num_new_matched_tokens(request("a", [*PREFIX, 99]), 0) == (0, False)
        assert cache.status.holds(cache.keys(PREFIX)) == [False] * 3


def test_a_slow_tier_costs_one_bounded_wait_then_the_engine_steps_on(cache: KVCache) -> None:
    tier_at(cache, 0, FaultyTier).latency_s = 1.0
    with scheduler_of(cache, idle_wait_s=0.001) as scheduler:
        waiting = request("a", [*PREFIX, 99])
        # Past the bound the scheduler goes back to vLLM, which asks again later.
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (None, False)
        cache.drain()
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (12, False)
