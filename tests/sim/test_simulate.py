"""``kvtier simulate``: the trace reader, the replay against a real KVCache, and MIN."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvtier import KVCache
from kvtier.cli import cli
from kvtier.policies import CachePolicyFactory
from kvtier.sim.replay import PrimaryReplay, belady_min, replay, store_step
from kvtier.sim.synthetic import ChatShape, chat_trace
from kvtier.sim.trace import Request, TraceFormatError, parse_records, read_trace
from kvtier.testing import small_layout

BUILT_IN = ["lru", "leaf-lru", "arc", "s3fifo"]
SMALL_CHAT = ChatShape(conversations=80, system_prompts=3, think_s=20.0)


def chat_requests(seed: int, shape: ChatShape = SMALL_CHAT) -> list[Request]:
    return parse_records(enumerate(chat_trace(seed, shape), 1), "chat", block_size=256)


def write_trace(path: Path, records: list[Any], *, gzipped: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gzipped:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


# The reader ----------------------------------------------------------------


@pytest.mark.parametrize("gzipped", [False, True])
def test_reader_drops_partial_last_blocks_and_renumbers(tmp_path: Path, gzipped: bool) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1024, "hash_ids": [70, 71]},
            {"timestamp": 5, "input_length": 1100, "hash_ids": [70, 71, 99]},  # 99 partial
            {"timestamp": 9, "hash_ids": [0, 8]},  # no input_length: every block is full
        ],
        gzipped=gzipped,
    )
    requests = read_trace(path)
    assert [r.blocks for r in requests] == [(1, 2), (1, 2), (3, 4)]
    assert [r.timestamp for r in requests] == [0, 5, 9]
    # A smaller block size makes the 1100-token request's third id a full block.
    assert read_trace(path, block_size=256)[1].blocks == (1, 2, 3)
    assert len(read_trace(path, limit=2)) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"input_length": 512}', "'hash_ids' must be a list of ints, is missing"),
        ('{"hash_ids": "1,2"}', "'hash_ids' must be a list of ints, is a str"),
        ('{"hash_ids": [1, 2.5]}', "not an int"),
        ('{"hash_ids": [9, 2]}', "block 2 follows block 9 here but block 1 earlier"),
        ("[1, 2]", "must be a JSON object"),
        ('{"hash_ids": [1, 2]', "not JSON"),
        ('{"hash_ids": [5], "input_length": -1}', "'input_length' must be a non-negative int"),
    ],
)
def test_reader_names_file_and_line_of_a_bad_request(
    tmp_path: Path, line: str, message: str
) -> None:
    path = write_trace(tmp_path / "bad.jsonl", ['{"hash_ids": [1, 2, 3]}', "", line])
    with pytest.raises(TraceFormatError, match=message) as caught:
        read_trace(path)
    assert caught.value.line == 3 and str(caught.value).startswith(f"{path}:3: ")


def test_reader_rejects_truncated_gzip_empty_and_missing_files(tmp_path: Path) -> None:
    whole = gzip.compress(b"".join(b'{"hash_ids": [%d]}\n' % i for i in range(2000)))
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match=r"cut\.jsonl\.gz:\d+: truncated gzip stream"):
        read_trace(truncated)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="no request in the trace"):
        read_trace(empty)
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "absent.jsonl")


# The replay ----------------------------------------------------------------


def primary_beside_replay(policy: str, slots: int) -> tuple[KVCache, PrimaryReplay]:
    """A cache of ``slots`` primary slots under ``policy`` and no secondary
    tier, and the replay that should hit what it hits; block ``b`` is four
    tokens equal to ``b``."""
    layout = small_layout(chunk_tokens=4, head_dim=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * layout.slot_bytes,
        "eviction_policy": policy,
    }
    simulated = PrimaryReplay(CachePolicyFactory.create_cache_policy(policy, slots))
    return KVCache(config, layout), simulated


@pytest.mark.parametrize("policy", BUILT_IN)
def test_replay_matches_a_real_kvcache_hit_for_hit(policy: str) -> None:
    requests = chat_requests(seed=11)[:250]
    slots = 40
    cache, simulated = primary_beside_replay(policy, slots)
    real_hits, replay_hits = [], []
    with cache:
        assert cache.manager.primary.num_slots == slots
        for request in requests:
            # Block b is four tokens equal to b: equal ids give equal chained keys.
            tokens = [block for block in request.blocks for _ in range(4)]
            hit = cache.cached_prefix(tokens)
            if hit:
                cache.load(tokens, hit, lambda index, chunk: None)
            cache.store(tokens, lambda index, chunk: None)
            real_hits.append(hit // 4)
            replay_hits.append(simulated.request(request.blocks))
        evictions = cache.manager.primary.evictions
    assert real_hits == replay_hits
    # The comparison means something only if the tier both hit and evicted.
    assert sum(real_hits) > 0 and evictions > slots


def test_min_bounds_every_policy_and_reaches_the_compulsory_bound() -> None:
    requests = chat_requests(seed=3)
    distinct = len({b for r in requests for b in r.blocks})
    for capacity in (distinct // 20, distinct // 10, distinct // 4):
        optimum = belady_min(requests, capacity).hit_ratio
        for name in BUILT_IN:
            policy = CachePolicyFactory.create_cache_policy(name, capacity)
            assert replay(requests, policy, name).hit_ratio <= optimum
    # With room for everything, only first sights miss: every policy equals MIN.
    everything = belady_min(requests, distinct)
    first_sights = distinct / everything.chunks
    assert everything.hit_ratio == pytest.approx(1 - first_sights)
    lru = replay(requests, CachePolicyFactory.create_cache_policy("lru", distinct), "lru")
    assert lru.hits == everything.hits


def test_min_gives_up_the_deepest_of_equally_needed_chunks() -> None:
    # Two slots, every chunk admitted. For [3], blocks 1 and 2 are next needed
    # together: MIN gives up 2, the deeper, so 1 still starts a usable prefix.
    requests = [Request(0, blocks) for blocks in [(1, 2), (3,), (1, 2), (3,), (1, 2)]]
    assert belady_min(requests, 2).hits == 2  # block 1, twice
    # LRU gives up block 1, the older, and the first return then hits nothing.
    lru = replay(requests, CachePolicyFactory.create_cache_policy("lru", 2), "lru")
    assert lru.hits == 1


# The command -----------------------------------------------------------------


def simulate(*args: str, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == exit_code, result.output
    return result


def test_simulate_reports_every_policy_and_min_per_capacity(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "chat.jsonl.gz", chat_trace(5, SMALL_CHAT), gzipped=True)
    result = simulate(
        str(path),
        "--block-size",
        "256",
        "-p",
        "lru",
        "-p",
        "arc",
        "-c",
        "5%",
        "-c",
        "60",
        "--json",
    )
    report = json.loads(result.stdout)
    assert report["requests"] == len(chat_trace(5, SMALL_CHAT))
    distinct = report["distinct_chunks"]
    assert [c["slots"] for c in report["capacities"]] == [int(0.05 * distinct), 60]
    for cell in report["capacities"]:
        assert set(cell["policies"]) == {"lru", "arc"}
        lru = cell["policies"]["lru"]
        assert lru["gap_closed"] == 0 and lru["hit_ratio"] <= cell["min_hit_ratio"]
        assert lru["of_min"] == pytest.approx(lru["hit_ratio"] / cell["min_hit_ratio"])
    table = simulate(str(path), "--block-size", "256", "-c", "10%").stdout
    assert "MIN" in table and "s3fifo" in table


def test_simulate_replays_a_generated_chat_trace() -> None:
    report = json.loads(
        simulate("--chat-seed", "2", "--limit", "300", "-p", "lru", "--json").stdout
    )
    assert report["requests"] == 300 and len(report["capacities"]) == 3


def test_simulate_sizes_capacity_in_bytes_with_the_chunk_size() -> None:
    args = ["--chat-seed", "4", "--limit", "200", "-p", "lru", "--json"]
    by_size = json.loads(simulate(*args, "-c", "1MiB", "--chunk-bytes", "48KiB").stdout)
    by_count = json.loads(simulate(*args, "-c", "21").stdout)
    # 1 MiB of 48 KiB chunks: 21 whole slots, the same cell as asking for 21.
    assert by_size["capacities"] == by_count["capacities"]
    assert by_size["capacities"][0]["slots"] == 21


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-c", "0%"], "neither a share"),
        (["-c", "lots"], "neither a share"),
        (["-c", "8GiB"], "sizes need --chunk-bytes"),
        (["-c", "1KiB", "--chunk-bytes", "2KiB"], "neither a share"),
        (["--chunk-bytes", "lots"], "'lots' is not a size such as 2MiB"),
        (["-p", "nosuch"], "unknown cache policy 'nosuch'"),
    ],
)
def test_simulate_rejects_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [{"hash_ids": [1, 2]}])
    result = simulate(str(path), *args, exit_code=2)
    assert message in result.output


def test_simulate_bad_trace_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [{"hash_ids": [1, 2]}, {"hash_ids": {}}])
    result = simulate(str(path), exit_code=2)
    assert f"{path}:2: 'hash_ids' must be a list of ints, is a dict" in result.output
    assert "Traceback" not in result.output
    assert "not both or neither" in simulate(exit_code=2).output


def test_the_store_step_makes_room_for_what_a_tier_lacks_then_returns_it_in_order() -> None:
    asked: list[int] = []

    def make_room(count: int) -> bool:
        asked.append(count)
        return True

    # Holds 1 and 2 of 3: lacks 3 and 4 (3 given twice), one chunk must go.
    assert store_step([2, 3, 3, 4], {1, 2}, 3, make_room) == [3, 4]
    assert asked == [1]
    # Room enough: nothing evicted.
    assert store_step([5], {1}, 3, make_room) == [5]
    assert asked == [1]
    # No room to be made: nothing to insert, told apart from nothing lacked.
    assert store_step([7, 8], {1, 2, 3}, 3, lambda count: False) is None
    assert store_step([1, 2], {1, 2, 3}, 3, lambda count: False) == []


# Engine steps ------------------------------------------------------------------


@pytest.mark.parametrize("policy", BUILT_IN)
def test_batched_replay_matches_a_real_manager_driven_as_vllm_steps(policy: str) -> None:
    # Per step, as the vLLM connector drives the manager: every request's
    # lookup (its hits pinned for the step), then every request's
    # prepare_store, then one complete_store of all the step wrote.
    requests = chat_requests(seed=12)[:240]
    slots, step_size = 40, 4
    cache, simulated = primary_beside_replay(policy, slots)
    real_hits, replay_hits = [], []
    with cache:
        manager = cache.manager
        for start in range(0, len(requests), step_size):
            step = [r.blocks for r in requests[start : start + step_size]]
            keys = [cache.keys([b for b in blocks for _ in range(4)]) for blocks in step]
            loads = []
            for chain in keys:
                hits = manager.lookup(chain).hit_chunks
                manager.prepare_load(chain[:hits])
                loads.append(chain[:hits])
                real_hits.append(hits)
            written = []
            for chain in keys:
                reserved = manager.prepare_store(chain[:slots])
                written += list(reserved or ())
            manager.complete_store(written)
            for loaded in loads:
                manager.complete_load(loaded)
            replay_hits += simulated.step(step)
        evictions = manager.primary.evictions
    assert real_hits == replay_hits
    assert sum(real_hits) > 0 and evictions > slots


def test_a_request_never_hits_what_its_own_step_stores() -> None:
    requests = [Request(0, (1, 2)), Request(0, (1, 2, 3)), Request(0, (1, 2, 3))]
    lru = CachePolicyFactory.create_cache_policy
    assert replay(requests, lru("lru", 8), "lru").hits == 5
    assert replay(requests, lru("lru", 8), "lru", batch=2).hits == 3  # only the third
    assert replay(requests, lru("lru", 8), "lru", batch=3).hits == 0
    assert belady_min(requests, 8, batch=2).hits == 3
    assert belady_min(requests, 8, batch=3).hits == 0


def test_no_eviction_takes_what_its_step_loads_or_writes() -> None:
    # Three slots. Step 2 loads 1 and 2 for the first request, so the second
    # request's store (3 chunks) finds only one victim: it stores nothing.
    requests = [Request(0, (1, 2, 3)), Request(0, (1, 2)), Request(0, (4, 5, 6))]
    for name in BUILT_IN:
        primary = PrimaryReplay(CachePolicyFactory.create_cache_policy(name, 3))
        assert primary.step([requests[0].blocks]) == [0]
        assert primary.step([requests[1].blocks, requests[2].blocks]) == [2, 0]
        assert primary.resident == {1, 2, 3}
    # MIN alike: (9,) and (4, 5, 6) find no victim beside what their steps
    # write or load, so (1, 2, 3) stays for the last request.
    steps = [Request(0, blocks) for blocks in [(1, 2, 3), (9,), (1, 2), (4, 5, 6), (1, 2, 3)]]
    assert belady_min(steps, 3, batch=2).hits == 2 + 3


@pytest.mark.parametrize("batch", [4, 16])
def test_min_in_engine_steps_stays_above_the_built_in_policies(batch: int) -> None:
    # Not a theorem (Belady's rule ignores that a chunk serves only behind its
    # prefix, and a small tier in large steps can pass it), but on this trace
    # MIN in steps must still lead every built-in policy, and trail MIN alone.
    requests = chat_requests(seed=3)
    distinct = len({b for r in requests for b in r.blocks})
    for capacity in (distinct // 20, distinct // 5):
        optimum = belady_min(requests, capacity, batch=batch)
        assert optimum.hits <= belady_min(requests, capacity).hits
        for name in BUILT_IN:
            policy = CachePolicyFactory.create_cache_policy(name, capacity)
            assert replay(requests, policy, name, batch=batch).hits <= optimum.hits


def test_simulate_replays_in_engine_steps_and_shaped_chat() -> None:
    args = ["--chat-seed", "2", "--limit", "400", "-p", "lru", "-c", "10%", "--json"]
    one = json.loads(simulate(*args).stdout)
    steps = json.loads(simulate(*args, "--batch", "16").stdout)
    assert one["batch"] == 1 and steps["batch"] == 16
    by_step = steps["capacities"][0]
    assert (
        by_step["policies"]["lru"]["hit_ratio"]
        < one["capacities"][0]["policies"]["lru"]["hit_ratio"]
    )
    shaped = json.loads(
        simulate(
            *args, "--chat-shape", "block_size=64", "--chat-shape", "system_tokens=10-40"
        ).stdout
    )
    expected = chat_requests(2, ChatShape(block_size=64, system_tokens=(10, 40)))[:400]
    assert shaped["chunks"] == sum(len(r.blocks) for r in expected)
    assert shaped["trace"] == "chat seed 2, block_size=64, system_tokens=10-40"
    assert "leaf-lru" in simulate("--chat-seed", "2", "--limit", "100", "-c", "10%").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chat-shape", "turns=3"], "FIELD one of arrival_s, block_size"),
        (["--chat-shape", "mean_turns=-1"], "mean_turns must be a positive number"),
        (["--chat-shape", "conversations=2.5"], "conversations must be a positive number"),
        (["--chat-shape", "system_tokens=9-3"], "LOW-HIGH, 0 < LOW <= HIGH"),
        (["--batch", "0"], "--batch"),
        (["--batch", "4", "--secondary", "30%"], "cannot be combined with --batch"),
        (["--batch", "4", "--replicas", "4"], "cannot be combined with --batch"),
    ],
)
def test_simulate_rejects_bad_steps_and_shapes(args: list[str], message: str) -> None:
    assert message in simulate("--chat-seed", "1", *args, exit_code=2).output


def test_chat_shape_needs_a_generated_trace(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [{"hash_ids": [1, 2]}])
    result = simulate(str(path), "--chat-shape", "mean_turns=2", exit_code=2)
    assert "give --chat-seed too" in result.output
