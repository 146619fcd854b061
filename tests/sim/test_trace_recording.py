"""Recording a workload with TraceRecorder and replaying it with ``kvtier simulate``."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, cast

import pytest
from click.testing import CliRunner

from kvtier import KVCache
from kvtier.cli import cli
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.policies import CachePolicyFactory
from kvtier.recording import TraceRecorder
from kvtier.sim.replay import PrimaryReplay
from kvtier.sim.synthetic import ChatShape, chat_trace
from kvtier.sim.trace import Request, parse_records, read_trace
from kvtier.testing import small_layout

BLOCK = 4
NAMESPACE = b"kvtier-test-namespace"


def chat_trace_requests(seed: int) -> list[Request]:
    shape = ChatShape(conversations=80, system_prompts=3, think_s=20.0)
    return parse_records(enumerate(chat_trace(seed, shape), 1), "chat", block_size=256)


def prompts() -> list[list[int]]:
    """Three conversations sharing a system prompt, each turn extending the last."""
    system = list(range(100, 108))
    out = []
    for conversation in range(3):
        history = [*system]
        for turn in range(3):
            history += [1000 * conversation + 10 * turn + i for i in range(6)]
            out.append(list(history))
    return out


def record_all(recorder: TraceRecorder, requests: list[list[int]]) -> list[list[ChunkKey]]:
    keys = [chunk_keys(NAMESPACE, tokens, BLOCK) for tokens in requests]
    for tokens, request_keys in zip(requests, keys, strict=True):
        recorder.record(request_keys, len(tokens))
    return keys


def hold_writes(
    recorder: TraceRecorder, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Make ``recorder``'s writer stop at its next request until released:
    set ``entered`` once it holds one; set ``release`` to let it go on."""
    entered, release = threading.Event(), threading.Event()
    write = recorder._write

    def held_write(item: tuple[tuple[ChunkKey, ...], int, int, int]) -> None:
        entered.set()
        release.wait()
        write(item)

    monkeypatch.setattr(recorder, "_write", held_write)
    return entered, release


def test_a_recording_replays_with_the_same_prefix_structure(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    times = iter(float(t) for t in range(100))
    with TraceRecorder(path, block_size=BLOCK, clock=lambda: next(times)) as recorder:
        keys = record_all(recorder, prompts())
    assert recorder.written == len(keys) and recorder.dropped == recorder.failed_writes == 0
    text = path.read_text()
    # Anonymised: no key digest and no token id reaches the file.
    assert not any(key.hex() in text for request in keys for key in request)
    assert "1020" not in text
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["timestamp"] for r in records] == [1000 * (i + 1) for i in range(len(keys))]
    # Every request's partial last chunk is left out, as kvtier never stores one.
    assert all(len(r["hash_ids"]) == r["input_length"] // BLOCK for r in records)
    # The reader is told nothing: each record names its block size.
    requests = read_trace(path)
    ids: dict[ChunkKey, int] = {}
    for request, request_keys in zip(requests, keys, strict=True):
        assert request.blocks == tuple(ids.setdefault(k, len(ids) + 1) for k in request_keys)
    result = CliRunner().invoke(cli, ["simulate", str(path), "-c", "50%", "-p", "lru", "--json"])
    assert result.exit_code == 0, result.output
    cell = json.loads(result.stdout)["capacities"][0]
    # Conversations re-read their history: half the distinct chunks hold some of it.
    assert 0 < cell["policies"]["lru"]["hit_ratio"] <= cell["min_hit_ratio"]


def test_a_full_queue_drops_and_counts_and_never_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = TraceRecorder(tmp_path / "t.jsonl", block_size=BLOCK, queue_size=1)
    entered, release = hold_writes(recorder, monkeypatch)
    keys = chunk_keys(NAMESPACE, list(range(8)), BLOCK)
    recorder.record(keys, 8)
    assert entered.wait(10)  # the writer holds the first request
    recorder.record(keys, 8)  # fills the queue
    recorder.record(keys, 8)  # dropped, at once
    recorder.record(keys, 8)
    assert recorder.dropped == 2
    release.set()
    recorder.close()
    assert recorder.written == 2
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 2


def test_flush_writes_what_was_queued_and_returns_once_closed(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "t.jsonl", block_size=BLOCK)
    keys = chunk_keys(NAMESPACE, list(range(8)), BLOCK)
    for _ in range(3):  # far from half the queue: left to the writer's next wake-up
        recorder.record(keys, 8)
    recorder.flush()
    assert recorder.written == 3
    recorder.close()
    recorder.record(keys, 8)
    recorder.flush()  # the writer has stopped: nothing to wait for
    assert recorder.written == 3
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 3


def test_an_idle_writer_sleeps_until_a_request_comes(tmp_path: Path) -> None:
    calls: list[str] = []

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        # Python-level calls made by the writer thread (its name, kvtier-trace).
        if threading.current_thread().name == "kvtier-trace":
            calls.append(frame.f_code.co_name)

    threading.settrace(tracer)  # traces the threads started from here on
    try:
        recorder = TraceRecorder(tmp_path / "t.jsonl", block_size=BLOCK)
    finally:
        threading.settrace(cast(Any, None))  # None clears it; typeshed wants a function
    keys = chunk_keys(NAMESPACE, list(range(8)), BLOCK)
    recorder.record(keys, 8)
    recorder.flush()
    time.sleep(0.1)  # the writer goes back to waiting
    calls.clear()
    time.sleep(0.3)  # idle: a writer polling its queue would run code here
    assert calls == []
    recorder.record(keys, 8)  # a request wakes it
    recorder.close()
    assert recorder.written == 2 and "_write" in calls


def test_files_rotate_at_the_byte_cap_and_each_replays_alone(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    (path.parent / "t.jsonl").write_text('{"hash_ids": [7]}\n')  # an earlier process's file
    with TraceRecorder(path, block_size=BLOCK, max_bytes=300) as recorder:
        record_all(recorder, prompts())
    assert recorder.rotations >= 2 and recorder.written == len(prompts())
    rotated = path.with_name("t.jsonl.1")
    assert path.stat().st_size <= 300 + 200 and rotated.exists()
    for file in (path, rotated):
        records = [json.loads(line) for line in file.read_text().splitlines()]
        # Each file numbers its keys afresh, from 0, so it replays alone.
        assert min(min(r["hash_ids"]) for r in records) == 0
        assert read_trace(file)


def test_an_unwritable_path_is_logged_once_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "missing-dir" / "t.jsonl"
    with (
        caplog.at_level(logging.WARNING, "kvtier.recording"),
        TraceRecorder(path, block_size=BLOCK) as recorder,
    ):
        record_all(recorder, prompts())
    assert recorder.failed_writes == len(prompts()) and recorder.written == 0
    warnings = [r for r in caplog.records if "cannot write trace" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()


# Recording through KVCache (and so the transformers integration) ---------------


def replayed_hits(path: Path, policy: str, slots: int) -> list[int]:
    """Per-request hits of ``policy`` replaying the trace at ``path``, as simulate does."""
    simulated = PrimaryReplay(CachePolicyFactory.create_cache_policy(policy, slots))
    return [simulated.request(request.blocks) for request in read_trace(path)]


@pytest.mark.parametrize("policy", ["leaf-lru", "lru"])
def test_a_recording_made_through_kvcache_replays_to_the_same_hits(
    tmp_path: Path, policy: str
) -> None:
    requests = chat_trace_requests(seed=5)[:200]
    slots = 40
    layout = small_layout(chunk_tokens=4, head_dim=4)
    path = tmp_path / "traffic.jsonl"
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": slots * layout.slot_bytes,
        "eviction_policy": policy,
        "trace_recording": {"path": str(path)},
    }
    real_hits = []
    with KVCache(config, layout) as cache:
        for number, request in enumerate(requests):
            # Block b is four tokens equal to b, plus a partial chunk on odd requests.
            tokens = [block for block in request.blocks for _ in range(4)] + [7] * (number % 2)
            hit = cache.cached_prefix(tokens)
            cache.store(tokens, lambda index, chunk: None)
            real_hits.append(hit // 4)
        recorder = cache.trace_recorder
        assert recorder is not None
        recorder.flush()
        assert cache.metrics.registry.get_sample_value(
            "kvtier_trace_requests_recorded_total"
        ) == len(requests)
        assert (
            cache.metrics.registry.get_sample_value(
                "kvtier_trace_requests_dropped_total", {"reason": "queue_full"}
            )
            == 0
        )
    # Closing the cache closed the recorder: everything is on disk.
    assert len(path.read_text().splitlines()) == len(requests)
    assert sum(real_hits) > 0
    assert replayed_hits(path, policy, slots) == real_hits
    result = CliRunner().invoke(
        cli, ["simulate", str(path), "-c", str(slots), "-p", policy, "--json"]
    )
    assert result.exit_code == 0, result.output
    cell = json.loads(result.stdout)["capacities"][0]["policies"][policy]
    chunks = sum(len(request.blocks) for request in requests)
    assert cell["hit_ratio"] == pytest.approx(sum(real_hits) / chunks)


def test_recording_is_off_by_default_and_dropped_requests_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = small_layout(chunk_tokens=4, head_dim=4)
    with KVCache({"chunk_tokens": 4}, layout) as cache:
        assert cache.trace_recorder is None
        cache.cached_prefix(list(range(16)))
        assert (
            cache.metrics.registry.get_sample_value("kvtier_trace_requests_recorded_total") is None
        )
    path = tmp_path / "traffic.jsonl"
    config = {"chunk_tokens": 4, "trace_recording": {"path": str(path), "queue_size": 1}}
    with KVCache(config, layout) as cache:
        recorder = cache.trace_recorder
        assert recorder is not None
        entered, release = hold_writes(recorder, monkeypatch)
        cache.cached_prefix(list(range(16)))
        assert entered.wait(10)
        for _ in range(3):  # one fills the queue, two are dropped, none waits
            assert cache.cached_prefix(list(range(16))) == 0
        assert (
            cache.metrics.registry.get_sample_value(
                "kvtier_trace_requests_dropped_total", {"reason": "queue_full"}
            )
            == 2
        )
        release.set()
    assert len(path.read_text().splitlines()) == 2


def test_a_trace_path_no_file_can_be_written_at_fails_when_the_cache_starts(
    tmp_path: Path,
) -> None:
    layout = small_layout(chunk_tokens=4, head_dim=4)
    for path, problem in [
        (tmp_path / "missing-dir" / "traffic.jsonl", "not a directory this process can write"),
        (tmp_path, "is a directory: name a file"),
    ]:
        with pytest.raises(ConfigError) as info:
            KVCache({"chunk_tokens": 4, "trace_recording": {"path": str(path)}}, layout)
        ((where, message),) = info.value.problems
        assert where == "trace_recording.path" and problem in message


def test_a_trace_path_that_goes_away_never_stops_the_cache(tmp_path: Path) -> None:
    layout = small_layout(chunk_tokens=4, head_dim=4)
    folder = tmp_path / "traces"
    folder.mkdir()
    path = folder / "traffic.jsonl"
    with KVCache({"chunk_tokens": 4, "trace_recording": {"path": str(path)}}, layout) as cache:
        folder.rmdir()  # before the first write: the file is opened then
        tokens = list(range(16))
        cache.store(tokens, lambda index, chunk: None)
        assert cache.cached_prefix(tokens) == 16
        recorder = cache.trace_recorder
        assert recorder is not None
        recorder.flush()
        assert (
            cache.metrics.registry.get_sample_value(
                "kvtier_trace_requests_dropped_total", {"reason": "write_failed"}
            )
            == 1
        )


def test_a_bad_trace_recording_option_names_its_path() -> None:
    with pytest.raises(ConfigError, match=r"trace_recording\.max_bytes"):
        load_config({"trace_recording": {"path": "t.jsonl", "max_bytes": 0}})
    with pytest.raises(ConfigError, match=r"trace_recording\.pth"):
        load_config({"trace_recording": {"pth": "t.jsonl"}})
