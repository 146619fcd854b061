"""The opening every outage test shares: a remote tier under a harness, its
circuit breaker on a clock that moves only when the test says."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvtier.testing import TierHarness, small_layout
from kvtier.testing.outages import FakeClock
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.remote import RemoteTier

R = TypeVar("R", bound=RemoteTier)


def on_fake_clock(tier: SecondaryTier, kind: type[R]) -> tuple[R, FakeClock]:
    """``tier`` as a ``kind``, its breaker switched to a new :class:`FakeClock`."""
    assert isinstance(tier, kind)
    clock = FakeClock()
    tier.breaker.clock = clock
    return tier, clock


@contextmanager
def outage_harness(
    entry: dict[str, Any], kind: type[R], *, num_slots: int = 32
) -> Iterator[tuple[TierHarness[R], R, FakeClock]]:
    """A harness over the remote tier ``entry`` describes, the tier, its
    breaker's clock; the harness is closed on leaving."""
    harness = TierHarness(entry, small_layout(), num_slots=num_slots, tier_class=kind)
    try:
        tier, clock = on_fake_clock(harness.tier, kind)
        yield harness, tier, clock
    finally:
        harness.close()
