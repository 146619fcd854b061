"""The shared index of a bounded ``fs`` root under hostile conditions: its
files deleted or replaced while tiers run, the namespace directory removed,
odd entries at the index's paths, and a lock another process never lets go.

Two tiers in one test process stand for two processes (see
``test_fs_shared_bound.py``): each has its own connection to the index and
its own open file description of the lock file.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup
from kvtier.tiers.fs import shared_index
from kvtier.tiers.fs.shared_index import INDEX_FILE, LOCK_FILE
from tests.tiers.fs.fs_support import fs_tier
from tests.tiers.fs.fs_worker import LAYOUT
from tests.tiers.fs.test_fs_shared_bound import FILE_BYTES, disk_bytes, open_tier, store_new

pytestmark = pytest.mark.usefixtures("chunk_io")

BOUND_FILES = 6


def namespace_dir(harness: TierHarness) -> Path:
    return Path(fs_tier(harness).dir.path)


def remove_index_files(directory: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{directory / INDEX_FILE}{suffix}").unlink(missing_ok=True)


def remove_namespace_dir(directory: Path) -> None:
    shutil.rmtree(directory)


def remove_index_and_lock(directory: Path) -> None:
    remove_index_files(directory)
    (directory / LOCK_FILE).unlink()


def replace_index_with_garbage(directory: Path) -> None:
    remove_index_files(directory)
    (directory / INDEX_FILE).write_bytes(b"not a database" * 100)


def _name(damage: Callable[[Path], None]) -> str:
    return damage.__name__


@pytest.mark.parametrize(
    "damage",
    [remove_index_files, remove_index_and_lock, replace_index_with_garbage, remove_namespace_dir],
    ids=_name,
)
def test_the_bound_holds_when_the_index_goes_away_under_running_tiers(
    root: Path, damage: Callable[[Path], None]
) -> None:
    """A tier still running on the index's old files and a tier started after
    they went must share one bound again, whoever stores next."""
    first = open_tier(root, BOUND_FILES)
    try:
        old = store_new(first, 3)
        old_data = first.buffer.array[0:3].copy()
        damage(namespace_dir(first))
        second = open_tier(root, BOUND_FILES)
        try:
            for _ in range(5):
                for harness in (first, second):
                    store_new(harness, 2)
                    assert disk_bytes(root) <= BOUND_FILES * FILE_BYTES
            # Whatever survived of the old chunks still loads exactly.
            for index, key in enumerate(old):
                if os.path.exists(fs_tier(second).dir.chunk_path(key)):
                    assert second.load([key], [20]).success
                    np.testing.assert_array_equal(second.buffer.array[20], old_data[index])
        finally:
            second.close()
    finally:
        first.close()


def test_a_running_tier_counts_the_files_again_after_its_index_was_deleted(root: Path) -> None:
    harness = open_tier(root, BOUND_FILES)
    try:
        store_new(harness, 4)
        remove_index_files(namespace_dir(harness))
        for _ in range(4):
            store_new(harness, 2)
            assert disk_bytes(root) <= BOUND_FILES * FILE_BYTES
        assert fs_tier(harness).held_bytes == disk_bytes(root)
    finally:
        harness.close()


@pytest.fixture
def held_lock(root: Path) -> Iterator[Callable[[TierHarness], None]]:
    """Take the index lock as another process would (its own open file
    description) and hold it until the test ends."""
    fds: list[int] = []

    def hold(harness: TierHarness) -> None:
        fd = os.open(namespace_dir(harness) / LOCK_FILE, os.O_RDWR)
        fds.append(fd)
        fcntl.flock(fd, fcntl.LOCK_EX)

    yield hold
    for fd in fds:
        os.close(fd)


def test_a_lock_never_let_go_fails_stores_instead_of_hanging_them(
    root: Path, held_lock: Callable[[TierHarness], None]
) -> None:
    # A process stopped (SIGSTOP) or hung inside a change of the index. One
    # I/O thread: nothing of the tier's own waits on the lock before the test
    # holds it, however slow a loaded machine makes the tier.
    harness = open_tier(root, BOUND_FILES, index_lock_timeout_s=0.2, io_threads=1)
    stored = store_new(harness, 2)
    data = harness.buffer.array[0:2].copy()
    held_lock(harness)
    keys = harness.keys(2)
    harness.fill([2, 3])
    result = harness.store(keys, [2, 3])  # the harness fails the test if this hangs
    assert not result.success and result.succeeded == frozenset()
    assert not any(os.path.exists(fs_tier(harness).dir.chunk_path(k)) for k in keys)
    # Loads still work: use stamps wait in memory.
    assert harness.load(stored, [4, 5]).success
    np.testing.assert_array_equal(harness.buffer.array[4:6], data)
    assert [harness.lookup(k) for k in stored] == [Lookup.HIT, Lookup.HIT]
    harness.close()  # returns, leaving the stamps it could not write


def test_the_lock_timeout_must_be_positive(root: Path) -> None:
    with pytest.raises(ValueError, match="index_lock_timeout_s"):
        open_tier(root, BOUND_FILES, index_lock_timeout_s=0)


def _empty_directory(path: Path) -> None:
    path.mkdir()


def _directory_with_a_file(path: Path) -> None:
    path.mkdir()
    (path / "something").write_text("kept")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink_outside(path: Path) -> None:
    path.symlink_to(path.parent.parent.parent / "outside")


def _symlink_loop(path: Path) -> None:
    path.symlink_to(path)


@pytest.mark.parametrize("which", [INDEX_FILE, LOCK_FILE])
@pytest.mark.parametrize(
    "make",
    [_empty_directory, _directory_with_a_file, _fifo, _symlink_outside, _symlink_loop],
    ids=lambda make: make.__name__.strip("_"),
)
def test_a_tier_starts_over_anything_at_the_index_paths(
    root: Path, tmp_path: Path, which: str, make: Callable[[Path], None]
) -> None:
    first = open_tier(root, BOUND_FILES)
    keys = store_new(first, 3)
    data = first.buffer.array[0:3].copy()
    directory = namespace_dir(first)
    first.close()
    remove_index_files(directory)
    (directory / LOCK_FILE).unlink()
    make(directory / which)
    second = open_tier(root, BOUND_FILES)
    try:
        assert fs_tier(second).held_bytes == 3 * FILE_BYTES
        assert second.load(keys, [10, 11, 12]).success
        np.testing.assert_array_equal(second.buffer.array[10:13], data)
        for _ in range(3):
            store_new(second, 3)
            assert disk_bytes(root) <= BOUND_FILES * FILE_BYTES
        assert not (tmp_path / "outside").exists()  # a link is never followed
        assert (directory / which).is_file() and not (directory / which).is_symlink()
    finally:
        second.close()


@pytest.mark.parametrize("index_before", [True, False], ids=["index-kept", "index-new"])
def test_a_chunk_file_dated_in_the_future_does_not_outlive_chunks_in_use(
    root: Path, monkeypatch: pytest.MonkeyPatch, index_before: bool
) -> None:
    monkeypatch.setattr(shared_index, "STAMP_FLUSH_S", 0.0)
    if index_before:  # an index that will not count the files stored below
        open_tier(root, 4).close()
    unbounded = open_tier(root)
    keys = store_new(unbounded, 4)
    unbounded.close()
    future = time.time() + 365 * 86400
    os.utime(fs_tier(unbounded).dir.chunk_path(keys[0]), (future, future))
    bounded = open_tier(root, 4)
    try:
        assert bounded.load(keys[1:], [10, 11, 12]).success  # in use now
        store_new(bounded, 1)  # room for one: the least recently used goes
        present = [os.path.exists(fs_tier(bounded).dir.chunk_path(k)) for k in keys]
        assert present == [False, True, True, True]
    finally:
        bounded.close()


def test_an_index_that_cannot_be_opened_fails_start_up_clearly_and_is_kept(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk or an I/O error while opening the index is no damage of
    the index: it is not deleted (other processes use it), and the start
    fails naming the directory and the cause."""
    first = open_tier(root, BOUND_FILES)
    store_new(first, 2)
    index = namespace_dir(first) / INDEX_FILE
    first.close()
    before = index.read_bytes()

    def full_disk(*args: object, **kwargs: object) -> sqlite3.Connection:
        error = sqlite3.OperationalError("database or disk is full")
        error.sqlite_errorcode = 13  # SQLITE_FULL, as sqlite3 sets it
        raise error

    monkeypatch.setattr(shared_index.sqlite3, "connect", full_disk)
    with pytest.raises(OSError) as caught:
        open_tier(root, BOUND_FILES)
    message = str(caught.value)
    assert str(namespace_dir(first)) in message
    assert "OperationalError: database or disk is full" in message
    assert index.read_bytes() == before


def test_uses_keep_their_order_when_the_clock_is_set_back(tmp_path: Path) -> None:
    """Eviction follows the order of use, not of the wall clock: after the
    clock went back an hour, the chunk just loaded is still the most recently
    used, and a chunk stored now is newer than those stored before."""
    now = [10_000.0]
    size = 100

    def chunk_path(key: bytes) -> str:
        return str(tmp_path / key.hex())

    index = shared_index.SharedIndex(
        str(tmp_path), 3 * size, chunk_path, 3600.0, scan=list, clock=lambda: now[0]
    )

    def store(key: bytes) -> list[bytes]:
        temp = str(tmp_path / f".{key.hex()}.tmp")
        plan, victims = index.reserve(key, size, temp)
        assert plan == "write"
        Path(chunk_path(key)).write_bytes(bytes(size))
        index.written(key, temp)
        now[0] += 1
        return victims

    try:
        for key in (b"a", b"b", b"c"):
            assert store(key) == []
        now[0] -= 3600  # the clock set back
        index.touch(b"a")
        index.flush()
        assert store(b"d") == [b"b"]  # not "a", loaded after "b" was stored
        assert store(b"e") == [b"c"]  # not "d", stored after "c"
        assert sorted(p.name for p in tmp_path.iterdir() if len(p.name) == 2) == [
            b"a".hex(),
            b"d".hex(),
            b"e".hex(),
        ]
    finally:
        index.close()


def test_loads_never_wait_for_a_lock_held_elsewhere(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the lock held by a stopped process, loads due to write their use
    stamps leave them in memory instead of waiting (here up to ten minutes:
    the harness fails a call that takes over 20 s)."""
    monkeypatch.setattr(shared_index, "STAMP_FLUSH_S", 0.0)  # every load is due
    options = {"max_bytes": BOUND_FILES * FILE_BYTES, "index_lock_timeout_s": 600}
    harness = TierHarness(
        {"type": "fs", "root_dir": str(root), "io_threads": 2, **options},
        LAYOUT,
        call_timeout_s=20,
    )
    try:
        assert fs_tier(harness).wait_index(30)
        keys = store_new(harness, 3)
        data = harness.buffer.array[0:3].copy()
        other_process = os.open(namespace_dir(harness) / LOCK_FILE, os.O_RDWR)
        fcntl.flock(other_process, fcntl.LOCK_EX)
        try:
            for _ in range(3):
                assert harness.load(keys, [10, 11, 12]).success
                np.testing.assert_array_equal(harness.buffer.array[10:13], data)
        finally:
            os.close(other_process)  # let go before close() writes the stamps
    finally:
        harness.close()


def test_a_chunk_file_that_cannot_be_looked_at_stays_counted(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in a bucket this process may not search (EACCES) still takes
    space: a restart keeps its row, and eviction passes it over instead of
    dropping its row without removing it."""
    first = open_tier(root, 4)
    keys = store_new(first, 4)
    first.close()
    hidden = fs_tier(first).dir.chunk_path(keys[0])
    real_lstat, real_unlink = os.lstat, os.unlink

    def no_access(path: str) -> None:
        if os.fspath(path) == hidden:
            raise PermissionError(13, "Permission denied", hidden)

    def lstat(path: str, **kwargs: Any) -> os.stat_result:
        no_access(path)
        return real_lstat(path, **kwargs)

    def unlink(path: str, **kwargs: Any) -> None:
        no_access(path)
        real_unlink(path, **kwargs)

    monkeypatch.setattr(shared_index.os, "lstat", lstat)
    monkeypatch.setattr(shared_index.os, "unlink", unlink)
    second = open_tier(root, 4)
    try:
        assert fs_tier(second).held_bytes == 4 * FILE_BYTES
        store_new(second, 2)  # evicts two others; the hidden file stays, counted
        assert os.path.exists(hidden)
        assert disk_bytes(root) == fs_tier(second).held_bytes == 4 * FILE_BYTES
    finally:
        second.close()


def _truncate_index(directory: Path) -> None:
    os.truncate(directory / INDEX_FILE, 0)


def _truncate_wal(directory: Path) -> None:
    os.truncate(f"{directory / INDEX_FILE}-wal", 0)


def _copy_another_directory_s_index(directory: Path) -> None:
    other = open_tier(directory.parent.parent / "other", BOUND_FILES)
    store_new(other, 2)
    other.close()
    remove_index_files(directory)
    source = Path(fs_tier(other).dir.path) / INDEX_FILE
    shutil.copyfile(source, directory / "copy")
    os.replace(directory / "copy", directory / INDEX_FILE)


@pytest.mark.parametrize(
    "damage", [_truncate_index, _truncate_wal, _copy_another_directory_s_index], ids=_name
)
def test_an_index_damaged_under_a_running_tier_lets_others_start_and_the_bound_hold(
    root: Path, damage: Callable[[Path], None]
) -> None:
    first = open_tier(root, BOUND_FILES)
    try:
        store_new(first, 4)
        damage(namespace_dir(first))
        # Opening a truncated index waits out the lock timeout while the first
        # tier's connection keeps SQLite busy: short, yet ample for the brief
        # hold of each store's change on a loaded machine.
        second = open_tier(root, BOUND_FILES, index_lock_timeout_s=5)
        try:
            for _ in range(4):
                for harness in (first, second):
                    store_new(harness, 2)
                    assert disk_bytes(root) <= BOUND_FILES * FILE_BYTES
        finally:
            second.close()
    finally:
        first.close()


def test_a_running_tier_counts_its_files_in_an_index_copied_from_another_root(
    root: Path,
) -> None:
    harness = open_tier(root, BOUND_FILES)
    try:
        store_new(harness, 4)
        _copy_another_directory_s_index(namespace_dir(harness))
        for _ in range(3):
            store_new(harness, 2)
            assert disk_bytes(root) <= BOUND_FILES * FILE_BYTES
    finally:
        harness.close()
