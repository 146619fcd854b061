"""The circuit breaker remote tiers share, driven by a fake clock and fixed dice."""

from __future__ import annotations

import random

import pytest

from kvtier.testing.outages import FakeClock
from kvtier.tiers.circuit import BreakerState, CircuitBreaker


class FixedDice(random.Random):
    """``random()`` always answers ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def make(
    clock: FakeClock, *, failures: int = 3, jitter: float = 0.0, dice: float = 0.0
) -> tuple[CircuitBreaker, list[tuple[BreakerState, BreakerState, str]]]:
    changes: list[tuple[BreakerState, BreakerState, str]] = []
    breaker = CircuitBreaker(
        failures=failures,
        backoff_s=1.0,
        max_backoff_s=5.0,
        jitter=jitter,
        clock=clock,
        rng=FixedDice(dice),
        on_change=lambda old, new, why: changes.append((old, new, why)),
    )
    return breaker, changes


def test_opens_after_consecutive_failures_only() -> None:
    breaker, changes = make(FakeClock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # the run is broken
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and changes == []
    breaker.record_failure("third in a row")
    assert breaker.state is BreakerState.OPEN
    assert changes == [(BreakerState.CLOSED, BreakerState.OPEN, "third in a row")]
    assert breaker.times_opened == 1


def test_a_missed_deadline_opens_at_once() -> None:
    breaker, changes = make(FakeClock())
    breaker.trip("job missed its deadline")
    assert breaker.state is BreakerState.OPEN
    breaker.trip("again")  # no second change while open
    assert len(changes) == 1


def test_one_probe_after_the_backoff_then_closed_on_success() -> None:
    clock = FakeClock()
    breaker, changes = make(clock)
    breaker.trip("down")
    clock.advance(0.999)
    assert not breaker.take_probe()
    clock.advance(0.001)
    assert breaker.take_probe()
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.take_probe()  # one probe at a time
    assert not breaker.closed
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert [new for _, new, _ in changes] == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]
    assert breaker.probes == 1


def test_failed_probes_double_the_backoff_up_to_the_cap() -> None:
    clock = FakeClock()
    breaker, _ = make(clock)
    breaker.trip("down")
    waits = []
    for _ in range(5):
        waits.append(breaker.retry_at - clock())
        clock.advance(waits[-1])
        assert breaker.take_probe()
        breaker.record_failure("probe failed")  # one failure re-opens a half-open breaker
        assert breaker.state is BreakerState.OPEN
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert breaker.times_opened == 1  # one outage, however many probes
    clock.advance(5.0)
    assert breaker.take_probe()
    breaker.record_success()
    breaker.trip("down again")
    assert breaker.retry_at - clock() == 1.0  # a new outage starts from the first backoff
    assert breaker.times_opened == 2


def test_jitter_shortens_the_backoff_by_the_dice() -> None:
    clock = FakeClock()
    breaker, _ = make(clock, jitter=0.2, dice=0.5)
    breaker.trip("down")
    assert breaker.retry_at - clock() == pytest.approx(0.9)


def test_stale_failures_while_open_change_nothing() -> None:
    clock = FakeClock()
    breaker, changes = make(clock, failures=1)
    breaker.record_failure()
    retry_at = breaker.retry_at
    breaker.record_failure()  # a call that started before the outage ends late
    assert breaker.retry_at == retry_at and len(changes) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failures": 0}, "failures"),
        ({"backoff_s": 2.0, "max_backoff_s": 1.0}, "backoff_s"),
        ({"jitter": 1.0}, "jitter"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CircuitBreaker(**kwargs)  # type: ignore[arg-type]
