"""A node's metrics count the connections its peer service refused, timed out and closed idle."""

from __future__ import annotations

import socket

import pytest

from kvtier.tiers.p2p import protocol
from tests.tiers.p2p.p2p_nodes import SAFETY_S, authenticate, node, read_to_end, wait_until

HELLO_MESSAGE = protocol.FRAME_BYTES + protocol.HELLO_BYTES


def test_refused_timed_out_and_idle_closed_connections_are_exported() -> None:
    with node([], handshake_timeout_s=0.2, idle_timeout_s=0.2) as c:
        listen = c.manager.tiers[0].describe()["listen"]
        assert isinstance(listen, str)
        address = protocol.parse_address(listen)

        def sample(name: str) -> float | None:
            labels = {"tier": "0", "tier_type": "p2p"}
            return c.metrics.registry.get_sample_value(f"kvtier_tier_peer_{name}", labels)

        def connect() -> socket.socket:
            sock = socket.create_connection(address, timeout=SAFETY_S)
            sock.settimeout(SAFETY_S)
            return sock

        with connect() as sock, pytest.raises(ConnectionError):
            authenticate(sock, secret="not-the-fleet-secret-000")
        assert sample("refused_total") == 1
        with connect() as sock:
            assert len(read_to_end(sock)) == HELLO_MESSAGE  # then silence, until the deadline
        assert sample("timed_out_total") == 1
        with connect() as sock:
            authenticate(sock)
            assert read_to_end(sock) == b""  # idle past the idle timeout
        assert sample("idle_closed_total") == 1
        wait_until(lambda: sample("connections_open") == 0, "the session to end")
        assert sample("handshakes_open") == 0
        assert sample("refused_total") == sample("timed_out_total") == 1
