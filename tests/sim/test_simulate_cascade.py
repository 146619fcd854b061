"""``kvtier simulate --secondary``: a primary tier and one evicting secondary tier,
replayed hit for hit against a real ``KVCache`` with a ``memory`` tier behind it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier import KVCache, integrity
from kvtier.cli import cli
from kvtier.keys import chunk_keys
from kvtier.policies import CachePolicyFactory
from kvtier.sim.cascade import CascadeReplay, replay_cascade
from kvtier.sim.replay import replay
from kvtier.sim.synthetic import ChatShape, chat_trace
from kvtier.sim.trace import Request, parse_records
from kvtier.testing import small_layout

SMALL_CHAT = ChatShape(conversations=80, system_prompts=3, think_s=20.0)


def chat_requests(seed: int) -> list[Request]:
    return parse_records(enumerate(chat_trace(seed, SMALL_CHAT), 1), "chat", block_size=256)


@pytest.mark.parametrize("policy", ["leaf-lru", "lru", "s3fifo"])
def test_cascade_replay_matches_a_real_kvcache_tier_by_tier(policy: str) -> None:
    requests = chat_requests(seed=11)[:250]
    slots, secondary_slots = 30, 90
    layout = small_layout(chunk_tokens=4, head_dim=4)
    key = chunk_keys(layout.namespace, [0] * 4, 4)[0]
    framed = len(integrity.frame(layout.namespace, key, bytes(layout.slot_bytes)))
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * layout.slot_bytes,
        "eviction_policy": policy,
        # One I/O thread: a request's chunks land in the tier in prefix order.
        "secondary_tiers": [
            {"type": "memory", "max_bytes": secondary_slots * framed, "io_threads": 1}
        ],
    }
    simulated = CascadeReplay(
        CachePolicyFactory.create_cache_policy(policy, slots), secondary_slots
    )
    real, replayed = [], []
    with KVCache(config, layout) as cache:
        before = 0
        for request in requests:
            tokens = [block for block in request.blocks for _ in range(4)]
            hit = cache.cached_prefix(tokens)
            promoted = cache.manager.tiers[0].stats.chunks_loaded - before
            before += promoted
            cache.store(tokens, lambda index, chunk: None)
            cache.drain()  # the model: every transfer ends before the next request
            real.append((hit // 4 - promoted, promoted))
            replayed.append(simulated.request_by_tier(request.blocks))
        tier_evictions = cache.manager.tiers[0].stats.evictions
        primary_evictions = cache.manager.primary.evictions
    assert real == replayed
    # Meaningful only if both tiers hit and both evicted.
    assert sum(p for p, _ in real) > 0 and sum(s for _, s in real) > 0
    assert primary_evictions > slots and tier_evictions > 0


def test_a_secondary_tier_only_adds_hits_and_an_unbounded_one_holds_everything_seen() -> None:
    requests = chat_requests(seed=4)
    distinct = len({b for r in requests for b in r.blocks})
    slots = distinct // 20
    alone = replay(requests, CachePolicyFactory.create_cache_policy("lru", slots), "lru")
    small = replay_cascade(
        requests, CachePolicyFactory.create_cache_policy("lru", slots), "lru", slots
    )
    # A primary tier that holds any one request, so every chunk is stored and promotable.
    longest = max(len(request.blocks) for request in requests)
    unbounded = replay_cascade(
        requests, CachePolicyFactory.create_cache_policy("lru", longest + 1), "lru", distinct
    )
    assert small.hit_ratio > alone.hit_ratio and small.secondary_hits > 0
    assert unbounded.hit_ratio > small.hit_ratio and unbounded.secondary_hits > 0
    # Nothing is ever evicted from a tier that holds every chunk: each chunk seen before
    # in a prefix hits, and so the total is the compulsory bound.
    seen: set[int] = set()
    reusable = 0
    for request in requests:
        for block in request.blocks:
            if block not in seen:
                break
            reusable += 1
        seen.update(request.blocks)
    assert unbounded.primary_hits + unbounded.secondary_hits == reusable


def test_simulate_reports_hits_per_tier_with_a_secondary_tier() -> None:
    result = CliRunner().invoke(
        cli,
        ["simulate", "--chat-seed", "2", "--limit", "600", "-p", "lru", "-c", "5%",
         "--secondary", "20%", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    cell = report["capacities"][0]
    cascade = cell["policies"]["lru"]["with_secondary"]
    assert cascade["secondary_slots"] == int(0.2 * report["distinct_chunks"])
    assert cascade["hit_ratio"] == pytest.approx(
        cascade["primary_hit_ratio"] + cascade["secondary_hit_ratio"]
    )
    assert cascade["hit_ratio"] > cell["policies"]["lru"]["hit_ratio"]
    table = CliRunner().invoke(
        cli, ["simulate", "--chat-seed", "2", "--limit", "300", "-p", "lru", "-s", "400"]
    )
    assert table.exit_code == 0, table.output
    assert "secondary" in table.output


def test_a_bad_secondary_capacity_is_named() -> None:
    result = CliRunner().invoke(
        cli, ["simulate", "--chat-seed", "1", "--limit", "50", "-p", "lru", "-s", "8GiB"]
    )
    assert result.exit_code == 2
    assert "--secondary" in result.output and "--chunk-bytes" in result.output


def test_a_job_larger_than_the_secondary_tier_leaves_its_last_chunks_and_evicts_skipped_ones() -> (
    None
):
    cascade = CascadeReplay(CachePolicyFactory.create_cache_policy("lru", 8), 3)
    cascade.request([10, 11])
    assert list(cascade.secondary) == [10, 11]
    # 11 is held, so skipped; 20..23 are written in order, 20 evicts 10 then
    # the skipped 11, and only the job's last three remain.
    cascade.request([11, 20, 21, 22, 23])
    assert list(cascade.secondary) == [21, 22, 23]


def test_simulate_sets_a_codecs_ratio_against_the_same_bytes_without() -> None:
    result = CliRunner().invoke(
        cli,
        ["simulate", "--chat-seed", "2", "--limit", "600", "-p", "lru", "-c", "5%",
         "--chunk-bytes", "1MiB", "--secondary", "64MiB", "--codec-ratio", "3.2", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    policy = json.loads(result.stdout)["capacities"][0]["policies"]["lru"]
    plain, coded = policy["with_secondary"], policy["with_codec"]
    assert plain["secondary_slots"] == 64 and coded["secondary_slots"] == int(64 * 3.2)
    assert coded["codec_ratio"] == 3.2
    assert coded["hit_ratio"] > plain["hit_ratio"]
    alone = CliRunner().invoke(cli, ["simulate", "--chat-seed", "2", "--codec-ratio", "2"])
    assert alone.exit_code == 2 and "--secondary" in alone.output


def test_simulate_measures_a_named_codecs_ratio_on_the_kv_it_is_given(tmp_path: Path) -> None:
    import numpy as np

    from kvtier.codecs.samples import kv_like
    from kvtier.layout import KVLayout

    layout = KVLayout("m", 2, 2, 64, "float16", 32)
    chunks = np.stack(
        [
            np.frombuffer(kv_like(layout, seed), np.float16).reshape(layout.chunk_shape)
            for seed in range(3)
        ]
    )
    kv = tmp_path / "kv.npy"
    np.save(kv, chunks)
    base = ["simulate", "--chat-seed", "2", "--limit", "300", "-p", "lru", "-s", "5%", "--json"]
    result = CliRunner().invoke(cli, [*base, "--codec", '{"type": "int4"}', "--kv", str(kv)])
    assert result.exit_code == 0, result.output
    coded = json.loads(result.stdout)["capacities"][0]["policies"]["lru"]["with_codec"]
    assert 3.0 < coded["codec_ratio"] < 3.3  # 4 bits and group parameters for 16
    np.save(kv, chunks[:, 0])  # not chunks of KV
    bad = CliRunner().invoke(cli, [*base, "--codec", "int4", "--kv", str(kv)])
    assert bad.exit_code == 2 and "expected (chunks, layers, 2, tokens, heads, dim)" in bad.output
    alone = CliRunner().invoke(cli, [*base, "--codec", "int4"])
    assert alone.exit_code == 2 and "--kv" in alone.output
