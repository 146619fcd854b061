from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from p2p_nodes import PeerProcess

Spawn = Callable[..., PeerProcess]


def _spawner(workdir: Path) -> tuple[Spawn, list[PeerProcess]]:
    started: list[PeerProcess] = []

    def spawn(name: str, **kwargs: Any) -> PeerProcess:
        peer = PeerProcess(workdir, name, **kwargs)
        started.append(peer)
        return peer

    return spawn, started


@pytest.fixture
def spawn_peer(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``kvtier peer`` processes on loopback; all are stopped after the test."""
    spawn, started = _spawner(tmp_path)
    yield spawn
    for peer in started:
        peer.stop()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """Nodes A and B, four distinct chunks each, shared by the session's tests."""
    spawn, started = _spawner(tmp_path_factory.mktemp("fleet"))
    try:
        yield spawn("A", seed=1), spawn("B", seed=2)
    finally:
        for peer in started:
            peer.stop()
