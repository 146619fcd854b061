"""``Deadlines``: one thread per tier firing callbacks when their time comes.

A step's existence checks each add a deadline, all of them later than the
one the thread already waits for: adding them must not wake the thread each
time (it would only contend for the lock with the thread adding them), and
a deadline earlier than any other must still wake it.
"""

from __future__ import annotations

import threading

from kvtier.tiers.deadlines import Deadlines


class _Clock:
    """A clock the test moves; the thread still waits on real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_earlier_deadline_added_later_wakes_the_thread() -> None:
    clock = _Clock()
    deadlines = Deadlines("test-deadlines", clock)
    fired: list[str] = []
    early = threading.Event()

    def fire_early() -> None:
        fired.append("early")
        early.set()

    try:
        deadlines.after(3600.0, lambda: fired.append("late"))
        # The thread now waits an hour: only a wake makes it see this one.
        deadlines.after(0.01, fire_early)
        clock.now = 0.01
        assert early.wait(60), "an earlier deadline did not wake the thread"
        assert fired == ["early"]
    finally:
        deadlines.close()


def test_later_deadlines_do_not_wake_the_thread() -> None:
    clock = _Clock()
    deadlines = Deadlines("test-deadlines", clock)
    notified = 0
    real_notify = deadlines._wake.notify

    def notify(n: int = 1) -> None:
        nonlocal notified
        notified += 1
        real_notify(n)

    deadlines._wake.notify = notify  # type: ignore[method-assign]
    try:
        for index in range(100):  # a step's checks: each bound later than the last
            deadlines.after(3600.0 + index, lambda: None)
        assert notified == 1  # the first: the thread had nothing to wait for
        deadlines.after(1.0, lambda: None)  # a new earliest one
        assert notified == 2
    finally:
        deadlines.close()


def test_callbacks_fire_in_the_order_of_their_deadlines() -> None:
    clock = _Clock()
    deadlines = Deadlines("test-deadlines", clock)
    fired: list[float] = []
    done = threading.Event()
    try:
        for when in (0.03, 0.01, 0.02, 0.04):
            deadlines.after(when, lambda when=when: fired.append(when))  # type: ignore[misc]
        deadlines.after(0.05, done.set)
        clock.now = 1.0
        assert done.wait(60)
        assert fired == [0.01, 0.02, 0.03, 0.04]
    finally:
        deadlines.close()
