"""A waiter for promotions takes announcements a batch at a time.

Over a long prefix from a tier that answers chunk by chunk (an object store
checks each chunk with a request of its own), announcements come faster than
a waiter can look again at the whole prefix, and every look holds the
interpreter lock the tier's own threads need. So once woken, a waiter sleeps
``LOOK_SPACING`` times as long as its last look took, never past its time
and never longer than ``UNANNOUNCED_S``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.progress import LOOK_SPACING, UNANNOUNCED_S, Progress
from kvtier.testing import small_layout
from kvtier.tiers.fs import io as chunk_io

LAYOUT = small_layout(chunk_tokens=4)
CHUNKS = 6
TOKENS = list(range(100, 100 + CHUNKS * 4))
#: Added to every look of the cache under test: its cost, as the waiter measures it.
LOOK_S = 0.02


class Sleeps:
    """The plain sleeps of a :class:`Progress`, recorded and not slept, on a
    clock that stands still (its own waits take no time)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def progress(self) -> Progress:
        return Progress(clock=lambda: 100.0, pause=self.seconds.append)


def test_a_woken_waiter_sleeps_its_look_spacing_before_looking_again() -> None:
    sleeps = Sleeps()
    waiter = sleeps.progress()
    mark = waiter.mark
    waiter.announce()  # moved already: the wait ends at once
    waiter.sleep(mark, left=60.0, poll_s=0.0005, looked_s=0.001)
    assert sleeps.seconds == [pytest.approx(LOOK_SPACING * 0.001)]


def test_the_spacing_never_runs_past_the_time_left() -> None:
    sleeps = Sleeps()
    waiter = sleeps.progress()
    mark = waiter.mark
    waiter.announce()
    waiter.sleep(mark, left=0.01, poll_s=0.0005, looked_s=1.0)
    assert sleeps.seconds == [0.01]


def test_the_spacing_of_a_long_look_is_at_most_the_unannounced_bound() -> None:
    # Only a look starts the promotions of chunks whose checks answered
    # meanwhile: a longer spacing leaves the tier idle once those in flight end.
    sleeps = Sleeps()
    waiter = sleeps.progress()
    mark = waiter.mark
    waiter.announce()
    waiter.sleep(mark, left=60.0, poll_s=0.0005, looked_s=0.015)
    waiter.announced = False  # polling a silent tier: the same bound
    waiter.sleep(mark, left=60.0, poll_s=0.0005, looked_s=0.015)
    waiter.max_spacing_s = math.inf  # as before the bound (a benchmark compares)
    waiter.sleep(mark, left=60.0, poll_s=0.0005, looked_s=0.015)
    assert sleeps.seconds == [UNANNOUNCED_S, UNANNOUNCED_S, pytest.approx(LOOK_SPACING * 0.015)]


def test_a_waiter_woken_late_spaces_its_look_within_the_time_left() -> None:
    now = [100.0]
    slept: list[float] = []
    waiter = Progress(clock=lambda: now[0], pause=slept.append)
    real_wait = waiter.wait

    def wait(mark: int, timeout: float) -> bool:
        now[0] += 0.005  # woken 5 ms after the look
        return real_wait(mark, timeout)

    waiter.wait = wait  # type: ignore[method-assign]
    mark = waiter.mark
    waiter.announce()
    waiter.sleep(mark, left=60.0, poll_s=0.0005, looked_s=0.001)  # the whole spacing
    waiter.sleep(mark, left=0.006, poll_s=0.0005, looked_s=0.001)  # 1 ms left of 6
    waiter.sleep(mark, left=0.004, poll_s=0.0005, looked_s=0.001)  # none left
    assert slept == [pytest.approx(LOOK_SPACING * 0.001), pytest.approx(0.001)]


def test_a_first_look_of_unknown_cost_is_not_spaced() -> None:
    sleeps = Sleeps()
    waiter = sleeps.progress()
    mark = waiter.mark
    waiter.announce()
    waiter.sleep(mark, left=60.0, poll_s=0.0005)
    assert sleeps.seconds == []


def test_a_waiter_polling_a_silent_tier_spaces_its_looks_too() -> None:
    sleeps = Sleeps()
    waiter = sleeps.progress()
    waiter.announced = False  # a tier that does not announce: polled
    waiter.sleep(waiter.mark, left=60.0, poll_s=0.0005, looked_s=0.005)
    waiter.sleep(waiter.mark, left=60.0, poll_s=0.5, looked_s=0.005)
    waiter.sleep(waiter.mark, left=0.001, poll_s=0.5, looked_s=0.005)
    assert sleeps.seconds == [pytest.approx(LOOK_SPACING * 0.005), 0.5, 0.001]


# Through the cache: each wait is told how long the look before it took ----------


@pytest.fixture
def cold(tmp_path: Path) -> Iterator[tuple[KVCache, np.ndarray]]:
    """A fresh cache over an fs root holding the prefix, whose looks cost ``LOOK_S``."""
    settings = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 2 * CHUNKS * LAYOUT.slot_bytes,
        # One worker, one chunk a batch: a wake per chunk.
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "io_threads": 1}],
    }
    data = np.random.default_rng(3).integers(0, 256, (CHUNKS, LAYOUT.slot_bytes), dtype=np.uint8)
    with KVCache(settings, LAYOUT) as writer:
        assert writer.store(TOKENS, data) == CHUNKS
        writer.drain()
    with KVCache(settings, LAYOUT) as cache:
        yield cache, data


@pytest.fixture
def looks(
    cold: tuple[KVCache, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[float]]:
    """The ``looked_s`` each of the manager's sleeps is given, every look
    costing ``LOOK_S``: the fs reads wait until the second sleep, and the
    first ends with an announcement that finds nothing new, so that the
    waiter looks twice."""
    manager = cold[0].manager
    given: list[float] = []
    reads = threading.Event()
    real_read = chunk_io._load_files

    def read(*args: Any) -> Any:
        reads.wait()
        return real_read(*args)

    real_sleep = manager.progress.sleep

    def sleep(mark: int, left: float, poll_s: float, looked_s: float = 0.0) -> None:
        given.append(looked_s)
        if len(given) == 1:
            manager.progress.announce()
        else:
            reads.set()
        real_sleep(mark, left, poll_s, looked_s)

    def slowed(real: Any) -> Any:
        def look(*args: Any, **kwargs: Any) -> Any:
            time.sleep(LOOK_S)
            return real(*args, **kwargs)

        return look

    monkeypatch.setattr(chunk_io, "_load_files", read)
    monkeypatch.setattr(manager.progress, "sleep", sleep)
    monkeypatch.setattr(manager, "lookup_pinned", slowed(manager.lookup_pinned))
    monkeypatch.setattr(manager, "lookup", slowed(manager.lookup))
    yield given
    reads.set()


def test_a_lookup_spaces_its_looks_by_what_they_cost(
    cold: tuple[KVCache, np.ndarray], looks: list[float]
) -> None:
    cache, data = cold
    out = np.zeros_like(data)
    with cache.lookup(TOKENS, timeout=60) as found:
        assert found.load(out) == len(TOKENS)
    assert np.array_equal(out, data)
    # The first look's cost is not known (it started the promotions); the
    # second one's is, and includes the look itself.
    assert len(looks) >= 2 and looks[0] == 0.0
    assert all(looked >= LOOK_S for looked in looks[1:])


def test_waiting_for_promotions_spaces_its_looks_by_what_they_cost(
    cold: tuple[KVCache, np.ndarray], looks: list[float]
) -> None:
    cache, _ = cold
    keys = cache.keys(TOKENS)
    assert cache.wait_for_promotions(keys, timeout=60) == (CHUNKS, False)
    assert len(looks) >= 2 and looks[0] == 0.0
    assert all(looked >= LOOK_S for looked in looks[1:])
