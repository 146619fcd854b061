"""Fixtures of the p2p tests: peer processes on loopback, stopped after use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiers.p2p.p2p_nodes import PeerProcess, Spawn, spawner


@pytest.fixture
def spawn_peer(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``kvtier peer`` processes on loopback; all are stopped after the test."""
    spawn, started = spawner(tmp_path)
    yield spawn
    for peer in started:
        peer.stop()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """Nodes A and B, four distinct chunks each, shared by the session's tests."""
    spawn, started = spawner(tmp_path_factory.mktemp("fleet"))
    try:
        yield spawn("A", seed=1), spawn("B", seed=2)
    finally:
        for peer in started:
            peer.stop()
