"""The ``fs`` tier meets things that are not chunk files: FIFOs, symlinks,
directories and devices at chunk paths, unexaminable paths, stray entries,
and files a process killed during start-up left behind."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import CorruptChunkError
from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup, LookupContext
from kvtier.tiers.local import ItemErrors
from tests.tiers.fs.fs_support import FILE_BYTES, LAYOUT, fs_tier, open_tier

pytestmark = pytest.mark.usefixtures("chunk_io")


def chunk_path(harness: TierHarness, key: bytes) -> Path:
    return Path(fs_tier(harness).dir.chunk_path(key))


def release_fifo(path: Path) -> None:
    """Let go of a reader blocked opening the FIFO at ``path``, if any (so that
    a failing test ends instead of hanging in ``close()``)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


# Each replaces the chunk file at ``path`` (``outside``: a path outside the tree).


def _fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _empty_directory(path: Path, outside: Path) -> None:
    path.unlink()
    path.mkdir()


def _symlink_to_a_valid_chunk(path: Path, outside: Path) -> None:
    # The target holds this very chunk's bytes: following it would "work",
    # and the use-stamp would write the target's mtime.
    os.replace(path, outside)
    path.symlink_to(outside)


def _symlink_to_dev_zero(path: Path, outside: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _dangling_symlink(path: Path, outside: Path) -> None:
    path.unlink()
    path.symlink_to(outside.parent / "nowhere")


def _socket(path: Path, outside: Path) -> None:
    path.unlink()
    # Bound by its name relative to the bucket: the full path is longer
    # than a socket address holds. open(2) of a socket fails with ENXIO.
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(path.name)
    finally:
        os.chdir(cwd)


def _symlink_loop(path: Path, outside: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


def _name(make: Callable[[Path, Path], None]) -> str:
    return make.__name__.strip("_")


@pytest.mark.parametrize(
    "make",
    [
        _fifo,
        _empty_directory,
        _symlink_to_a_valid_chunk,
        _symlink_to_dev_zero,
        _dangling_symlink,
        _socket,
        _symlink_loop,
    ],
    ids=_name,
)
def test_a_load_treats_a_non_file_at_a_chunk_path_as_corrupt(
    harness: TierHarness, tmp_path: Path, make: Callable[[Path, Path], None]
) -> None:
    good, bad = harness.keys(2)
    data = harness.fill([0, 1])
    assert harness.store([good, bad], [0, 1]).success
    path = chunk_path(harness, bad)
    outside = tmp_path / "outside.kvc"
    make(path, outside)
    hour_ago = time.time() - 3600
    if outside.exists():
        os.utime(outside, (hour_ago, hour_ago))
    try:
        result = harness.load([good, bad], [2, 3])
    finally:
        release_fifo(path)
    assert not result.success and result.succeeded == frozenset([good])
    np.testing.assert_array_equal(harness.buffer.array[2], data[0])
    assert fs_tier(harness).stats.corrupt_chunks == 1
    assert not os.path.lexists(path)  # removed: a link, a FIFO, an empty directory
    assert harness.lookup(bad) is Lookup.MISS
    if outside.exists():  # a link's target is never touched
        assert outside.stat().st_mtime == pytest.approx(hour_ago)
        assert outside.stat().st_size == FILE_BYTES
    # Nothing is stuck: a new store of the key works and loads back exactly.
    harness.buffer.array[4] = data[1]
    assert harness.store([bad], [4]).success
    assert harness.load([bad], [5]).success
    np.testing.assert_array_equal(harness.buffer.array[5], data[1])


def test_a_non_empty_directory_at_a_chunk_path_is_counted_and_left(harness: TierHarness) -> None:
    key = harness.keys(1)[0]
    harness.fill([0])
    assert harness.store([key], [0]).success
    path = chunk_path(harness, key)
    path.unlink()
    (path / "someone's").mkdir(parents=True)
    assert not harness.load([key], [1]).success
    assert fs_tier(harness).stats.corrupt_chunks == 1
    assert (path / "someone's").is_dir()  # not ours to delete recursively


@pytest.mark.parametrize("make", [_fifo, _empty_directory, _dangling_symlink], ids=_name)
def test_an_existence_check_treats_a_non_file_as_corrupt(
    root: Path, tmp_path: Path, make: Callable[[Path, Path], None]
) -> None:
    writer, reader = open_tier(root), open_tier(root)  # the reader's index is empty
    try:
        key = writer.keys(1)[0]
        writer.fill([0])
        assert writer.store([key], [0]).success
        path = chunk_path(writer, key)
        make(path, tmp_path / "outside.kvc")
        assert reader.lookup(key) is Lookup.MISS
        assert fs_tier(reader).stats.corrupt_chunks == 1
        assert not os.path.lexists(path)
    finally:
        writer.close()
        reader.close()


def test_one_unexaminable_path_does_not_poison_a_batch_of_existence_checks(root: Path) -> None:
    writer, reader = open_tier(root), open_tier(root)
    try:
        keys = writer.keys(30)
        writer.fill(range(len(keys)))
        assert writer.store(keys, list(range(len(keys)))).success
        # One bucket becomes a symlink loop: stat(2) of its chunks fails with ELOOP.
        looped = chunk_path(writer, keys[0]).parent
        others = [k for k in keys if chunk_path(writer, k).parent != looped]
        assert len(others) > 20
        os.rename(looped, looped.with_name("moved"))
        looped.symlink_to(looped.name)
        with pytest.raises(OSError) as caught:
            os.stat(chunk_path(writer, keys[0]))
        assert caught.value.errno == errno.ELOOP
        tier = fs_tier(reader)
        # One step asks for all of them: one batch of existence checks.
        assert {tier.lookup(k, LookupContext()) for k in keys} == {Lookup.PENDING}
        answers = {k: reader.lookup(k) for k in keys}
        assert answers[keys[0]] is Lookup.MISS
        assert [answers[k] for k in others] == [Lookup.HIT] * len(others)
        assert reader.load(others[:4], [0, 1, 2, 3]).success
    finally:
        writer.close()
        reader.close()


def test_reindex_survives_anything_in_the_tree_and_keeps_the_bound(root: Path) -> None:
    first = open_tier(root)
    keys = first.keys(14)
    first.fill(range(14))
    assert first.store(keys, list(range(14))).success
    first.close()
    paths = [Path(first.tier.dir.chunk_path(k)) for k in keys]
    for path in paths[10:]:
        path.unlink()
    paths[10].mkdir()  # a directory named <key>.kvc
    (paths[11] / "inner").mkdir(parents=True)  # one that is not empty
    os.mkfifo(paths[12])  # a FIFO named <key>.kvc
    target = root.parent / "outside.kvc"
    target.write_bytes(bytes(FILE_BYTES))
    paths[13].symlink_to(target)  # a symlink named <key>.kvc
    (paths[0].parent / "README").write_text("not a chunk")
    (paths[1].parent / "notes").mkdir()
    (paths[0].parent.parent / "zz-not-a-bucket").write_text("x")
    second = open_tier(root, max_bytes=6 * FILE_BYTES)
    try:
        tier = fs_tier(second)
        assert tier.index_ready
        assert tier.stats.corrupt_chunks == 4
        assert tier.scan_skipped == 2
        assert not paths[10].exists() and not os.path.lexists(paths[12])
        assert not os.path.lexists(paths[13]) and target.stat().st_size == FILE_BYTES
        assert (paths[11] / "inner").is_dir()
        # All ten chunks were indexed, so the bound could drop four of them.
        assert tier.stats.evictions == 4
        on_disk = [k for k in keys[:10] if os.path.exists(Path(tier.dir.chunk_path(k)))]
        assert len(on_disk) == 6
        assert [second.lookup(k) for k in on_disk] == [Lookup.HIT] * 6
        assert (paths[0].parent / "README").exists()
    finally:
        second.close()


_KILLED_IN_START_UP = """
import json, os, signal, sys
from kvtier.testing import TierHarness, small_layout

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "namespace":
    json.dump = die  # killed while NAMESPACE.json is written
else:
    os.pwrite = die  # killed inside the O_DIRECT probe
TierHarness({"type": "fs", "root_dir": sys.argv[1]}, small_layout()).close()
"""


@pytest.mark.parametrize("where", ["namespace", "probe"])
def test_files_of_a_process_killed_during_start_up_are_removed(root: Path, where: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_IN_START_UP, str(root), where],
        capture_output=True,
        text=True,
        check=False,
    )
    if where == "probe" and child.returncode == 0:
        pytest.skip(f"O_DIRECT cannot be opened in {root}: the probe wrote nothing")
    assert child.returncode == -9, child.stderr
    namespace_dir = root / LAYOUT.namespace.hex()
    left = [p for p in namespace_dir.iterdir() if p.name.startswith(".")]
    assert len(left) == 1, left
    harness = open_tier(root)
    try:
        assert [p for p in namespace_dir.iterdir() if p.name.startswith(".")] == []
        key = harness.keys(1)[0]
        harness.fill([0])
        assert harness.store([key], [0]).success
    finally:
        harness.close()


def _bucket_file(bucket: Path, outside: Path) -> None:
    bucket.write_text("not a bucket")


def _bucket_symlink_outside(bucket: Path, outside: Path) -> None:
    outside.mkdir()
    bucket.symlink_to(outside)


def _bucket_dangling_symlink(bucket: Path, outside: Path) -> None:
    bucket.symlink_to(outside)


def _bucket_fifo(bucket: Path, outside: Path) -> None:
    os.mkfifo(bucket)


@pytest.mark.parametrize(
    "make",
    [_bucket_file, _bucket_symlink_outside, _bucket_dangling_symlink, _bucket_fifo],
    ids=_name,
)
def test_a_start_replaces_a_bucket_that_is_not_a_directory(
    root: Path, tmp_path: Path, make: Callable[[Path, Path], None]
) -> None:
    first = open_tier(root)
    key, other = first.keys(2)
    while other[0] == key[0]:  # another bucket
        other = first.keys(1)[0]
    data = first.fill([0, 1])
    assert first.store([other], [1]).success
    bucket = chunk_path(first, key).parent
    first.close()
    shutil.rmtree(bucket)
    outside = tmp_path / "outside"
    make(bucket, outside)
    harness = open_tier(root)
    try:
        assert bucket.is_dir() and not bucket.is_symlink()
        harness.buffer.array[0] = data[0]
        assert harness.store([key], [0]).success
        assert harness.load([key, other], [2, 3]).success
        np.testing.assert_array_equal(harness.buffer.array[2:4], data)
        assert not outside.exists() or list(outside.iterdir()) == []  # nothing written through
    finally:
        harness.close()


def test_a_damaged_file_the_re_index_removes_during_its_load_counts_once(
    harness: TierHarness,
) -> None:
    """A load's verification and the start-up re-index may both find one damaged
    file: whichever removes it counts it, the other does not."""
    tier = fs_tier(harness)
    key = harness.keys(1)[0]
    harness.fill([0])
    assert harness.store([key], [0]).success
    path = chunk_path(harness, key)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 1)  # torn: the wrong size for a chunk
    real_load = tier.backend.load_many

    def load_raced_by_the_re_index(
        keys: Sequence[ChunkKey], outs: Sequence[memoryview]
    ) -> ItemErrors:
        errors = real_load(keys, outs)
        if any(isinstance(error, CorruptChunkError) for error in errors):
            tier.backend.index.drop_broken([str(path)])  # the re-index removes it first
        return errors

    tier.backend.load_many = load_raced_by_the_re_index  # type: ignore[method-assign]
    assert not harness.load([key], [1]).success
    assert not path.exists()
    assert tier.stats.corrupt_chunks == 1
