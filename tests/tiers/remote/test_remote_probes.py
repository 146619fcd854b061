"""A remote tier's probes against a backend that freezes and thaws.

Probe calls made while the backend is frozen never return on their own
(:class:`tests.tiers.remote.remote_doubles.Backend`): recovery must not wait for them. The
breaker's clock is a :class:`FakeClock`; each probe's deadline is awaited as
a state change, never timed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.testing import TierHarness
from kvtier.testing.outages import FakeClock, wait_until
from kvtier.tiers.base import Lookup, LookupContext
from kvtier.tiers.circuit import BreakerState
from tests.support.cache_tiers import backend_of
from tests.tiers.remote.outage import outage_harness
from tests.tiers.remote.remote_doubles import FreezableBackend, FreezableTier

ENTRY = {
    "type": "FreezableTier",
    "module_path": "tests.tiers.remote.remote_doubles",
    "deadline_s": 0.05,
}


Opened = tuple[TierHarness[FreezableTier], FreezableTier, FakeClock]


@pytest.fixture
def opened() -> Iterator[Opened]:
    with outage_harness(ENTRY, FreezableTier, num_slots=8) as opened:
        yield opened


@pytest.fixture
def harness(opened: Opened) -> TierHarness[FreezableTier]:
    return opened[0]


@pytest.fixture
def backend(opened: Opened) -> Iterator[FreezableBackend]:
    """The tier's backend, thawed and its stuck calls released before the tier closes."""
    backend = backend_of(opened[1], FreezableBackend)
    try:
        yield backend
    finally:
        backend.thaw()
        backend.release_stuck()


@pytest.fixture
def clock(opened: Opened) -> FakeClock:
    """The breaker's clock."""
    return opened[2]


def test_a_thawed_backend_serves_at_the_next_probe_though_earlier_probes_hang(
    harness: TierHarness[FreezableTier], backend: FreezableBackend, clock: FakeClock
) -> None:
    tier = harness.tier
    assert isinstance(tier, FreezableTier)
    keys = harness.keys(2)
    harness.fill([0, 1])
    assert harness.store(keys, [0, 1]).success
    backend.freeze()
    tier.breaker.trip("injected outage")
    for stuck in range(1, 4):
        clock.advance(tier.breaker.max_backoff_s)
        assert tier.lookup(keys[0], LookupContext()) is not Lookup.HIT
        assert tier.stats.breaker_probes == stuck
        wait_until(lambda: tier.breaker.state is BreakerState.OPEN, what="probe given up")
        wait_until(lambda n=stuck: backend.stuck == n, what=f"{stuck} calls stuck")  # type: ignore[misc]
        assert len(tier.probes.threads) == stuck  # each still in its call
    backend.thaw()
    clock.advance(tier.breaker.max_backoff_s)
    tier.lookup(keys[0], LookupContext())
    # A fresh probe went out although the earlier ones still hang, and closed it.
    assert tier.stats.breaker_probes == 4
    wait_until(lambda: tier.breaker.closed, what="closed")
    assert backend.stuck == 3
    assert [harness.lookup(k) for k in keys] == [Lookup.HIT] * 2


def test_a_long_freeze_strands_at_most_max_probe_threads(
    harness: TierHarness[FreezableTier],
    backend: FreezableBackend,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = harness.tier
    assert isinstance(tier, FreezableTier)
    tier.probes.max_threads = 3
    key = harness.keys(1)[0]
    backend.freeze()
    tier.breaker.trip("injected outage")
    for _ in range(6):
        clock.advance(tier.breaker.max_backoff_s)
        tier.lookup(key, LookupContext())
        wait_until(lambda: tier.breaker.state is BreakerState.OPEN, what="probe given up")
        assert len(tier.probes.threads) <= 3
    assert tier.stats.breaker_probes == 3
    wait_until(lambda: backend.stuck == 3, what="3 calls stuck")
    stuck_warnings = [r for r in caplog.records if "probes stuck" in r.getMessage()]
    assert len(stuck_warnings) == 1  # once, not at every lookup
    # Once a stuck call ends (its client's timeout), probing resumes.
    backend.thaw()
    backend.release_stuck()
    wait_until(lambda: not tier.probes.threads, what="stuck probes ended")
    clock.advance(tier.breaker.max_backoff_s)
    tier.lookup(key, LookupContext())
    assert tier.stats.breaker_probes == 4
    wait_until(lambda: tier.breaker.closed, what="closed")
    assert tier.stats.breaker_probes == 4
