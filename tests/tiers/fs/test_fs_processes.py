"""The ``fs`` tier across processes: SIGKILL mid-write, restarts, a shared root."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup, LookupContext
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs.io import TRAILER_BLOCK
from kvtier.tiers.fs.layout import NamespaceDir
from tests.tiers.fs.fs_worker import LAYOUT, keys_for, open_tier, payload_for, store

WORKER = str(Path(__file__).with_name("fs_worker.py"))
FILE_BYTES = LAYOUT.slot_bytes + TRAILER_BLOCK


def run_worker(*args: object, timeout: float = 60) -> int:
    return subprocess.run(
        [sys.executable, WORKER, *map(str, args)], timeout=timeout, check=False
    ).returncode


def tier_path(harness: TierHarness, key: bytes) -> str:
    tier = harness.tier
    assert isinstance(tier, FilesystemTier)
    return tier.dir.chunk_path(key)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigkill_mid_store_never_leaves_a_servable_bad_chunk(root: Path) -> None:
    rounds, per_round = 20, 200
    dice = random.Random(20261202)
    zygote = subprocess.Popen(
        [sys.executable, WORKER, "zygote", root, "0", str(per_round)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    try:
        for seed in range(rounds):
            zygote.stdin.write(f"{seed}\n")
            zygote.stdin.flush()
            word, pid = zygote.stdout.readline().split()
            assert word == "ready"
            if seed % 2:  # half the writers get to store their first batch
                assert zygote.stdout.readline().strip() == "stored"
            time.sleep(dice.uniform(0.0, 0.1))
            # On a loaded machine a writer may finish all its work first.
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
            while (line := zygote.stdout.readline().strip()) != "reaped":
                assert line in ("stored", "done"), line  # it may get further before the kill
        zygote.stdin.close()
        assert zygote.wait(timeout=30) == 0
    finally:
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()
    harness = open_tier(root, shared=False)
    try:
        tier = harness.tier
        assert isinstance(tier, FilesystemTier)
        # Abandoned temp files of the killed writers are cleaned on start (all
        # of them, unless a writer's pid already belongs to a new process).
        for temp in Path(tier.dir.path).rglob("*.tmp"):
            assert _pid_alive(int(temp.name.split(".")[-3])), temp
        on_disk = {chunk.key for chunk in tier.dir.scan()}
        present = 0
        for seed in range(rounds):
            for key in keys_for(seed, per_round):
                answer = harness.lookup(key)
                assert (answer is Lookup.HIT) == (key in on_disk)
                if answer is Lookup.HIT:
                    present += 1
                    assert harness.load([key], [0]).success
                    np.testing.assert_array_equal(harness.buffer.array[0], payload_for(key))
        assert present == len(on_disk) > 0
        assert tier.stats.corrupt_chunks == 0
    finally:
        harness.close()


def test_restart_in_a_new_process_hits_what_the_first_stored(root: Path) -> None:
    harness = open_tier(root)
    keys = keys_for(7, 24)
    assert store(harness, keys)
    harness.close()
    assert run_worker("verify", root, 7, 24) == 0


def test_a_new_process_hits_chunks_a_killed_process_stored(root: Path) -> None:
    assert run_worker("store", root, 8, 24) == 0
    harness = open_tier(root, shared=False)
    try:
        for key in keys_for(8, 24):
            assert harness.lookup(key) is Lookup.HIT
            assert harness.load([key], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], payload_for(key))
    finally:
        harness.close()


@contextlib.contextmanager
def reindex_held(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    keys: list[ChunkKey],
    walk: str,
    *,
    after_first: bool = False,
) -> Iterator[tuple[TierHarness, FilesystemTier, threading.Event]]:
    """A tier on ``root``, where another stored ``keys``, whose re-index is
    held in its ``walk`` (``listed_chunks``, the names; ``survey``, the
    files) before it begins, or ``after_first`` entry, until the event
    yielded is set."""
    first = open_tier(root)
    assert store(first, keys)
    first.close()
    release, reached = threading.Event(), threading.Event()
    real_walk = getattr(NamespaceDir, walk)

    def held_walk(self: NamespaceDir) -> Iterator[object]:
        entries = real_walk(self)
        if after_first:
            yield next(entries)  # in the index once the walk is asked for the next
        reached.set()
        release.wait(30)
        yield from entries

    monkeypatch.setattr(NamespaceDir, walk, held_walk)
    harness = TierHarness({"type": "fs", "root_dir": str(root), "shared": False}, LAYOUT, 4)
    try:
        tier = harness.tier
        assert isinstance(tier, FilesystemTier)
        assert reached.wait(30)
        yield harness, tier, release
    finally:
        release.set()
        harness.close()


def test_lookups_check_the_filesystem_until_the_names_are_listed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = keys_for(9, 3)
    with reindex_held(root, monkeypatch, keys[:2], "listed_chunks") as (harness, tier, release):
        assert not tier.index_ready
        assert tier.lookup(keys[0], LookupContext()) is Lookup.PENDING
        assert harness.lookup(keys[0]) is Lookup.HIT
        assert harness.lookup(keys[2]) is Lookup.MISS
        assert harness.load([keys[1]], [0]).success
        np.testing.assert_array_equal(harness.buffer.array[0], payload_for(keys[1]))
        assert not tier.index_ready
        release.set()
        assert tier.wait_index(30)
        # Index ready and the root private: a miss is answered at once.
        assert tier.lookup(keys[2], LookupContext()) is Lookup.MISS
        assert tier.lookup(keys[1], LookupContext()) is Lookup.HIT


def test_listed_names_answer_lookups_before_the_files_are_examined(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cold root's stat calls are most of a re-index: a restarted engine's
    # lookups are answered from the names, in the prefix's order, before them.
    keys = keys_for(14, 4)
    with reindex_held(root, monkeypatch, keys[:3], "survey") as (harness, tier, release):
        assert not tier.index_ready
        ctx = LookupContext()
        assert tier.lookup_run(keys[:3], ctx) == [Lookup.HIT] * 3
        assert tier.lookup(keys[3], ctx) is Lookup.MISS  # a private root: no file, no chunk
        assert harness.load(keys[:3], [0, 1, 2]).success
        for slot, key in enumerate(keys[:3]):
            np.testing.assert_array_equal(harness.buffer.array[slot], payload_for(key))
        release.set()
        assert tier.wait_index(30)
        assert tier.stats.corrupt_chunks == 0


def test_a_listed_chunk_damaged_before_the_survey_is_a_miss_counted_once(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its name answers the lookup; its load finds it short, counts it and
    # removes it, and the survey that follows finds nothing left to count.
    keys = keys_for(15, 2)
    with reindex_held(root, monkeypatch, keys, "survey") as (harness, tier, release):
        damaged = tier_path(harness, keys[0])
        os.truncate(damaged, FILE_BYTES // 2)
        assert tier.lookup(keys[0], LookupContext()) is Lookup.HIT  # by its name
        harness.buffer.array[0] = 7
        result = harness.load([keys[0]], [0])
        assert not result.success and result.succeeded == frozenset()
        assert (harness.buffer.array[0] == 7).all()  # nothing of it served
        assert not os.path.exists(damaged)
        assert tier.stats.corrupt_chunks == 1
        assert tier.lookup(keys[0], LookupContext()) is Lookup.MISS
        release.set()
        assert tier.wait_index(30)
        assert tier.stats.corrupt_chunks == 1
        assert keys[0] not in tier.backend.index.keys
        assert harness.load([keys[1]], [1]).success


def test_a_chunk_damaged_in_place_is_dropped_from_the_listing_by_the_survey(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = keys_for(16, 2)
    with reindex_held(root, monkeypatch, keys, "survey") as (harness, tier, release):
        assert tier.backend.index.keys >= set(keys)
        os.truncate(tier_path(harness, keys[1]), FILE_BYTES - 1)
        release.set()
        assert tier.wait_index(30)
        assert keys[1] not in tier.backend.index.keys
        assert not os.path.exists(tier_path(harness, keys[1]))
        assert tier.stats.corrupt_chunks == 1
        assert tier.lookup(keys[1], LookupContext()) is Lookup.MISS
        assert tier.lookup(keys[0], LookupContext()) is Lookup.HIT


def test_a_half_listed_index_answers_no_lookup_so_that_a_prefix_comes_back_in_order(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The index walks the root in its own order: had it answered the keys it
    # had walked, those would be promoted first and the rest a check later,
    # and a reader of the prefix would wait for its earliest chunk.
    keys = keys_for(9, 3)
    with reindex_held(root, monkeypatch, keys, "listed_chunks", after_first=True) as held:
        harness, tier, release = held
        assert len(tier.backend.index.keys & set(keys)) == 1 and not tier.index_ready
        ctx = LookupContext()
        assert [tier.lookup(key, ctx) for key in keys] == [Lookup.PENDING] * 3
        assert tier.lookup_run(keys, ctx) == [Lookup.PENDING] * 3
        assert [harness.lookup(key) for key in keys] == [Lookup.HIT] * 3  # as checked
        release.set()
        assert tier.wait_index(30)
        assert [tier.lookup(key, ctx) for key in keys] == [Lookup.HIT] * 3  # from the index


def test_a_store_while_the_index_is_half_listed_writes_no_chunk_already_on_disk(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A half-listed index answers no lookup (above), so the runtime skips no
    # store by it: the store itself finds the chunks on disk, walked or not.
    keys = keys_for(13, 3)
    with reindex_held(root, monkeypatch, keys, "listed_chunks", after_first=True) as held:
        harness, tier, _ = held
        assert not tier.index_ready
        assert len(tier.backend.index.keys & set(keys)) == 1
        files = {key: os.stat(tier_path(harness, key)) for key in keys}
        assert store(harness, keys)
        for key, before in files.items():
            after = os.stat(tier_path(harness, key))
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert tier.backend.index.keys >= set(keys)
        assert harness.load(keys, [0, 1, 2]).success
        for slot, key in enumerate(keys):
            np.testing.assert_array_equal(harness.buffer.array[slot], payload_for(key))


def test_a_chunk_stored_by_another_process_is_found(root: Path) -> None:
    harness = open_tier(root)  # running before the other process stores
    try:
        assert run_worker("store", root, 10, 12) == 0
        for key in keys_for(10, 12):
            assert harness.lookup(key) is Lookup.HIT
            assert harness.load([key], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], payload_for(key))
    finally:
        harness.close()


def test_eviction_by_another_process_is_a_clean_miss(root: Path) -> None:
    harness = open_tier(root)
    try:
        mine = keys_for(11, 4)
        assert store(harness, mine)
        assert [harness.lookup(k) for k in mine] == [Lookup.HIT] * 4
        # The other process keeps at most 4 chunk files: ours are oldest and go.
        assert run_worker("store", root, 12, 8, 4 * FILE_BYTES) == 0
        result = harness.load(mine, [0, 1, 2, 3])
        assert not result.success and result.succeeded == frozenset()
        assert harness.tier.stats.corrupt_chunks == 0
        assert [harness.lookup(k) for k in mine] == [Lookup.MISS] * 4
        # Which four of its own survive depends on its thread timing.
        theirs = [k for k in keys_for(12, 8) if Path(tier_path(harness, k)).exists()]
        assert len(theirs) == 4
        assert [harness.lookup(k) for k in theirs] == [Lookup.HIT] * 4
    finally:
        harness.close()


def test_two_processes_storing_the_same_chunks_at_once_is_harmless(root: Path) -> None:
    keys = keys_for(13, 64)
    child = subprocess.Popen([sys.executable, WORKER, "store", root, "13", "64"])
    harness = open_tier(root)
    try:
        assert store(harness, keys)
        assert child.wait(timeout=60) == 0
        for key in keys:
            assert harness.load([key], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], payload_for(key))
        assert list(root.rglob("*.tmp")) == []
    finally:
        if child.poll() is None:
            child.kill()
        harness.close()


def disk_bytes(namespace_dir: Path) -> int:
    """Bytes of chunk files and their temp files (what ``max_bytes`` bounds), by
    one scan of the buckets. (Not the index, nor the 4 KiB direct-I/O probe a
    starting tier writes and removes at the top.)"""
    total = 0
    for bucket in namespace_dir.iterdir():
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(bucket) as it:
            for entry in it:
                if entry.name.endswith((".kvc", ".tmp")):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat(follow_symlinks=False).st_size
    return total


class _Worker:
    """A ``bounded`` worker whose progress lines are read on a thread."""

    def __init__(self, root: Path, seed: int, count: int, max_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, WORKER, "bounded", root, str(seed), str(count), str(max_bytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.batches = 0
        self.wrong: list[str] = []
        self.progress = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.progress:
                if line.startswith("batch"):
                    self.batches += 1
                elif line.startswith("wrong"):
                    self.wrong.append(line.split()[1])
                self.progress.notify_all()
        with self.progress:
            self.progress.notify_all()

    def wait_batches(self, count: int) -> None:
        """Until it finished ``count`` batches, or ended."""
        with self.progress:
            self.progress.wait_for(
                lambda: self.batches >= count or self.process.poll() is not None, timeout=120
            )

    def end(self) -> int:
        code = self.process.wait(timeout=120)
        self.reader.join(timeout=30)
        return code


def test_four_processes_with_sigkills_hold_max_bytes_and_serve_exact_bytes(root: Path) -> None:
    max_files = 48
    max_bytes = max_files * FILE_BYTES
    namespace_dir = root / LAYOUT.namespace.hex()
    dice = random.Random(20261203)
    seeds = iter(range(100, 10_000))
    peak = loose_peak = 0
    sampling = threading.Event()
    sampling.set()

    def sample() -> None:
        # A scan of 256 buckets takes a while: unsynchronised, it adds files
        # that never coexisted (one evicted in bucket 01 before the scan got
        # to a newer one in bucket ff). Under the index lock nothing can add
        # bytes (every file is reserved under it first), so a scan then
        # measures one moment: the peak of those is the test's figure.
        nonlocal peak, loose_peak
        lock = namespace_dir / "index.lock"
        while sampling.is_set():
            if not namespace_dir.exists():
                continue
            loose_peak = max(loose_peak, disk_bytes(namespace_dir))
            with contextlib.ExitStack() as held:
                with contextlib.suppress(FileNotFoundError):
                    fcntl.flock(held.enter_context(open(lock, "rb")), fcntl.LOCK_EX)
                peak = max(peak, disk_bytes(namespace_dir))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    workers = [_Worker(root, next(seeds), 120, max_bytes) for _ in range(4)]
    finished: list[_Worker] = []
    kills = 0
    try:
        for _ in range(8):  # SIGKILL a worker mid-run, start a fresh one
            index = dice.randrange(len(workers))
            victim = workers[index]
            victim.wait_batches(victim.batches + dice.randint(1, 4))
            with contextlib.suppress(ProcessLookupError):
                victim.process.send_signal(signal.SIGKILL)
            code = victim.end()
            assert code in (0, -signal.SIGKILL), victim.wrong  # it may have finished first
            kills += code == -signal.SIGKILL
            finished.append(victim)
            workers[index] = _Worker(root, next(seeds), 120, max_bytes)
        for worker in workers:
            assert worker.end() == 0, worker.wrong
            finished.append(worker)
    finally:
        sampling.clear()
        sampler.join()
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()
    print(
        f"\nfour processes, {kills} SIGKILLs: peak {peak} bytes of chunk and temp files, "
        f"{peak / max_bytes:.3f}x max_bytes={max_bytes} (an unsynchronised scan summed "
        f"{loose_peak / max_bytes:.3f}x)"
    )
    assert kills >= 1
    assert [key for worker in finished for key in worker.wrong] == []
    assert 0 < peak <= 1.1 * max_bytes
    assert disk_bytes(namespace_dir) <= max_bytes
    # Every chunk left on disk is exact, and a new process holds the same bound.
    harness = open_tier(root, max_bytes=max_bytes, shared=False)
    try:
        tier = harness.tier
        assert isinstance(tier, FilesystemTier)
        on_disk = [chunk.key for chunk in tier.dir.scan()]
        assert len(on_disk) > max_files // 2
        for key in on_disk:
            assert harness.load([key], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], payload_for(key))
        assert tier.stats.corrupt_chunks == 0
        assert list(namespace_dir.rglob("*.tmp")) == []  # the killed writers' temp files
        assert tier.held_bytes == len(on_disk) * FILE_BYTES
    finally:
        harness.close()
