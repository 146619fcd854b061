"""``max_bytes`` on a root that several tiers share: one bound for all of them.

Two tiers in one test process stand for two processes: each has its own
connection to the shared index and its own open file description of the
lock file, so they exclude each other exactly as processes do. The
four-process run with SIGKILLs is in ``test_fs_processes.py``.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup
from kvtier.tiers.fs import index as index_module
from kvtier.tiers.fs import io as fs_io
from kvtier.tiers.fs import shared_index
from kvtier.tiers.fs.io import TRAILER_BLOCK
from tests.tiers.fs.fs_support import fs_tier
from tests.tiers.fs.fs_worker import LAYOUT

pytestmark = pytest.mark.usefixtures("chunk_io")

FILE_BYTES = LAYOUT.slot_bytes + TRAILER_BLOCK


_seeds = itertools.count(10_000)  # not the seeds fs_worker gets below


def open_tier(root: Path, max_files: int | None = None, **options: object) -> TierHarness:
    bound = {} if max_files is None else {"max_bytes": max_files * FILE_BYTES}
    harness = TierHarness(
        {"type": "fs", "root_dir": str(root), "io_threads": 2, **bound, **options}, LAYOUT
    )
    harness.rng = np.random.default_rng(next(_seeds))  # keys of its own
    assert fs_tier(harness).wait_index(30)
    return harness


def disk_bytes(root: Path) -> int:
    """Bytes of chunk and temp files: what ``max_bytes`` bounds."""
    return sum(p.lstat().st_size for p in root.rglob("*") if p.suffix in (".kvc", ".tmp"))


@pytest.fixture
def pair(root: Path) -> Iterator[tuple[TierHarness, TierHarness]]:
    first, second = open_tier(root, 8), open_tier(root, 8)
    yield first, second
    first.close()
    second.close()


def store_new(harness: TierHarness, count: int) -> list[ChunkKey]:
    keys = harness.keys(count)
    harness.fill(range(count))
    assert harness.store(keys, list(range(count))).success
    return keys


def test_two_tiers_on_one_root_hold_one_bound_at_every_step(
    pair: tuple[TierHarness, TierHarness], root: Path
) -> None:
    first, second = pair
    stored: list[ChunkKey] = []
    for _ in range(10):
        for harness in pair:
            stored += store_new(harness, 3)
            assert disk_bytes(root) <= 8 * FILE_BYTES
    assert disk_bytes(root) == 8 * FILE_BYTES
    # Either may evict the other's chunks, least recently used first.
    assert fs_tier(first).stats.evictions + fs_tier(second).stats.evictions == 60 - 8
    on_disk = {k for k in stored if os.path.exists(fs_tier(first).dir.chunk_path(k))}
    # The newest eight (within a batch of three, the order of commits is the threads').
    assert len(on_disk) == 8 and set(stored[-6:]) <= on_disk <= set(stored[-9:])
    assert fs_tier(first).held_bytes == fs_tier(second).held_bytes == 8 * FILE_BYTES


def test_loads_count_as_use_across_tiers(
    pair: tuple[TierHarness, TierHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Use stamps are written in batches, at most STAMP_FLUSH_S late; here at once.
    monkeypatch.setattr(shared_index, "STAMP_FLUSH_S", 0.0)
    first, second = pair
    hot = store_new(first, 2)
    hot_data = first.buffer.array[0:2].copy()
    for _ in range(8):
        store_new(second, 3)
        assert first.load(hot, [10, 11]).success  # the first tier's reads keep them
    np.testing.assert_array_equal(first.buffer.array[10:12], hot_data)


def test_a_load_of_a_chunk_another_tier_evicted_is_a_quiet_miss(
    pair: tuple[TierHarness, TierHarness], caplog: pytest.LogCaptureFixture
) -> None:
    first, second = pair
    mine = store_new(first, 4)
    store_new(second, 8)  # evicts all four
    caplog.set_level(logging.INFO, logger="kvtier")
    result = first.load(mine[:2], [0, 1])
    assert not result.success and result.succeeded == frozenset()
    assert result.vanished == frozenset(mine[:2])  # misses for the manager, not failures
    tier = fs_tier(first)
    assert tier.stats.corrupt_chunks == 0
    assert tier.vanished_chunks == 2
    # The other tier's evictions reach this tier's lookups at its next step.
    assert [first.lookup(k) for k in mine] == [Lookup.MISS] * 4
    assert tier.vanished_chunks == 2
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_chunks_of_a_process_that_exited_are_evicted_by_a_running_one(root: Path) -> None:
    running = open_tier(root, 6)  # running before the other process stores
    try:
        worker = Path(__file__).with_name("fs_worker.py")
        code = subprocess.run(
            [sys.executable, str(worker), "store", str(root), "5", "6", str(6 * FILE_BYTES)],
            check=False,
            timeout=120,
        ).returncode
        assert code == 0
        exited_files = list(root.rglob("*.kvc"))
        assert len(exited_files) == 6
        mine = store_new(running, 6)
        assert disk_bytes(root) <= 6 * FILE_BYTES
        assert not any(path.exists() for path in exited_files)
        assert [running.lookup(k) for k in mine] == [Lookup.HIT] * 6
    finally:
        running.close()


_KILLED_MID_STORE = """
import os, signal, sys
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.fs import io

def write_half_then_die(temp, final, payload, trailer, direct, fsync):
    with open(temp, "wb") as handle:
        handle.write(bytes(payload[: len(payload) // 2]))
    os.kill(os.getpid(), signal.SIGKILL)

io._store_file = write_half_then_die
harness = TierHarness(
    {"type": "fs", "root_dir": sys.argv[1], "max_bytes": int(sys.argv[2])},
    small_layout(chunk_tokens=64),  # fs_worker.LAYOUT
)
harness.tier.wait_index(30)
harness.fill([0])
harness.store(harness.keys(1), [0])
"""


def test_the_reservation_of_a_writer_killed_mid_store_is_cleared(root: Path) -> None:
    running = open_tier(root, 1)  # started first: its start-up cleaning misses the writer
    try:
        child = subprocess.run(
            [sys.executable, "-c", _KILLED_MID_STORE, str(root), str(FILE_BYTES)],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr
        (temp,) = root.rglob("*.tmp")
        assert fs_tier(running).held_bytes == FILE_BYTES  # the dead write counts its file
        # The dead write fills the bound: the next store evicts it, temp file and all.
        key = store_new(running, 1)[0]
        assert not temp.exists()
        assert running.lookup(key) is Lookup.HIT
        assert disk_bytes(root) == FILE_BYTES
    finally:
        running.close()


def test_a_restart_keeps_the_order_of_use_in_the_shared_index(root: Path) -> None:
    first = open_tier(root, 4)
    # One at a time: the workers of one job write in whatever order they get a core.
    keys = [store_new(first, 1)[0] for _ in range(4)]
    assert first.load([keys[0]], [5]).success  # now the most recently used
    first.close()
    second = open_tier(root, 4)
    try:
        store_new(second, 1)
        gone = [k for k in keys if not os.path.exists(fs_tier(second).dir.chunk_path(k))]
        assert gone == [keys[1]]
    finally:
        second.close()


def test_a_damaged_index_is_rebuilt_from_the_files(root: Path) -> None:
    first = open_tier(root, 4)
    keys = store_new(first, 3)
    first.close()
    index = Path(fs_tier(first).dir.path) / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(f"{index}{suffix}").unlink(missing_ok=True)
    index.write_bytes(b"this is not a database" * 100)
    second = open_tier(root, 4)
    try:
        assert fs_tier(second).held_bytes == 3 * FILE_BYTES
        assert [second.lookup(k) for k in keys] == [Lookup.HIT] * 3
        store_new(second, 3)
        assert disk_bytes(root) <= 4 * FILE_BYTES
    finally:
        second.close()


def test_a_write_renamed_while_its_row_is_checked_keeps_its_row(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = open_tier(root, 4)
    try:
        index = fs_tier(harness).backend.index.bound
        assert index is not None
        key = bytes(range(32))
        final = fs_tier(harness).dir.chunk_path(key)
        temp = fs_tier(harness).dir.temp_path(final)
        assert index.reserve(key, FILE_BYTES, temp) == ("write", [])
        Path(temp).write_bytes(bytes(FILE_BYTES))
        real = shared_index.write_abandoned

        def rename_first(path: str, max_age_s: float) -> bool:
            os.rename(temp, final)  # the writer finishes between the two looks
            return real(path, max_age_s)

        monkeypatch.setattr(shared_index, "write_abandoned", rename_first)
        index.forget(key)  # as a load that found no file would
        index.flush()
        assert index.totals().nbytes == FILE_BYTES  # the file is counted still
        assert os.path.exists(final)
    finally:
        harness.close()


def test_a_write_in_flight_is_never_evicted(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, other = open_tier(root, 2), open_tier(root, 2)
    try:
        real_store = fs_io._store_file
        during: list[tuple[bool, int]] = []

        def others_store_mid_write(temp: str, final: str, *args: object) -> bool:
            if during or "slow" not in threading.current_thread().name:
                return real_store(temp, final, *args)  # type: ignore[arg-type]
            # Half written when the other tier needs room: this row is the oldest.
            Path(temp).write_bytes(b"partial")
            keys = other.keys(3)
            other.fill([0, 1, 2])
            for slot, key in enumerate(keys):
                other.store([key], [slot])
            during.append((os.path.exists(temp), disk_bytes(root)))
            os.unlink(temp)
            return real_store(temp, final, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(fs_io, "_store_file", others_store_mid_write)
        key = slow.keys(1)[0]
        assert slow.lookup(key) is Lookup.MISS  # the workers start with this first task
        for worker in fs_tier(slow).workers.threads:
            worker.name = "slow-" + worker.name
        slow.fill([0])
        assert slow.store([key], [0]).success
        assert during == [(True, len(b"partial") + FILE_BYTES)]  # the other tier evicted its own
        assert slow.lookup(key) is Lookup.HIT
        assert disk_bytes(root) == 2 * FILE_BYTES
        assert fs_tier(slow).held_bytes == 2 * FILE_BYTES
    finally:
        slow.close()
        other.close()


def test_a_write_is_evictable_once_its_file_is_in_place(root: Path) -> None:
    harness = open_tier(root, 1)
    try:
        index = fs_tier(harness).backend.index.bound
        assert index is not None
        paths = fs_tier(harness).dir
        key, other = bytes(range(32)), bytes(range(1, 33))
        final = paths.chunk_path(key)
        assert index.reserve(key, FILE_BYTES, paths.temp_path(final)) == ("write", [])
        # Reserved, not started: it may create its temp file any moment.
        other_temp = paths.temp_path(paths.chunk_path(other))
        assert index.reserve(other, FILE_BYTES, other_temp) == ("full", [])
        # Renamed into place by a writer that did not live to say so.
        Path(final).write_bytes(bytes(FILE_BYTES))
        assert index.reserve(other, FILE_BYTES, other_temp) == ("write", [key])
        assert not os.path.exists(final)
    finally:
        harness.close()


def test_a_bound_on_a_network_filesystem_warns_that_it_spans_one_host(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert shared_index.filesystem_type(str(Path(__file__))) not in (None, "nfs4")
    monkeypatch.setattr(index_module, "filesystem_type", lambda path: "nfs4")
    caplog.set_level(logging.WARNING, logger="kvtier")
    open_tier(root, 4).close()
    assert any("only among processes of one host" in r.getMessage() for r in caplog.records)
    caplog.clear()
    open_tier(root).close()  # no bound: nothing to warn about
    assert not any("one host" in r.getMessage() for r in caplog.records)


def test_a_store_is_one_transaction_and_its_done_mark_waits_for_the_next(root: Path) -> None:
    first, second = open_tier(root, 1), open_tier(root, 1)
    try:
        index, other_index = fs_tier(first).backend.index.bound, fs_tier(second).backend.index.bound
        assert index is not None and other_index is not None
        assert index._db is not None
        statements: list[str] = []
        index._db.set_trace_callback(statements.append)
        key = store_new(first, 1)[0]
        assert statements.count("BEGIN IMMEDIATE") == 1
        row = index._db.execute("SELECT temp FROM chunks WHERE key = ?", (key,)).fetchone()
        assert row[0] is not None  # still marked in flight: the mark waits in memory
        # Its file is in place, so the row reads as finished: another process
        # needing the room evicts it instead of failing as "full".
        other = store_new(second, 1)[0]
        assert not os.path.exists(fs_tier(first).dir.chunk_path(key))
        other_index.flush()
        rows = index._db.execute("SELECT key, temp FROM chunks").fetchall()
        assert rows == [(other, None)]
        index.flush()  # the mark of a row evicted meanwhile changes nothing
        assert index.totals() == shared_index.Totals(FILE_BYTES, 1)
    finally:
        first.close()
        second.close()


def test_evictions_are_reported_removed_once_by_the_evicting_and_the_other_tier(
    pair: tuple[TierHarness, TierHarness],
) -> None:
    first, second = pair
    removed: tuple[list[bytes], list[bytes]] = ([], [])
    for harness, log in zip(pair, removed, strict=True):
        fs_tier(harness).removal_listeners.append(log.extend)
    mine = store_new(first, 4)
    store_new(second, 8)  # evicts all four
    assert sorted(removed[1]) == sorted(mine) and removed[0] == []
    for harness in pair:  # what each runs at its next step, run here at once
        tier = fs_tier(harness)
        assert tier.backend.index.bound is not None
        tier.backend.index.poll_evictions()
    assert sorted(removed[0]) == sorted(mine)
    assert sorted(removed[1]) == sorted(mine)  # its own, not told twice
