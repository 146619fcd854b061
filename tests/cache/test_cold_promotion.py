"""A cold prefix: a fresh ``KVCache`` brings back chunks another one left in ``fs``.

The lookup sleeps until a tier announces progress (a job ended, a check
answered) instead of polling, and the primary buffer is mapped ahead. None
of it may weaken what a cold load guarantees: a corrupt, torn or foreign
chunk is a miss (deleted, counted), a chunk gone between the check and the
read is a miss, and a stalled tier costs one bounded wait.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier import manager as manager_module
from kvtier.errors import ClosedError
from kvtier.manager import TieringManager
from kvtier.primary import SlotBuffer
from kvtier.testing import small_layout
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs import io as chunk_io
from tests.support.cache_tiers import tier_at

LAYOUT = small_layout(chunk_tokens=4)
CHUNKS = 6
TOKENS = list(range(100, 100 + CHUNKS * 4))
#: Long enough that a lookup relying on it, not on a wake-up, is caught.
POLL_S = 5.0


def config(root: Path, **tier: Any) -> dict[str, Any]:
    return {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 2 * CHUNKS * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "io_threads": 4, **tier}],
    }


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (CHUNKS, LAYOUT.slot_bytes), dtype=np.uint8)


@pytest.fixture
def root(tmp_path: Path, data: np.ndarray) -> Path:
    """An fs root holding the prefix, left by a cache that is closed."""
    with KVCache(config(tmp_path), LAYOUT) as writer:
        assert writer.store(TOKENS, data) == CHUNKS
        writer.drain()
    return tmp_path


def fs_tier(cache: KVCache) -> FilesystemTier:
    return tier_at(cache, 0, FilesystemTier)


def chunk_file(cache: KVCache, index: int) -> str:
    return fs_tier(cache).dir.chunk_path(cache.keys(TOKENS)[index])


class Waits:
    """Records how each of the manager's waits for progress ended."""

    def __init__(self, manager: TieringManager, monkeypatch: pytest.MonkeyPatch) -> None:
        self.woken: list[bool] = []
        real = manager.progress.wait

        def wait(mark: int, timeout: float) -> bool:
            moved = real(mark, timeout)
            self.woken.append(moved)
            return moved

        monkeypatch.setattr(manager.progress, "wait", wait)


@pytest.fixture
def cold(root: Path) -> Iterator[KVCache]:
    with KVCache(config(root), LAYOUT) as cache:
        yield cache


def test_a_cold_prefix_comes_back_whole_woken_by_the_tier_not_by_polling(
    cold: KVCache, data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cold.manager.progress.announced
    waits = Waits(cold.manager, monkeypatch)
    with cold.lookup(TOKENS, poll_s=POLL_S) as found:
        out = np.zeros_like(data)
        assert found.load(out) == len(TOKENS)
    assert np.array_equal(out, data)
    # Every wait ended because something happened, none by running out.
    assert waits.woken and all(waits.woken)
    assert fs_tier(cold).stats.chunks_loaded == CHUNKS


@pytest.mark.parametrize("damage", ["corrupt", "torn", "foreign"])
def test_a_damaged_chunk_of_a_cold_prefix_is_a_miss_deleted_and_counted(
    root: Path, data: np.ndarray, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KVCache(config(root), LAYOUT) as probe:
        paths = [chunk_file(probe, i) for i in range(CHUNKS)]
    if damage == "corrupt":  # one payload byte flipped
        with open(paths[3], "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "torn":  # cut short, as by a crash mid-copy
        os.truncate(paths[3], LAYOUT.slot_bytes // 2)
    else:  # another chunk's whole, valid file under this chunk's name
        os.replace(paths[4], paths[3])
    with KVCache(config(root), LAYOUT) as cache:
        tier = fs_tier(cache)
        waits = Waits(cache.manager, monkeypatch)
        found = cache.cached_prefix(TOKENS, poll_s=POLL_S)
        assert found == 3 * 4  # the chunks before the damaged one
        out = np.zeros_like(data)
        assert cache.load(TOKENS, found, out) == found
        assert np.array_equal(out[:3], data[:3])
        assert tier.stats.corrupt_chunks == 1
        assert not os.path.exists(paths[3])
        assert all(waits.woken)


def test_a_chunk_deleted_between_the_check_and_the_read_is_a_miss(
    cold: KVCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = fs_tier(cold)
    gone = chunk_file(cold, 2)
    submit = tier.submit_load

    def delete_then_submit(job: Any) -> None:
        # Found by the lookup, removed (by another process, say) before its read.
        if os.path.exists(gone):
            os.unlink(gone)
        submit(job)

    monkeypatch.setattr(tier, "submit_load", delete_then_submit)
    waits = Waits(cold.manager, monkeypatch)
    assert cold.cached_prefix(TOKENS, poll_s=POLL_S) == 2 * 4
    assert tier.vanished_chunks == 1
    # A miss, not a failure: nothing was wrong with what was there.
    assert tier.stats.load_failures == 0 and tier.stats.corrupt_chunks == 0
    assert all(waits.woken)


class ThenLock:
    """The primary tier's lock, running ``then`` (once) as soon as it is next released."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.then: Callable[[], None] | None = None

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        then, self.then = self.then, None
        if then is not None:
            then()


def test_an_eviction_right_after_a_lookup_finds_its_chunks_pinned(
    cold: KVCache, data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lookup finds and pins its chunks in one hold of the primary tier's
    # lock: an eviction that takes the lock the moment the lookup's finding
    # releases it meets pinned chunks and removes nothing.
    assert cold.cached_prefix(TOKENS) == len(TOKENS)  # the whole prefix in the primary tier
    primary = cold.manager.primary
    lock = ThenLock(primary._lock)
    monkeypatch.setattr(primary, "_lock", lock)
    touch = primary.policy.touch
    removed: list[int] = []

    def evict_once_released(keys: Any) -> None:  # the policy hears of the chunks found
        if not removed:
            lock.then = lambda: removed.append(primary.remove_idle([cold.keys(TOKENS)[2]]))
        touch(keys)

    monkeypatch.setattr(primary.policy, "touch", evict_once_released)
    waits = Waits(cold.manager, monkeypatch)
    with cold.lookup(TOKENS, poll_s=POLL_S) as found:
        assert removed == [0]  # pinned by then: busy chunks stay
        out = np.zeros_like(data)
        assert found.load(out) == len(TOKENS)
    assert np.array_equal(out, data)
    assert waits.woken == []  # all ready at once: nothing to wait for
    assert fs_tier(cold).stats.chunks_loaded == CHUNKS  # nothing promoted again


@pytest.fixture
def stalled_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The fs tier's reads block until the event is set (set again at teardown)."""
    release = threading.Event()
    read = chunk_io._load_files

    def stalled(*args: Any) -> Any:
        release.wait()
        return read(*args)

    monkeypatch.setattr(chunk_io, "_load_files", stalled)
    yield release
    release.set()


def test_a_stalled_tier_costs_one_bounded_wait(
    cold: KVCache, stalled_reads: threading.Event
) -> None:
    with cold.lookup(TOKENS, timeout=0.2, poll_s=POLL_S) as found:
        # The lookup gave up at its timeout, saying more may come.
        assert found.num_tokens == 0 and found.pending
    stalled_reads.set()
    # Once the tier answers, the same prefix is there.
    assert cold.cached_prefix(TOKENS, poll_s=POLL_S) == len(TOKENS)


def test_waiting_for_promotions_ends_when_they_land(
    cold: KVCache, data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = cold.keys(TOKENS)
    assert cold.probe(keys, request_id="r") == (0, True)  # found in fs, promotion queued
    waits = Waits(cold.manager, monkeypatch)
    assert cold.wait_for_promotions(keys, request_id="r", timeout=60, poll_s=POLL_S) == (
        CHUNKS,
        False,
    )
    # Woken by the tier each time, never by a bound running out.
    assert waits.woken and all(waits.woken)
    slots = cold.pin(keys)
    try:
        assert np.array_equal(cold.manager.primary.buffer.array[slots], data)
    finally:
        cold.unpin(keys)


def test_waiting_for_promotions_of_a_stalled_tier_ends_at_the_timeout(
    cold: KVCache, stalled_reads: threading.Event
) -> None:
    keys = cold.keys(TOKENS)
    # Given up at the timeout, still pending: the engine steps on.
    assert cold.wait_for_promotions(keys, timeout=0.2, poll_s=POLL_S) == (0, True)
    stalled_reads.set()
    assert cold.wait_for_promotions(keys, timeout=60, poll_s=POLL_S) == (CHUNKS, False)


@pytest.mark.parametrize(("option", "value"), [("timeout", float("nan")), ("poll_s", -1.0)])
def test_a_wait_for_promotions_refuses_a_bad_duration(
    cold: KVCache, option: str, value: float
) -> None:
    keys = cold.keys(TOKENS)
    durations = {"timeout": 1.0, option: value}
    with pytest.raises(ValueError, match=f"{option} must be a number of seconds"):
        cold.wait_for_promotions(keys, **durations)  # type: ignore[arg-type]  # timeout, poll_s
    cold.drain()
    assert cold.status.holds(keys) == [False] * CHUNKS  # refused before it promoted anything


def test_closing_the_cache_ends_a_wait_for_promotions(
    cold: KVCache, stalled_reads: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = threading.Event()
    real = cold.manager.progress.wait

    def wait(mark: int, timeout: float) -> bool:
        waiting.set()
        return real(mark, timeout)

    monkeypatch.setattr(cold.manager.progress, "wait", wait)
    outcome: list[BaseException | None] = []

    def waiter() -> None:
        try:
            cold.wait_for_promotions(cold.keys(TOKENS), timeout=3600, poll_s=3600)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait()
    # Closing drains the tier, whose read is stalled: close on a thread of
    # its own, and see the wait end before the read is let go.
    closer = threading.Thread(target=cold.close)
    closer.start()
    thread.join()
    stalled_reads.set()
    closer.join()
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError)


def test_a_tier_that_does_not_announce_progress_is_polled(root: Path, data: np.ndarray) -> None:
    inner = config(root)["secondary_tiers"][0]
    wrapped = {"type": "FaultyTier", "module_path": "kvtier.testing.faults", "inner": inner}
    settings = {**config(root), "secondary_tiers": [wrapped]}
    with KVCache(settings, LAYOUT) as cache:
        assert not cache.manager.progress.announced
        out = np.zeros_like(data)
        found = cache.cached_prefix(TOKENS)
        assert cache.load(TOKENS, found, out) == len(TOKENS)
        assert np.array_equal(out, data)


def test_existence_checks_are_spread_over_the_idle_workers(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KVCache(config(root, shared=True), LAYOUT) as cache:
        tier = fs_tier(cache)
        assert tier.wait_index(30)
        tier.backend.index.keys.clear()  # as if another process had stored every chunk
        batches: list[int] = []
        contains = tier.backend.contains_many

        def counted(keys: Any) -> list[bool]:
            batches.append(len(keys))
            return contains(keys)

        monkeypatch.setattr(tier.backend, "contains_many", counted)
        assert cache.cached_prefix(TOKENS, poll_s=POLL_S) == len(TOKENS)
        # Six keys over four idle workers: checks of two keys each, in
        # parallel, instead of one check of all six.
        assert batches == [2, 2, 2]


def test_the_primary_buffer_is_mapped_ahead_keeping_what_it_holds() -> None:
    buffer = SlotBuffer(4, 1 << 20)
    try:
        buffer.array[1] = 7  # a slot in use before the populating thread gets to it
        buffer.populate_in_background()
        assert buffer.wait_populated(30)
        assert (buffer.array[1] == 7).all() and not buffer.array[[0, 2, 3]].any()
    finally:
        buffer.close()


def test_closing_a_buffer_while_it_is_mapped_ahead_stops_that_first(tmp_path: Path) -> None:
    settings = {**config(tmp_path), "cpu_bytes_to_use": 64 << 20}
    with KVCache(settings, LAYOUT) as cache:
        buffer = cache.manager.primary.buffer
    # close() waited for the populating thread: nothing of it runs on.
    assert buffer.wait_populated(0)


def test_populate_primary_false_maps_nothing_ahead(tmp_path: Path) -> None:
    with KVCache({**config(tmp_path), "populate_primary": False}, LAYOUT) as cache:
        assert cache.manager.primary.buffer._populator is None


# Streaming loads: promotion jobs of a few MiB, copied out as each lands ----


@pytest.fixture
def small_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Promotion jobs of two chunks: the cold prefix comes back as three."""
    monkeypatch.setattr(manager_module, "PROMOTION_JOB_BYTES", 2 * LAYOUT.slot_bytes)


def submitted_jobs(cache: KVCache, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each load job the fs tier is handed from now on."""
    tier, sizes = fs_tier(cache), []
    submit = tier.submit_load

    def recorded(job: Any) -> None:
        sizes.append(len(job.keys))
        submit(job)

    monkeypatch.setattr(tier, "submit_load", recorded)
    return sizes


def test_a_cold_prefix_is_promoted_in_jobs_of_promotion_job_bytes(
    root: Path, small_jobs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KVCache(config(root), LAYOUT) as cache:
        assert fs_tier(cache).wait_index(60)
        sizes = submitted_jobs(cache, monkeypatch)
        assert cache.cached_prefix(TOKENS, poll_s=POLL_S) == len(TOKENS)
    assert sizes == [2, 2, 2]


@pytest.mark.parametrize(
    ("job_chunks", "at_lookup", "at_step"), [(2, [2, 2, 2], []), (4, [4], [2])]
)
def test_a_lookup_submits_the_whole_jobs_it_found_and_the_step_the_rest(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    job_chunks: int,
    at_lookup: list[int],
    at_step: list[int],
) -> None:
    """No step cadence before a cold prefix's first reads: the lookup that
    finds a job's worth of chunks submits it; what is short of a job waits
    for the step, which batches it with what other lookups found."""
    monkeypatch.setattr(manager_module, "PROMOTION_JOB_BYTES", job_chunks * LAYOUT.slot_bytes)
    with KVCache(config(root), LAYOUT) as cache:
        assert fs_tier(cache).wait_index(60)
        sizes = submitted_jobs(cache, monkeypatch)
        result = cache.manager.lookup(cache.keys(TOKENS), "r1")
        assert result.hit_chunks == 0 and result.pending
        assert sizes == at_lookup
        cache.manager.step()
        assert sizes == at_lookup + at_step
        assert cache.cached_prefix(TOKENS, request_id="r1", poll_s=POLL_S) == len(TOKENS)


def test_a_lookups_first_reads_start_while_it_still_walks_the_prefix(
    root: Path, small_jobs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk holds the interpreter's lock: a worker woken by a job it
    submitted gets the lock from the walk itself, not once it is over.
    With a switch interval of minutes, only the walk handing the lock over
    lets a read begin before the lookup returns (it may miss a chance on a
    busy machine: five tries, one is enough; without the hand-over none can)."""
    walking, read_while_walking = [False], []
    read = chunk_io._load_files

    def noted(*args: Any) -> Any:
        read_while_walking.append(walking[0])
        return read(*args)

    monkeypatch.setattr(chunk_io, "_load_files", noted)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(300.0)
    try:
        for _ in range(5):
            read_while_walking.clear()
            with KVCache(config(root), LAYOUT) as cache:
                assert fs_tier(cache).wait_index(60)
                keys = cache.keys(TOKENS)
                walking[0] = True
                result = cache.manager.lookup(keys, "r1")
                walking[0] = False
                assert result.pending
                assert cache.cached_prefix(TOKENS, request_id="r1", poll_s=POLL_S) == len(TOKENS)
            if any(read_while_walking):
                break
    finally:
        sys.setswitchinterval(interval)
    assert any(read_while_walking)


def test_load_prefix_copies_a_jobs_chunks_while_later_jobs_still_read(
    root: Path, data: np.ndarray, small_jobs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KVCache(config(root), LAYOUT) as cache:
        # Found at once by the index, not chunk by chunk by existence checks: jobs in order.
        assert fs_tier(cache).wait_index(60)
        last_job = {chunk_file(cache, 4), chunk_file(cache, 5)}
        first_jobs_copied = threading.Event()
        copied_before_read: list[bool] = []
        read = chunk_io._load_files

        def held_back(paths: list[str], *args: Any) -> Any:
            # Bounded: a load that copies only at the end fails, not hangs.
            if last_job & set(paths):
                copied_before_read.append(first_jobs_copied.wait(timeout=30))
            return read(paths, *args)

        monkeypatch.setattr(chunk_io, "_load_files", held_back)
        out, order = np.zeros_like(data), []

        def copier(index: int, chunk: np.ndarray) -> None:
            out[index] = chunk
            order.append(index)
            if index == 3:
                first_jobs_copied.set()

        assert cache.load_prefix(TOKENS, copier, poll_s=POLL_S) == len(TOKENS)
        assert cache.manager.primary.busy_counts()["pinned"] == 0
    assert copied_before_read and all(copied_before_read)  # the last job read, after
    assert order == list(range(CHUNKS))
    assert np.array_equal(out, data)


def test_load_prefix_into_an_array_stops_at_a_corrupt_chunk(
    root: Path, data: np.ndarray, small_jobs: None
) -> None:
    with KVCache(config(root), LAYOUT) as probe:
        path = chunk_file(probe, 3)
    with open(path, "r+b") as f:
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with KVCache(config(root), LAYOUT) as cache:
        out = np.zeros_like(data)
        assert cache.load_prefix(TOKENS, out, poll_s=POLL_S) == 3 * 4
        assert fs_tier(cache).stats.corrupt_chunks == 1
        assert cache.manager.primary.busy_counts()["pinned"] == 0
    assert np.array_equal(out[:3], data[:3])
    assert not out[3:].any()  # nothing past the prefix found was written


def test_load_prefix_of_a_stalled_tier_loads_what_is_ready_at_the_timeout(
    cold: KVCache, data: np.ndarray, stalled_reads: threading.Event
) -> None:
    out = np.zeros_like(data)
    assert cold.load_prefix(TOKENS, out, timeout=0.2, poll_s=POLL_S) == 0
    assert not out.any()
    stalled_reads.set()
    assert cold.load_prefix(TOKENS, out, poll_s=POLL_S) == len(TOKENS)
    assert np.array_equal(out, data)


@pytest.mark.parametrize(
    ("out", "error"),
    [
        (np.zeros((CHUNKS - 1, LAYOUT.slot_bytes), np.uint8), ValueError),
        (np.zeros((CHUNKS, LAYOUT.slot_bytes + 1), np.uint8), ValueError),
        (None, TypeError),  # refused as by load, not taken for a lookup copying nothing
        ([[0] * LAYOUT.slot_bytes] * CHUNKS, TypeError),
    ],
)
def test_load_prefix_refuses_an_output_that_cannot_hold_the_prefix_before_promoting(
    cold: KVCache, out: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="out"):
        cold.load_prefix(TOKENS, out)
    cold.drain()
    assert cold.status.holds(cold.keys(TOKENS)) == [False] * CHUNKS


def test_a_copier_that_raises_fails_load_prefix_and_leaves_nothing_pinned(cold: KVCache) -> None:
    def copier(index: int, chunk: np.ndarray) -> None:
        if index == 2:
            raise RuntimeError("engine out of memory")

    with pytest.raises(RuntimeError, match="engine out of memory"):
        cold.load_prefix(TOKENS, copier, poll_s=POLL_S)
    cold.drain()
    assert cold.manager.primary.busy_counts()["pinned"] == 0
