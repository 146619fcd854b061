"""The fs tier's store and load path: chunks grouped per I/O task, chunks
already on disk found before they are hashed, temp names without a system call."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs import io as fs_io
from kvtier.tiers.fs.backend import FsBackend
from kvtier.tiers.fs.layout import _TMP_NAME, HOST, NamespaceDir
from tests.tiers.fs.fs_support import FILE_BYTES, LAYOUT, fs_tier, open_tier

pytestmark = pytest.mark.usefixtures("chunk_io")


@pytest.fixture
def fs_options() -> dict[str, Any]:
    return {"io_threads": 4}


def _split(tier: FilesystemTier, count: int, backlog: int) -> list[list[int]]:
    tier.workers.backlog = lambda: backlog  # type: ignore[method-assign]
    groups = tier._split([(ChunkKey(bytes([i]) * 32), i) for i in range(count)])
    return [[slot for _, slot in group] for group in groups]


def test_a_job_spreads_over_idle_workers_one_chunk_each(harness: TierHarness) -> None:
    assert _split(fs_tier(harness), 3, backlog=0) == [[0], [1], [2]]


def test_a_job_larger_than_the_workers_is_grouped_in_order(harness: TierHarness) -> None:
    # Four idle workers, ten chunks: four groups, every fourth chunk, so
    # that the first chunks of the job start first.
    assert _split(fs_tier(harness), 10, backlog=0) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


def test_a_backed_up_queue_groups_up_to_io_batch_chunks(harness: TierHarness) -> None:
    tier = fs_tier(harness)
    assert tier.backend.group_chunks == tier.io_batch  # small chunks
    groups = _split(tier, 20, backlog=tier.io_threads)
    assert sorted(slot for group in groups for slot in group) == list(range(20))
    assert max(map(len, groups)) <= tier.io_batch
    assert len(groups) == -(-20 // tier.io_batch)


@pytest.mark.parametrize(("chunks_in_batch_bytes", "group"), [(1, 1), (0.5, 1), (3, 3)])
def test_a_backed_up_queue_groups_large_chunks_up_to_batch_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks_in_batch_bytes: float, group: int
) -> None:
    # A job of large chunks queued behind others still spreads over the
    # workers, so that a prefix's promotion jobs end in their order.
    batch_bytes = int(chunks_in_batch_bytes * LAYOUT.slot_bytes)
    monkeypatch.setattr(FsBackend, "batch_bytes", batch_bytes)
    tier = open_tier(tmp_path, io_threads=4)
    try:
        groups = _split(fs_tier(tier), 12, backlog=4)
        assert sorted(slot for group in groups for slot in group) == list(range(12))
        assert max(map(len, groups)) == group
    finally:
        tier.close()


def test_grouped_jobs_move_every_byte_and_fail_only_the_bad_chunk(
    harness: TierHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = fs_tier(harness)
    monkeypatch.setattr(tier.workers, "backlog", lambda: tier.io_threads)  # groups of io_batch
    keys = harness.keys(20)
    data = harness.fill(range(20))
    assert harness.store(keys, list(range(20))).success
    with open(tier.dir.chunk_path(keys[5]), "r+b") as chunk:
        chunk.write(b"\xff" * 16)  # corrupt one chunk of a group
    harness.buffer.array[:20] = 0
    result = harness.load(keys, list(range(20)))
    assert result.succeeded == frozenset(keys) - {keys[5]}
    for slot in set(range(20)) - {5}:
        np.testing.assert_array_equal(harness.buffer.array[slot], data[slot])
    assert not os.path.exists(tier.dir.chunk_path(keys[5]))  # deleted as corrupt


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "max_bytes"])
def test_a_chunk_another_process_stored_is_neither_hashed_nor_written_in_a_group(
    root: Path, monkeypatch: pytest.MonkeyPatch, bounded: bool
) -> None:
    options = {"max_bytes": 8 * FILE_BYTES} if bounded else {}
    late = open_tier(root, io_threads=4, **options)  # indexed before the chunk exists
    other = open_tier(root, io_threads=4, **options)
    try:
        keys = other.keys(3)
        other.fill(range(3))
        assert other.store(keys[:2], [0, 1]).success
        path = fs_tier(late).dir.chunk_path(keys[0])
        before = os.stat(path)
        # The store call hashes only after it found no complete file (see
        # test_fs_chunkio): what reaches it, and what it wrote, tells all.
        calls: list[tuple[str, bool]] = []
        real_store = fs_io._store_file

        def recording(temp: str, final: str, *args: object) -> bool:
            written = real_store(temp, final, *args)  # type: ignore[arg-type]
            calls.append((final, written))
            return written

        monkeypatch.setattr(fs_io, "_store_file", recording)
        tier = fs_tier(late)
        monkeypatch.setattr(tier.workers, "backlog", lambda: tier.io_threads)  # one group of three
        late.fill(range(3))
        assert late.store(keys, [0, 1, 2]).success
        assert calls == [(tier.dir.chunk_path(keys[2]), True)]  # only the chunk that was missing
        after = os.stat(path)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert fs_tier(late).held_bytes == 3 * FILE_BYTES
        # A chunk alone goes to the store call (unless the shared index
        # already counts it), which finds the file in place and leaves it.
        (alone,) = other.keys(1)
        assert other.store([alone], [0]).success
        alone_path = tier.dir.chunk_path(alone)
        before = os.stat(alone_path)
        calls.clear()
        monkeypatch.setattr(tier.workers, "backlog", lambda: 0)
        assert late.store([alone], [0]).success
        after = os.stat(alone_path)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert calls == ([] if bounded else [(alone_path, False)])
    finally:
        late.close()
        other.close()


def test_complete_files_names_only_regular_files_of_the_size(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    whole.write_bytes(b"x" * 100)
    short = tmp_path / "short"
    short.write_bytes(b"x" * 99)
    link = tmp_path / "link"
    link.symlink_to(whole)
    directory = tmp_path / "dir"
    directory.mkdir()
    paths = [whole, short, link, directory, tmp_path / "missing"]
    assert fs_io.complete_files([str(p) for p in paths], 100) == [True] + [False] * 4
    assert fs_io.complete_files([], 100) == []


def test_temp_names_are_unique_and_name_this_host_and_process(tmp_path: Path) -> None:
    directory = NamespaceDir(tmp_path, bytes(32))
    final = directory.chunk_path(bytes(32))
    names = {directory.temp_path(final) for _ in range(1000)}
    assert len(names) == 1000
    for name in names:
        match = _TMP_NAME.match(os.path.basename(name))
        assert match is not None
        assert (match["host"], int(match["pid"])) == (HOST, os.getpid())
        assert os.path.dirname(name) == os.path.dirname(final)


def test_a_forked_child_names_its_temp_files_with_its_own_pid(tmp_path: Path) -> None:
    directory = NamespaceDir(tmp_path, bytes(32))
    final = directory.chunk_path(bytes(32))
    parent_name = directory.temp_path(final)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its name and leave at once
        os.close(read_end)
        os.write(write_end, directory.temp_path(final).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        child_name = pipe.read().decode()
    os.waitpid(pid, 0)
    child = _TMP_NAME.match(os.path.basename(child_name))
    parent = _TMP_NAME.match(os.path.basename(parent_name))
    assert child is not None and parent is not None
    assert int(child["pid"]) == pid and int(parent["pid"]) == os.getpid()
