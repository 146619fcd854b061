"""``BoundedCalls`` and ``call_within``, one mechanism: a result, an error, a
call left behind at its bound whose late result goes to ``dispose``."""

from __future__ import annotations

import threading

import pytest

from kvtier.tiers.deadlines import BoundedCalls, CallTimeout, call_within


def test_a_call_that_returns_in_time_gives_its_result_or_its_error() -> None:
    assert call_within(lambda: 42, 5.0, name="kvtier-test-call") == 42
    empty: dict[str, int] = {}
    with pytest.raises(KeyError, match="gone"):
        call_within(lambda: empty["gone"], 5.0, name="kvtier-test-call")


def test_a_late_result_goes_to_dispose_and_a_late_error_nowhere() -> None:
    release = threading.Event()
    disposed: list[str] = []
    done = threading.Event()

    def dispose(client: str) -> None:
        disposed.append(client)
        done.set()

    def slow_connect() -> str:
        release.wait()
        return "client"

    with pytest.raises(CallTimeout, match="no answer within"):
        call_within(slow_connect, 0.05, name="kvtier-test-call", dispose=dispose)
    assert disposed == []  # still running: nothing to close yet
    release.set()
    assert done.wait(30)
    assert disposed == ["client"]


def test_a_call_past_its_bound_fails_the_next_at_once_until_it_returns() -> None:
    calls = BoundedCalls("kvtier-test-codec", 0.05)
    release = threading.Event()
    try:
        with pytest.raises(CallTimeout):
            calls(release.wait)
        assert calls.overdue == 1
        with pytest.raises(CallTimeout, match="still running past its bound"):
            calls(lambda: 1)
        release.set()
        for _ in range(1000):  # its helper accounts for it once the call returns
            if not calls.overdue:
                break
            threading.Event().wait(0.01)
        assert calls.overdue == 0
        assert calls(lambda: 2) == 2
    finally:
        release.set()
        calls.close()
