"""One KVCache shared by threads: each race forced deterministically, then a stress run.

Each race test puts the other party's move exactly where it used to do harm,
with hooks and events, never sleeps. The manager's lock keeps other threads
out of its bookkeeping, so a move that needs the manager runs on the same
thread from inside a tier call (the lock is re-entrant); a move that needs
only the primary tier runs on a real second thread.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, register_tier
from kvtier.errors import ClosedError
from kvtier.testing import FaultyTier, small_layout
from tests.cache.doubles import HookedTier, MalformingTier, RaisingTier, RecordingTier
from tests.support.cache_tiers import tier_at

LAYOUT = small_layout(chunk_tokens=4, head_dim=16)
TOKENS = list(range(40, 56))  # four chunks
OTHER = list(range(900, 916))  # four other chunks


def pattern(key: bytes) -> np.ndarray:
    """The only bytes ever valid for ``key``."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), LAYOUT.slot_bytes)


def rows(cache: KVCache, tokens: list[int]) -> np.ndarray:
    """The chunks of ``tokens``, one row each, with their valid bytes."""
    return np.stack([pattern(key) for key in cache.keys(tokens)])


@pytest.fixture(autouse=True)
def doubles(registries: None) -> None:
    register_tier("recording", "tests.cache.doubles", "RecordingTier")
    register_tier("hooked", "tests.cache.doubles", "HookedTier")
    register_tier("malforming", "tests.cache.doubles", "MalformingTier")
    register_tier("raising", "tests.cache.doubles", "RaisingTier")


def make_cache(*tiers: dict[str, Any], slots: int = 8) -> KVCache:
    config = {
        "chunk_tokens": LAYOUT.chunk_tokens,
        "cpu_bytes_to_use": slots * LAYOUT.slot_bytes,
        "secondary_tiers": list(tiers),
    }
    return KVCache(config, LAYOUT)


@pytest.fixture
def unknown_results(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    caplog.set_level(logging.WARNING, logger="kvtier.manager")
    yield lambda: [r.getMessage() for r in caplog.records if "unknown job" in r.getMessage()]


def nothing_busy(cache: KVCache) -> bool:
    counts = cache.manager.primary.busy_counts()
    return counts["pinned"] == 0 and counts["writing"] == 0 and not cache.manager.busy


# Race 1: a chunk made ready is pinned for its cascade in the same step -------


def test_a_stored_chunk_is_pinned_for_its_cascade_before_another_thread_can_evict_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with make_cache({"type": "recording"}, slots=4) as cache:
        primary = cache.manager.primary
        other_keys = cache.keys(OTHER)
        complete_store = primary.complete_store
        raced: list[object] = []

        def ready_then_another_thread_wants_every_slot(*args: Any, **kwargs: Any) -> Any:
            done = complete_store(*args, **kwargs)
            # The chunks are ready; before the cascade runs, another thread
            # (an engine store, a promotion) asks for all four slots.
            thread = threading.Thread(
                target=lambda: raced.append(primary.prepare_store(other_keys))
            )
            thread.start()
            thread.join()
            return done

        monkeypatch.setattr(primary, "complete_store", ready_then_another_thread_wants_every_slot)
        data = rows(cache, TOKENS)
        assert cache.store(TOKENS, data) == 4
        assert raced == [None]  # nothing was evictable: all four were pinned for the cascade
        monkeypatch.undo()
        tier = tier_at(cache, 0, RecordingTier)
        assert [job.keys for job in tier.stores] == [tuple(cache.keys(TOKENS))]
        for key, row in zip(cache.keys(TOKENS), data, strict=True):
            assert tier._chunks[key] == row.tobytes()
        cache.step()
        assert nothing_busy(cache)


def test_a_promoted_chunk_is_pinned_for_its_warming_cascade_before_it_can_be_evicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with make_cache({"type": "recording"}, {"type": "recording"}, slots=4) as cache:
        fast = tier_at(cache, 0, RecordingTier)
        data = rows(cache, TOKENS)
        cache.store(TOKENS, data)
        cache.drain()
        cache.manager.reset()
        fast.shutdown()  # forget them in the fast tier: the slow one promotes them
        primary = cache.manager.primary
        complete_store = primary.complete_store
        raced: list[object] = []

        def ready_then_evict(*args: Any, **kwargs: Any) -> Any:
            done = complete_store(*args, **kwargs)
            if done:
                thread = threading.Thread(
                    target=lambda: raced.append(primary.prepare_store(cache.keys(OTHER)))
                )
                thread.start()
                thread.join()
            return done

        monkeypatch.setattr(primary, "complete_store", ready_then_evict)
        with cache.lookup(TOKENS) as found:
            assert found.num_tokens == 16
            out = np.zeros_like(data)
            assert found.load(out) == 16
        np.testing.assert_array_equal(out, data)
        assert raced == [None]
        assert fast.stores[-1].keys == tuple(cache.keys(TOKENS))
        monkeypatch.undo()
        cache.drain()
        assert fast.stats.chunks_stored == 8 and nothing_busy(cache)


# Race 2: a job is recorded before its tier can report it ---------------------


def test_a_job_reported_before_submit_returns_is_applied_not_lost(
    unknown_results: Callable[[], list[str]],
) -> None:
    with make_cache({"type": "hooked"}) as cache:
        tier = tier_at(cache, 0, HookedTier)
        # Someone collects finished jobs while the tier is still inside submit:
        # the job is already done (the example tier copies synchronously).
        tier.after_submit = cache.manager.step
        data = rows(cache, TOKENS)
        assert cache.store(TOKENS, data) == 4
        assert tier.stats.chunks_stored == 4
        assert nothing_busy(cache)  # the cascade's pins came back
        cache.manager.reset()
        # The same for a promotion: it must not stay in the writing state.
        with cache.lookup(TOKENS) as found:
            assert found.num_tokens == 16
            out = np.zeros_like(data)
            found.load(out)
        np.testing.assert_array_equal(out, data)
        assert tier.stats.chunks_loaded == 4
        assert unknown_results() == []
        assert nothing_busy(cache)


# Race 3: each finished job's result is applied in isolation ------------------


def test_a_result_that_cannot_be_applied_fails_only_its_own_store_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="kvtier.manager")
    with make_cache({"type": "malforming"}) as cache:
        tier = tier_at(cache, 0, MalformingTier)
        cache.store(TOKENS[:8], rows(cache, TOKENS[:8]))  # job 1: two chunks
        cache.store(OTHER, rows(cache, OTHER))  # job 2: four chunks
        tier.malform = True
        cache.step()  # collects both in one batch; job 1's result is malformed
        assert tier.stats.store_failures == 2  # counted against job 1 alone
        assert tier.stats.chunks_stored == 4  # job 2 applied all the same
        assert cache.manager.unapplied_results == 1
        assert nothing_busy(cache)  # job 1's pins were released too
        assert cache.manager.backpressure[0].inflight == 0
        job_id = tier.stores[0].job_id
        logged = [r for r in caplog.records if "could not be applied" in r.getMessage()]
        assert len(logged) == 1 and f"job {job_id} " in logged[0].getMessage()


def test_a_promotion_whose_result_cannot_be_applied_is_freed_and_never_waited_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with make_cache({"type": "malforming"}) as cache:
        tier = tier_at(cache, 0, MalformingTier)
        cache.store(TOKENS, rows(cache, TOKENS))
        cache.store(OTHER, rows(cache, OTHER))
        cache.drain()
        cache.manager.reset()
        # Two requests each start a promotion; one step submits both, the next
        # collects both in one batch, the first malformed.
        for tokens in (TOKENS, OTHER):
            with cache.lookup(tokens, timeout=0) as found:
                assert found.num_tokens == 0 and found.pending
        cache.step()
        tier.malform = True
        cache.step()
        primary = cache.manager.primary
        first, second = (job.keys for job in tier.loads)
        assert not any(primary.is_writing(k) or primary.is_ready(k) for k in first)
        assert all(primary.is_ready(k) for k in second)
        assert tier.stats.load_failures == len(first)
        assert nothing_busy(cache)

        # Malforming every batch from now on, a lookup fails over to a miss
        # within a few steps instead of waiting out its timeout.
        cache.manager.reset()
        steps = 0
        step = cache.manager.step

        def counted_step() -> None:
            nonlocal steps
            steps += 1
            if steps > 10:
                raise AssertionError("the lookup keeps waiting on a job no tier runs")
            step()

        monkeypatch.setattr(cache.manager, "step", counted_step)
        assert cache.cached_prefix(TOKENS, timeout=3600) == 0
        assert steps <= 3
        monkeypatch.undo()
        assert nothing_busy(cache)


# A tier raising what is not an Exception: it goes on up, the slots come back


class Interrupt(BaseException):
    """Like a KeyboardInterrupt out of a tier's call (which pytest would take as the user's)."""


def raising_tier(cache: KVCache, where: str, *, once: bool = False) -> RaisingTier:
    tier = tier_at(cache, 0, RaisingTier)
    tier.raise_in, tier.error, tier.once = where, Interrupt, once
    return tier


def test_a_promotion_whose_submit_raises_a_base_exception_leaves_no_slot_writing() -> None:
    with make_cache({"type": "raising"}, slots=4) as cache:
        data = rows(cache, TOKENS)
        cache.store(TOKENS, data)
        cache.drain()
        cache.manager.reset()  # the tier holds them, the CPU tier not
        tier = raising_tier(cache, "load")
        with pytest.raises(Interrupt):
            cache.cached_prefix(TOKENS)
        # Before: the job stayed recorded and its slots writing, so every later
        # lookup of the prefix waited out its whole timeout.
        assert nothing_busy(cache)
        assert tier.stats.load_failures == 4
        tier.raise_in = None
        with cache.lookup(TOKENS, timeout=3600) as found:
            out = np.zeros_like(data)
            assert found.load(out) == 16
        np.testing.assert_array_equal(out, data)


def test_promotions_a_raising_submit_did_not_reach_are_submitted_at_the_next_step() -> None:
    with make_cache({"type": "raising"}, slots=8) as cache:
        for tokens in (TOKENS, OTHER):
            cache.store(tokens, rows(cache, tokens))
        cache.drain()
        cache.manager.reset()
        for tokens in (TOKENS, OTHER):  # two requests: two promotion batches for one step
            with cache.lookup(tokens, timeout=0) as found:
                assert found.pending
        raising_tier(cache, "load", once=True)
        with pytest.raises(Interrupt):
            cache.step()
        cache.step()  # the batch the first step never reached goes now
        cache.drain()
        primary = cache.manager.primary
        ready = [sum(map(primary.is_ready, cache.keys(t))) for t in (TOKENS, OTHER)]
        assert sorted(ready) == [0, 4]  # the first batch failed, the second was loaded
        assert nothing_busy(cache)


def test_a_store_whose_write_through_raises_a_base_exception_unpins_every_share() -> None:
    with make_cache({"type": "raising"}, {"type": "recording"}, slots=4) as cache:
        data = rows(cache, TOKENS)
        raising_tier(cache, "store", once=True)
        with pytest.raises(Interrupt):
            cache.store(TOKENS, data)
        cache.step()
        # Before: the first tier's job stayed recorded and the second tier's
        # share of the pins was never released: the four slots stuck for good.
        assert nothing_busy(cache)
        assert cache.manager.tiers[0].stats.store_failures == 4
        assert cache.manager.backpressure[0].inflight == 0
        out = np.zeros_like(data)
        assert cache.load(TOKENS, 16, out) == 16  # the CPU tier kept them, whole
        np.testing.assert_array_equal(out, data)
        assert cache.store(OTHER, rows(cache, OTHER)) == 4  # and they can go


# Finished jobs give their room back without a step() -------------------------


def test_a_store_is_not_refused_for_room_that_finished_write_throughs_still_hold() -> None:
    # The example tier finishes a job inside submit: nothing is in flight, but
    # only a step would collect the results and unpin the chunks.
    with make_cache({"type": "recording"}, slots=4) as cache:
        assert cache.store(TOKENS, rows(cache, TOKENS)) == 4
        # Before: 0, and every later store too, on an engine that never steps.
        assert cache.store(OTHER, rows(cache, OTHER)) == 4
        out = np.zeros((4, LAYOUT.slot_bytes), np.uint8)
        assert cache.load(OTHER, 16, out) == 16
        np.testing.assert_array_equal(out, rows(cache, OTHER))


def test_a_promotion_is_not_refused_for_room_that_finished_write_throughs_still_hold() -> None:
    with make_cache({"type": "recording"}, slots=4) as cache:
        cache.store(OTHER, rows(cache, OTHER))
        cache.step()
        assert cache.store(TOKENS, rows(cache, TOKENS)) == 4  # evicts OTHER, pins TOKENS
        # Before: 0 at once, OTHER counted a miss for want of room.
        with cache.lookup(OTHER, timeout=3600) as found:
            out = np.zeros((4, LAYOUT.slot_bytes), np.uint8)
            assert found.load(out) == 16
        np.testing.assert_array_equal(out, rows(cache, OTHER))


# What a lookup holds, and what close does -----------------------------------


def test_a_held_lookup_loads_everything_it_found_whatever_is_stored_meanwhile() -> None:
    with make_cache(slots=4) as cache:
        data = rows(cache, TOKENS)
        cache.store(TOKENS, data)
        with cache.lookup(TOKENS) as found:
            assert found.num_tokens == 16
            # Another request's store finds no room: the held chunks cannot go.
            assert cache.store(OTHER, rows(cache, OTHER)) == 0
            out = np.zeros_like(data)
            assert found.load(out) == 16
        np.testing.assert_array_equal(out, data)
        # Released at the end of the block: now the store can evict them.
        assert cache.store(OTHER, rows(cache, OTHER)) == 4
        assert nothing_busy(cache)


def test_load_after_an_eviction_loads_what_is_left_and_says_so() -> None:
    with make_cache(slots=4) as cache:
        data = rows(cache, TOKENS)
        cache.store(TOKENS, data)
        hit = cache.cached_prefix(TOKENS)
        assert hit == 16
        cache.store(OTHER[:8], rows(cache, OTHER[:8]))  # evicts two of the four
        keys = cache.keys(TOKENS)
        left = next(i for i, key in enumerate(keys) if not cache.manager.primary.is_ready(key))
        out = np.zeros_like(data)
        loaded = cache.load(TOKENS, hit, out)  # no KeyError
        assert loaded == left * 4 < hit  # the leading chunks still there, and no more
        np.testing.assert_array_equal(out[:left], data[:left])
        assert not out[left:].any()
        assert nothing_busy(cache)


def test_close_waits_for_a_copy_in_progress_then_refuses_holders() -> None:
    cache = make_cache()
    data = rows(cache, TOKENS)
    cache.store(TOKENS, data)
    held = cache.lookup(TOKENS)
    copying, go = threading.Event(), threading.Event()
    copied: list[np.ndarray] = []

    def slow_copier(index: int, chunk: np.ndarray) -> None:
        copying.set()
        go.wait()
        copied.append(chunk.copy())

    loader = threading.Thread(target=lambda: cache.load(TOKENS, 4, slow_copier))
    loader.start()
    copying.wait()
    closer = threading.Thread(target=cache.close)
    closer.start()
    while not cache.closed:  # close has begun: it refuses new calls...
        threading.Event().wait(0.001)
    with pytest.raises(ClosedError, match="KVCache is closed"):
        cache.cached_prefix(TOKENS)
    assert closer.is_alive()  # ...and waits: the buffer is still being read
    go.set()
    loader.join()
    closer.join()
    np.testing.assert_array_equal(copied[0], data[0])
    with pytest.raises(ClosedError, match="KVCache is closed"):
        held.load(np.zeros_like(data))
    assert held.released
    held.release()  # nothing left to release: no error


# Stress: many threads, every byte checked ------------------------------------


def test_threads_sharing_one_cache_only_ever_load_the_right_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    prefixes = [[p * 1000 + i for i in range(24)] for p in range(8)]  # six chunks each
    tiers = [
        {
            "type": "FaultyTier",
            "module_path": "kvtier.testing.faults",
            "fail_rate": 0.1,  # failed jobs too, from several threads
            "inner": {"type": "memory", "max_bytes": 12 * (LAYOUT.slot_bytes + 128)},
        },
        {"type": "fs", "root_dir": str(tmp_path), "max_bytes": 20 * (LAYOUT.slot_bytes + 4096)},
    ]
    threads, rounds = 8, 60
    with make_cache(*tiers, slots=10) as cache:
        errors: list[BaseException] = []
        loaded_chunks = [0] * threads
        stalled = [0] * threads

        def check(tokens: list[int], out: np.ndarray, loaded: int) -> None:
            expected = rows(cache, tokens)
            chunks = loaded // LAYOUT.chunk_tokens
            np.testing.assert_array_equal(out[:chunks], expected[:chunks])

        faulty = cache.manager.tiers[0]

        def more_rounds(done: int) -> bool:
            # Failed jobs come by chance: a run that has met none yet goes on
            # (ten times as long at most) until one of its loads failed.
            return done < rounds or (faulty.stats.load_failures == 0 and done < 10 * rounds)

        def worker(index: int) -> None:
            dice = random.Random(index)
            done = 0
            try:
                while more_rounds(done):
                    done += 1
                    tokens = dice.choice(prefixes)[: dice.randrange(4, 25)]
                    out = np.zeros((6, LAYOUT.slot_bytes), dtype=np.uint8)
                    if dice.random() < 0.5:
                        with cache.lookup(tokens, timeout=3600) as found:
                            stalled[index] += found.pending
                            loaded = found.load(out)
                            assert loaded == found.num_tokens
                    else:
                        hit = cache.cached_prefix(tokens, timeout=3600)
                        loaded = cache.load(tokens, hit, out)
                        assert loaded <= hit
                    check(tokens, out, loaded)
                    loaded_chunks[index] += loaded // LAYOUT.chunk_tokens
                    full = len(tokens) // LAYOUT.chunk_tokens
                    cache.store(tokens, rows(cache, tokens[: full * LAYOUT.chunk_tokens]))
            except BaseException as error:  # reported below, with the thread's traceback
                errors.append(error)
                raise

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        assert errors == []
        assert stalled == [0] * threads
        # The run did what it is here for: loads, evictions, promotions from both tiers.
        assert sum(loaded_chunks) > 0 and cache.manager.primary.evictions > 0
        assert all(tier.stats.chunks_loaded > 0 for tier in cache.manager.tiers)
        assert faulty.stats.load_failures > 0
        cache.drain()
        assert nothing_busy(cache)
        assert cache.manager.unapplied_results == 0
        # No lost result, no failed apply, no job left for a drain to fail.
        problems = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING
            and r.name.startswith(("kvtier.manager", "kvtier.primary"))
        ]
        assert problems == []
        # What is cached afterwards is right, wherever it comes from.
        cache.manager.reset()
        for tokens in prefixes:
            with cache.lookup(tokens) as found:
                out = np.zeros((6, LAYOUT.slot_bytes), dtype=np.uint8)
                check(tokens, out, found.load(out))


def test_a_tier_that_cannot_report_its_jobs_is_logged_once_until_it_can_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.manager")
    faulty = {"type": "FaultyTier", "module_path": "kvtier.testing.faults"}
    with make_cache(faulty) as cache:
        tier = tier_at(cache, 0, FaultyTier)
        tier.broken = True
        for _ in range(50):  # a lookup waiting for a promotion collects every poll
            cache.manager.collect()
        tier.broken = False
        cache.manager.collect()
        messages = [r.getMessage() for r in caplog.records]
        assert sum("get_finished_jobs raised" in m for m in messages) == 1  # was 50
        assert sum("answers again" in m for m in messages) == 1
        tier.broken = True
        cache.manager.collect()
        tier.broken = False
        messages = [r.getMessage() for r in caplog.records]
        assert sum("get_finished_jobs raised" in m for m in messages) == 2  # a new outage
