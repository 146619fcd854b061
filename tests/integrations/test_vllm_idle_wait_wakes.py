"""The vLLM connector's idle wait for promotions is woken by the tier, not by polling."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

from vllm_requests import request

from kvtier import KVCache
from kvtier.integrations.vllm.engine_config import VllmGeometry
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.testing import small_layout

CHUNK = 4
PREFIX = list(range(12))  # three chunks


def test_the_idle_wait_sleeps_until_the_tier_announces_the_promotion() -> None:
    layout = small_layout(chunk_tokens=CHUNK, head_dim=4)
    config = {
        "chunk_tokens": CHUNK,
        "shared_memory_name": f"kvtier-test-{uuid.uuid4().hex[:12]}",
        "secondary_tiers": [{"type": "memory"}],  # a threaded tier: it announces its jobs
    }
    with KVCache(config, layout) as kv:
        rows = np.full((len(PREFIX) // CHUNK, layout.slot_bytes), 7, dtype=np.uint8)
        assert kv.store(PREFIX, rows) == 3
        kv.reset()  # drains the cascade, then empties the CPU tier
        assert kv.manager.progress.announced
        shape = VllmGeometry(("layer",), CHUNK, 1, layout.slot_bytes, 64)
        # Polling once an hour within a wait of a minute: only the tier's
        # announcement that the promotion ended can end it with the hit.
        scheduler = SchedulerSide(kv, shape, lookup_timeout_s=60.0, idle_wait_s=60.0, poll_s=3600.0)
        try:
            answer = scheduler.get_num_new_matched_tokens(request("a", [*PREFIX, 99]), 0)
            assert answer == (12, False)
            assert kv.status.holds(kv.keys(PREFIX)) == [True] * 3
        finally:
            scheduler.shutdown()
