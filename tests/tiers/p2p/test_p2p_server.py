"""The peer service in this process: pinning while it sends, budgets, timeouts, clean close."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from kvtier.keys import ChunkKey
from kvtier.tiers.p2p import client as client_module
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.protocol import MessageType
from tests.tiers.p2p.p2p_nodes import (
    SAFETY_S,
    SECRET,
    Served,
    authenticate,
    peer_client,
    read_to_end,
    served,
    wait_until,
)


def fetch_header(sock: socket.socket, key: ChunkKey) -> protocol.Frame:
    protocol.send_message(sock, MessageType.FETCH, key)
    return protocol.read_frame(sock, {MessageType.CHUNK: (0, 1 << 30)})


def test_a_chunk_stays_pinned_while_it_is_sent() -> None:
    # 2 MiB at 1 MiB/s: eight paced pieces, the last one about 1.75 s after the first.
    with served(chunk_kib=2048, slots=1, max_send_rate=float(1 << 20)) as node:
        with node.connect() as sock:
            authenticate(sock)
            frame = fetch_header(sock, node.key)
            assert node.primary.refcount(node.key) == 1
            # Pinned, so the only slot cannot be evicted for another chunk.
            assert node.primary.prepare_store([node.other]) is None
            body = protocol.recv_exact(sock, frame.length)
        assert len(body) == protocol.chunk_length(node.layout.slot_bytes)
        wait_until(lambda: node.primary.refcount(node.key) == 0, "the chunk to be unpinned")
        assert node.server.counters.chunks_served == 1


def test_a_missing_chunk_is_answered_missing() -> None:
    with served() as node, node.connect() as sock:
        authenticate(sock)
        protocol.send_message(sock, MessageType.FETCH, node.other)
        frame = protocol.read_frame(sock, {MessageType.MISSING: (0, 0)})
        assert frame.length == 0
        protocol.send_message(sock, MessageType.QUERY, node.key + node.other)
        frame = protocol.read_frame(sock, {MessageType.HOLDS: (2, 2)})
        assert protocol.decode_holds(protocol.recv_exact(sock, 2), 2) == [True, False]


def connect_from(node: Served, source: str) -> socket.socket:
    """A connection to ``node`` from the loopback address ``source`` (another "machine")."""
    sock = socket.create_connection(node.server.address, SAFETY_S, source_address=(source, 0))
    sock.settimeout(SAFETY_S)
    return sock


HELLO_MESSAGE = protocol.FRAME_BYTES + protocol.HELLO_BYTES


def read_hello(sock: socket.socket) -> bytes:
    """HELLO's body: the server accepted and started the handshake."""
    return protocol.recv_exact(sock, HELLO_MESSAGE)[protocol.FRAME_BYTES :]


def send_auth(sock: socket.socket, hello: bytes | None = None) -> None:
    """Answer HELLO (read now unless given) with a valid AUTH."""
    hello = read_hello(sock) if hello is None else hello
    auth = protocol.client_proof(SECRET.encode(), hello, protocol.new_nonce())
    protocol.send_message(sock, MessageType.AUTH, auth)


def welcomed(sock: socket.socket) -> bool:
    """Whether the server answers the AUTH just sent with a WELCOME."""
    received = read_to_end_or(sock, protocol.FRAME_BYTES)
    return len(received) == protocol.FRAME_BYTES and received[3] == MessageType.WELCOME


def read_to_end_or(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes, or fewer if the server closes the connection first."""
    received = bytearray()
    while len(received) < size:
        data = sock.recv(size - len(received))
        if not data:
            break
        received += data
    return bytes(received)


def test_an_idle_session_gives_way_to_a_newcomer() -> None:
    with served(max_connections=1) as node:
        with node.connect() as first:
            authenticate(first)
            wait_until(lambda: node.server.idle_connections == 1, "first to wait for requests")
            with node.connect() as second:
                authenticate(second)  # the budget is full, but first sits idle
                assert read_to_end(first) == b""
                fetch_header(second, node.key)
        assert node.server.counters.idle_closed == 1
        assert node.server.counters.refused == 0


def test_a_busy_session_keeps_its_place_and_the_newcomer_is_refused() -> None:
    with served(chunk_kib=16384, slots=1, max_connections=1) as node:
        busy = socket.socket()
        # A small receive window: the 16 MiB send blocks until this side reads.
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        busy.settimeout(SAFETY_S)
        busy.connect(node.server.address)
        with busy:
            authenticate(busy)
            frame = fetch_header(busy, node.key)
            with node.connect() as newcomer:
                send_auth(newcomer)
                assert read_to_end(newcomer) == b""  # closed instead of a WELCOME
            assert node.server.counters.refused == 1
            body = protocol.recv_exact(busy, frame.length)
        assert len(body) == protocol.chunk_length(node.layout.slot_bytes)
        assert node.server.counters.idle_closed == 0


def test_an_idle_session_is_closed_after_the_idle_timeout() -> None:
    with served(idle_timeout=0.2) as node, node.connect() as sock:
        authenticate(sock)
        assert read_to_end(sock) == b""
        assert node.server.counters.idle_closed == 1  # counted before the close
        wait_until(lambda: node.server.open_connections == 0, "the session to end")


def test_a_trickled_handshake_is_cut_at_its_deadline() -> None:
    with served(handshake_timeout=0.5) as node, node.connect() as sock:
        hello = protocol.recv_exact(sock, HELLO_MESSAGE)[protocol.FRAME_BYTES :]
        auth = protocol.client_proof(SECRET.encode(), hello, protocol.new_nonce())
        message = protocol.encode_frame(MessageType.AUTH, len(auth)) + auth
        sent = 0
        # One byte every 0.1 s: each read would meet a per-read timeout of
        # 0.5 s, but the whole message takes 7.6 s, far past the deadline.
        with contextlib.suppress(OSError):
            for byte in message:
                sock.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.1)
        assert read_to_end(sock) == b""  # no WELCOME
        assert sent < len(message)
        wait_until(lambda: node.server.counters.timed_out == 1, "the timeout counted")
        assert node.server.counters.connections == 0


def test_a_source_over_its_handshake_limit_displaces_only_its_own() -> None:
    with served(max_handshakes=8, max_handshakes_per_source=2) as node:
        with (
            node.connect() as honest,
            connect_from(node, "127.0.0.2") as oldest,
            connect_from(node, "127.0.0.2") as second,
        ):
            second_hello = read_hello(second)  # accepted, in order, before third
            with connect_from(node, "127.0.0.2") as third:
                assert len(read_to_end(oldest)) == HELLO_MESSAGE  # displaced by third
                authenticate(third)
            send_auth(second, second_hello)
            send_auth(honest)
            assert welcomed(second) and welcomed(honest)
        assert node.server.counters.refused == 1
        assert node.server.counters.connections == 3


def test_a_full_handshake_budget_displaces_from_the_largest_source() -> None:
    with served(max_handshakes=3, max_handshakes_per_source=3) as node:
        with (
            connect_from(node, "127.0.0.2") as crowd_first,
            connect_from(node, "127.0.0.2") as crowd_second,
            connect_from(node, "127.0.0.3") as alone,
        ):
            hellos = [read_hello(crowd_second), read_hello(alone)]  # accepted before newcomer
            with node.connect() as newcomer:
                assert len(read_to_end(crowd_first)) == HELLO_MESSAGE
                authenticate(newcomer)
            for sock, hello in zip((crowd_second, alone), hellos, strict=True):
                send_auth(sock, hello)
                assert welcomed(sock)
        assert node.server.counters.refused == 1


def test_close_cuts_idle_connections_and_returns() -> None:
    node = Served(64, 2)
    sock = node.connect()
    authenticate(sock)
    node.close()  # would hang if it waited for the idle connection to end by itself
    assert read_to_end(sock) == b""
    sock.close()


def test_a_request_on_a_connection_the_peer_closed_is_repeated_on_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with served(idle_timeout=0.2) as node:
        client = peer_client(node, idle_timeout=3600.0)
        try:
            assert client.query([node.key, node.other]) == [True, False]
            wait_until(lambda: node.server.counters.idle_closed == 1, "the idle close")
            # The close may reach the client just after its staleness check: skip the check.
            monkeypatch.setattr(client_module.select, "select", lambda *args: ([], [], []))
            assert client.query([node.key]) == [True]
            assert client.counters.as_dict() == {"connects": 2, "idle_closed": 0, "reconnects": 1}
            assert client.available()  # not counted as a failure of the peer
        finally:
            client.close()


def test_a_client_closes_connections_unused_for_half_the_idle_timeout() -> None:
    now = [0.0]
    with served() as node:
        client = peer_client(node, idle_timeout=10.0, clock=lambda: now[0])
        try:
            assert client.query([node.key]) == [True]
            now[0] = 4.9
            assert client.query([node.key]) == [True]  # reused
            assert client.counters.connects == 1
            now[0] = 10.0
            assert client.query([node.key]) == [True]
            assert client.counters.as_dict() == {"connects": 2, "idle_closed": 1, "reconnects": 0}
            wait_until(lambda: node.server.open_connections == 1, "the server to see the close")
        finally:
            client.close()
