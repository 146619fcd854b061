"""The connection budgets, without sockets: who gets in, who gives way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.tiers.p2p import PeerTierOptions
from kvtier.tiers.p2p.admission import HandshakeBudget, SessionBudget, source_of


def test_a_source_at_its_limit_displaces_its_own_oldest() -> None:
    budget: HandshakeBudget[str] = HandshakeBudget(limit=10, per_source=2)
    assert budget.add("honest", "10.0.0.1", 1.0) is None
    assert budget.add("flood-1", "10.0.0.9", 2.0) is None
    assert budget.add("flood-2", "10.0.0.9", 3.0) is None
    assert budget.add("flood-3", "10.0.0.9", 4.0) == "flood-1"
    assert "honest" in budget and "flood-1" not in budget
    assert budget.held_by("10.0.0.9") == 2 and len(budget) == 3


def test_a_full_budget_displaces_the_oldest_of_the_largest_source() -> None:
    budget: HandshakeBudget[str] = HandshakeBudget(limit=4, per_source=3)
    budget.add("a1", "a", 1.0)
    budget.add("b1", "b", 2.0)
    budget.add("b2", "b", 3.0)
    budget.add("c1", "c", 4.0)
    # a1 is the oldest of all, but b holds most.
    assert budget.add("d1", "d", 5.0) == "b1"
    assert {"a1", "b2", "c1", "d1"} == {c for c in ("a1", "b1", "b2", "c1", "d1") if c in budget}


def test_deadlines_pass_oldest_first() -> None:
    budget: HandshakeBudget[str] = HandshakeBudget(limit=4, per_source=4)
    for index, name in enumerate(["x", "y", "z"]):
        budget.add(name, "s", 10.0 + index)
    assert budget.next_deadline() == 10.0
    assert budget.expired(now=11.0) == ["x", "y"]
    assert budget.next_deadline() == 12.0 and len(budget) == 1
    budget.remove("z")
    assert budget.next_deadline() is None and budget.held_by("s") == 0


def test_impossible_handshake_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="per_source"):
        HandshakeBudget(limit=2, per_source=3)


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=200))
def test_the_handshake_budget_never_exceeds_its_limits(ops: list[tuple[int, bool]]) -> None:
    budget: HandshakeBudget[int] = HandshakeBudget(limit=6, per_source=3)
    live: set[int] = set()
    for serial, (source, finish) in enumerate(ops):
        if finish and live:
            done = min(live)
            budget.remove(done)
            live.discard(done)
            continue
        displaced = budget.add(serial, str(source), float(serial))
        live.add(serial)
        if displaced is not None:
            live.discard(displaced)
        assert len(budget) == len(live) <= 6
        assert all(budget.held_by(str(s)) <= 3 for s in range(6))
        assert all(conn in budget for conn in live)


def test_a_full_session_budget_takes_the_longest_idle_place() -> None:
    budget: SessionBudget[str] = SessionBudget(limit=2)
    assert budget.add("first") == (True, None)
    assert budget.add("second") == (True, None)
    budget.idle("second", now=5.0)
    budget.idle("first", now=7.0)
    assert budget.add("third") == (True, "second")
    assert not budget.busy("second")  # its thread learns it was displaced
    assert budget.busy("first")
    # first and third are busy: nobody gives way.
    assert budget.add("fourth") == (False, None)
    budget.remove("third")
    assert budget.add("fourth") == (True, None)


def test_the_per_source_limit_defaults_to_half_the_handshake_budget() -> None:
    def options(**entry: object) -> PeerTierOptions:
        config = load_config({"secondary_tiers": [{"type": "p2p", "secret": "x" * 16, **entry}]})
        options = config.secondary_tiers[0].options
        assert isinstance(options, PeerTierOptions)
        return options

    assert options().handshakes_per_source == 128
    assert options(max_handshakes=10).handshakes_per_source == 5
    assert options(max_handshakes=10, max_handshakes_per_source=10).handshakes_per_source == 10
    with pytest.raises(ConfigError, match=r"max_handshakes_per_source \(11\) exceeds"):
        options(max_handshakes=10, max_handshakes_per_source=11)


@pytest.mark.parametrize(
    ("host", "source"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:fffe", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("::1", "::/64"),
    ],
)
def test_an_ipv6_host_counts_as_its_64_network(host: str, source: str) -> None:
    assert source_of(host) == source


def test_rotating_through_one_ipv6_network_stays_within_the_per_source_limit() -> None:
    budget: HandshakeBudget[str] = HandshakeBudget(limit=8, per_source=2)
    for index in range(6):
        budget.add(f"conn{index}", source_of(f"2001:db8::{index + 1}"), deadline=1.0)
    assert budget.held_by("2001:db8::/64") == 2
    budget.add("honest", source_of("2001:db8:0:1::5"), deadline=1.0)
    assert "honest" in budget
