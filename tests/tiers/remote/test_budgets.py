"""``RequestBudgets``: a request's checks and loads share one deadline."""

from __future__ import annotations

from kvtier.keys import ChunkKey
from kvtier.tiers.budgets import RequestBudgets

KEY = ChunkKey(b"k")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_load_gets_what_the_checks_left_in_backend_time() -> None:
    clock = Clock()
    budgets = RequestBudgets(1.0, clock)
    budgets.waiting("r")
    clock.now += 0.25
    budgets.waiting("r")  # still pending
    clock.now += 0.25
    budgets.checked([KEY])  # answered half a deadline after the first PENDING
    clock.now += 5.0  # the engine came back late: not the backend's time
    budgets.found("r", (KEY,))
    assert budgets.take("r") == (0.5, 100.0)
    # Every job of the wait (a prefix promoted in several) gets the same.
    assert budgets.take("r") == (0.5, 100.0)
    budgets.finished("r")
    assert budgets.take("r") == (1.0, None)  # the request ended: its wait with it


def test_a_run_of_keys_found_at_once_spends_until_its_last_check_answered() -> None:
    clock = Clock()
    budgets = RequestBudgets(1.0, clock)
    early, late, unchecked = ChunkKey(b"e"), ChunkKey(b"l"), ChunkKey(b"u")
    budgets.waiting("r")
    clock.now += 0.125
    budgets.checked([early])
    clock.now += 0.25
    budgets.checked([late])
    clock.now += 0.25
    budgets.found("r", [early, unchecked, late])  # in any order, with a key never checked
    assert budgets.take("r") == (0.625, 100.0)
    budgets.found("r", [late])  # taken already: spends nothing more
    assert budgets.take("r") == (0.625, 100.0)


def test_a_request_back_after_a_pause_of_its_own_waits_afresh() -> None:
    clock = Clock()
    budgets = RequestBudgets(1.0, clock)
    budgets.waiting("r")
    clock.now += 0.9
    budgets.checked([KEY])
    budgets.found("r", (KEY,))  # MISS: no load, the wait stays open
    clock.now += 3.0  # preempted, rescheduled: longer than a deadline away
    budgets.waiting("r")
    clock.now += 0.1
    budgets.checked([KEY])
    budgets.found("r", (KEY,))
    left, since = budgets.take("r")
    assert since == 103.9
    assert abs(left - 0.9) < 1e-9


def test_checks_past_the_deadline_leave_nothing_and_unknown_requests_everything() -> None:
    clock = Clock()
    budgets = RequestBudgets(1.0, clock)
    budgets.waiting("r")
    clock.now += 0.5
    budgets.waiting("r")
    clock.now += 0.5
    budgets.waiting("r")
    clock.now += 0.5
    budgets.checked([KEY])
    budgets.found("r", (KEY,))
    assert budgets.take("r") == (0.0, 100.0)
    assert budgets.take("other") == (1.0, None)
    assert budgets.take(None) == (1.0, None)
    budgets.waiting("gone")
    budgets.finished("gone")
    assert budgets.take("gone") == (1.0, None)


def test_entries_of_requests_never_finished_are_bounded() -> None:
    clock = Clock()
    budgets = RequestBudgets(1.0, clock, max_entries=4)
    for index in range(10):
        budgets.waiting(f"r{index}")
        budgets.checked([ChunkKey(bytes([index]))])
    assert budgets.take("r0") == (1.0, None)  # dropped, oldest first
    assert budgets.take("r9")[1] == 100.0
