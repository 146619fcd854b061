"""Starvation attacks on a node with default settings: an honest peer still gets its chunks.

The honest peer is a kvtier client (default timeouts) made anew for every
fetch, so each fetch has to get a new connection through the handshake
budget while the attack runs. Loops are bounded by
counts, never by time; the attack is known to be under way (the node has
logged its effect) before the honest fetches start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.errors import KVTierError
from kvtier.tiers.p2p.client import PeerClient
from tests.tiers.p2p.attackers import Slowloris, Trickler
from tests.tiers.p2p.p2p_nodes import SECRET, PeerProcess, spawner, wait_until

HONEST_FETCHES = 40


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    spawn, started = spawner(tmp_path_factory.mktemp("attacks"))
    try:
        yield spawn("V", seed=31, chunks=2, chunk_kib=16)
    finally:
        for peer in started:
            peer.stop()


def honest_fetch(peer: PeerProcess, index: int) -> bool:
    """One chunk through a new kvtier client (default timeouts), so over a new connection."""
    chunk = index % len(peer.keys)
    client = PeerClient(
        (peer.host, peer.port),
        secret=SECRET.encode(),
        namespace=peer.layout.namespace,
        slot_bytes=peer.layout.slot_bytes,
        connect_timeout=1.0,
        request_timeout=5.0,
        retry_after=0.0,
        max_message_bytes=64 << 10,
    )
    out = np.zeros(peer.layout.slot_bytes, dtype=np.uint8)
    try:
        fetched = client.fetch_into(peer.keys[chunk], out.data)
    except (OSError, KVTierError):
        return False
    finally:
        client.close()
    return fetched and client.counters.connects == 1 and np.array_equal(out, peer.data[chunk])


def honest_share(peer: PeerProcess) -> float:
    return sum(honest_fetch(peer, i) for i in range(HONEST_FETCHES)) / HONEST_FETCHES


def test_silent_connections_do_not_starve_an_honest_peer(victim: PeerProcess) -> None:
    # More silent connections than one source may keep in its handshake; each
    # is reopened as soon as the node drops it.
    with Slowloris(victim, count=200, source="127.0.0.2") as attack:
        wait_until(lambda: "displaced by a newer connection" in victim.log(), "the attack to bite")
        share = honest_share(victim)
        assert attack.closed_by_node > 0
    assert share >= 0.95, (share, victim.log()[-3000:])
    assert victim.alive()


def test_silent_connections_from_many_sources_do_not_starve_an_honest_peer(
    victim: PeerProcess,
) -> None:
    # 4 x 100 silent connections: more than the whole handshake budget (256).
    sources = [f"127.0.0.{i}" for i in range(4, 8)]
    with contextlib.ExitStack() as stack:
        attacks = [stack.enter_context(Slowloris(victim, 100, source)) for source in sources]
        wait_until(lambda: "256 in all" in victim.log(), "the budget to fill")
        share = honest_share(victim)
        assert sum(attack.closed_by_node for attack in attacks) > 0
    assert share >= 0.95, (share, victim.log()[-3000:])
    assert victim.alive()


def test_trickled_handshakes_do_not_starve_an_honest_peer(victim: PeerProcess) -> None:
    # A valid AUTH, one byte per 0.2 s: far slower than the 1 s handshake deadline allows.
    with Trickler(victim, count=64, source="127.0.0.3") as attack:
        wait_until(lambda: "stuck in authentication" in victim.log(), "the attack to bite")
        share = honest_share(victim)
        # The node logged its closes; the attacker's own thread sees them at
        # its next read, later on a loaded machine.
        wait_until(lambda: attack.closed_by_node > 0, "the attacker to see the node close it")
    assert share >= 0.95, (share, victim.log()[-3000:])
    assert attack.welcomed == 0  # no trickled handshake got through
    assert victim.alive()
