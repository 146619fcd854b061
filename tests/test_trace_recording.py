"""Recording a workload with TraceRecorder and replaying it with ``kvtier simulate``."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import cli
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.sim.record import TraceRecorder
from kvtier.sim.trace import read_trace

BLOCK = 4
NAMESPACE = b"kvtier-test-namespace"


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


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "t.jsonl", block_size=BLOCK, queue_size=1)
    entered, release = threading.Event(), threading.Event()
    write = recorder._write

    def held_write(item: tuple[tuple[ChunkKey, ...], int, int, int]) -> None:
        entered.set()
        release.wait()
        write(item)

    recorder._write = held_write  # type: ignore[method-assign]
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
        caplog.at_level(logging.WARNING, "kvtier.sim.record"),
        TraceRecorder(path, block_size=BLOCK) as recorder,
    ):
        record_all(recorder, prompts())
    assert recorder.failed_writes == len(prompts()) and recorder.written == 0
    warnings = [r for r in caplog.records if "cannot write trace" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
