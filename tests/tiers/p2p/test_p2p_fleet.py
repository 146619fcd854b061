"""Three nodes on loopback: A and B are ``kvtier peer`` processes, C is this process."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from kvtier.cli.peer import synthetic_chunks
from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup
from kvtier.tiers.p2p.protocol import format_address
from tests.tiers.p2p.p2p_nodes import (
    CHUNK_TOKENS,
    SECRET,
    PeerProcess,
    Spawn,
    load_all,
    node,
    wait_until,
)


def test_a_chunk_stored_on_a_is_loaded_byte_exact_by_c(
    fleet: tuple[PeerProcess, PeerProcess],
) -> None:
    a, b = fleet
    with node([a.address, b.address]) as c:
        assert c.cached_prefix(a.tokens) == len(a.tokens)
        np.testing.assert_array_equal(load_all(c, a.tokens), a.data)
        assert c.cached_prefix(b.tokens) == len(b.tokens)
        np.testing.assert_array_equal(load_all(c, b.tokens), b.data)
        stats = c.manager.tiers[0].stats
        assert stats.chunks_loaded == 8
        assert stats.bytes_loaded == 8 * c.layout.slot_bytes
        assert stats.load_failures == stats.corrupt_chunks == 0
        registry = c.metrics.registry
        labels = {"tier": "0", "tier_type": "p2p"}
        assert registry.get_sample_value("kvtier_tier_peers_reachable", labels) == 2
        assert registry.get_sample_value("kvtier_tier_peer_chunks_served_total", labels) == 0


def test_c_serves_what_it_fetched_to_the_next_node(
    fleet: tuple[PeerProcess, PeerProcess],
) -> None:
    a, _ = fleet
    with node([a.address]) as c:
        assert c.cached_prefix(a.tokens) == len(a.tokens)
        address = c.manager.tiers[0].describe()["listen"]
        assert isinstance(address, str)
        harness = TierHarness(
            {"type": "p2p", "secret": SECRET, "listen": None, "peers": [address]}, a.layout
        )
        try:
            assert [harness.lookup(k) for k in a.keys] == [Lookup.HIT] * len(a.keys)
            loaded = harness.load(a.keys, list(range(len(a.keys))))
            assert loaded.success
            np.testing.assert_array_equal(harness.buffer.array[: len(a.keys)], a.data)
        finally:
            harness.close()
        served = c.metrics.registry.get_sample_value(
            "kvtier_tier_peer_chunks_served_total", {"tier": "0", "tier_type": "p2p"}
        )
        assert served == len(a.keys)


def test_a_key_nobody_holds_is_a_miss(fleet: tuple[PeerProcess, PeerProcess]) -> None:
    a, b = fleet
    nobody, _ = synthetic_chunks(a.layout, 2, seed=99)
    with node([a.address, b.address]) as c:
        assert c.cached_prefix(nobody) == 0
        stats = c.manager.tiers[0].stats
        assert stats.misses >= 1 and stats.hits == 0 and stats.chunks_loaded == 0


def test_a_silent_peer_costs_a_timeout_not_a_hang(
    fleet: tuple[PeerProcess, PeerProcess],
) -> None:
    a, _ = fleet
    # Accepts connections (through the backlog) and never says a word.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        mute = format_address("127.0.0.1", silent.getsockname()[1])
        harness = TierHarness(
            {
                "type": "p2p",
                "secret": SECRET,
                "listen": None,
                "peers": [mute, a.address],
                "connect_timeout_s": 0.3,
                "request_timeout_s": 0.3,
            },
            a.layout,
        )
        try:
            unknown = harness.keys(1)[0]
            assert harness.lookup(unknown) is Lookup.MISS
            assert harness.lookup(a.keys[0]) is Lookup.HIT
            assert harness.load([a.keys[0]], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], a.data[0])
        finally:
            harness.close()


def test_a_peer_killed_mid_transfer_fails_the_job_and_nothing_lands(spawn_peer: Spawn) -> None:
    chunk_kib = 4096
    # 4 MiB at 2 MiB/s: the transfer is in flight for about two seconds.
    slow = spawn_peer("D", chunk_kib=chunk_kib, chunks=1, seed=7, max_send_rate="2MiB")
    healthy = spawn_peer("E", chunk_kib=chunk_kib, chunks=1, seed=8)
    with node([slow.address, healthy.address], chunk_kib=chunk_kib, slots=4) as c:
        primary = c.manager.primary
        key = c.keys(slow.tokens)[0]

        def promotion_submitted() -> bool:
            c.manager.lookup(c.keys(slow.tokens))  # non-blocking: starts the promotion
            c.step()
            return primary.is_writing(key)

        wait_until(promotion_submitted, "the promotion from D to start")
        slot = primary.slot_of(key)
        assert slot is not None
        wait_until(
            lambda: np.array_equal(primary.buffer.array[slot, :4096], slow.data[0, :4096]),
            "D's first bytes to land in the slot",
        )
        slow.kill()

        assert c.cached_prefix(slow.tokens) == 0
        assert primary.slot_of(key) is None and not primary.is_ready(key)
        stats = c.manager.tiers[0].stats
        assert stats.load_failures == 1 and stats.chunks_loaded == 0

        # The node goes on fetching from others, and serving what it holds.
        assert c.cached_prefix(healthy.tokens) == CHUNK_TOKENS
        np.testing.assert_array_equal(load_all(c, healthy.tokens), healthy.data)
        assert healthy.alive()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_nodes_talk_over_ipv6_loopback(fleet: tuple[PeerProcess, PeerProcess]) -> None:
    a, _ = fleet
    with node([a.address], listen="[::1]:0") as c:
        assert c.cached_prefix(a.tokens) == len(a.tokens)
        address = c.manager.tiers[0].describe()["listen"]
        assert isinstance(address, str) and address.startswith("[::1]:")
        harness = TierHarness(
            {"type": "p2p", "secret": SECRET, "listen": None, "peers": [address]}, a.layout
        )
        try:
            assert harness.load(a.keys[:1], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], a.data[0])
        finally:
            harness.close()
