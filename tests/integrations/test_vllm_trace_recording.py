"""The vLLM connector's scheduler records each request once into the trace."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

from vllm_requests import request

from kvtier import KVCache
from kvtier.integrations.vllm.engine_config import VllmGeometry
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.sim.trace import read_trace
from kvtier.testing import small_layout

CHUNK = 4


def test_each_request_is_recorded_once_with_its_prompt_chunks(tmp_path: Path) -> None:
    layout = small_layout(chunk_tokens=CHUNK, head_dim=4)
    path = tmp_path / "vllm.jsonl"
    config = {
        "chunk_tokens": CHUNK,
        "shared_memory_name": f"kvtier-test-{uuid.uuid4().hex[:12]}",
        "trace_recording": {"path": str(path)},
    }
    kv = KVCache(config, layout)
    shape = VllmGeometry(("layer",), CHUNK, 1, layout.slot_bytes, 64)
    scheduler = SchedulerSide(kv, shape, lookup_timeout_s=1.0)
    try:
        shared = list(range(12))
        first = request("a", [*shared, 50, 51, 52, 53, 54])
        second = request("b", [*shared, 60, 61])
        for _ in range(3):  # vLLM asks again while a request waits: still one record
            scheduler.get_num_new_matched_tokens(first, 0)
        scheduler.get_num_new_matched_tokens(second, 0)
    finally:
        scheduler.shutdown()
        kv.close()  # the cache owns the recorder: closing it writes what is queued
    requests = read_trace(path)
    # Full chunks only; the two prompts share their first three chunks.
    assert [len(r.blocks) for r in requests] == [4, 3]
    assert requests[0].blocks[:3] == requests[1].blocks
