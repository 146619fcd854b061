"""A hostile client sends malformed or oversized messages: it is dropped, the node serves on."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.integrity import HEADER_BYTES
from kvtier.layout import KEY_BYTES
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.protocol import MessageType
from tests.tiers.p2p.p2p_nodes import (
    PeerProcess,
    authenticate,
    connect,
    load_all,
    node,
    read_to_end,
    spawner,
    wait_until,
)

MAX_MESSAGE = 4096


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    spawn, started = spawner(tmp_path_factory.mktemp("hostile"))
    try:
        yield spawn("T", seed=5, max_message_bytes=MAX_MESSAGE, request_timeout_s=2.0)
    finally:
        for peer in started:
            peer.stop()


def still_serves(peer: PeerProcess) -> None:
    assert peer.alive()
    with node([peer.address]) as c:
        assert c.cached_prefix(peer.tokens) == len(peer.tokens)
        np.testing.assert_array_equal(load_all(c, peer.tokens), peer.data)


def authenticated(peer: PeerProcess) -> socket.socket:
    sock = connect(peer)
    authenticate(sock)
    return sock


def test_an_oversized_query_drops_the_connection(target: PeerProcess) -> None:
    with authenticated(target) as sock:
        sock.sendall(protocol.encode_frame(MessageType.QUERY, 1 << 40))
        assert read_to_end(sock) == b""
    wait_until(lambda: "QUERY body of 1099511627776 bytes" in target.log(), "the drop logged")
    still_serves(target)


def test_a_query_just_over_the_limit_is_dropped(target: PeerProcess) -> None:
    keys = [bytes([i]) * KEY_BYTES for i in range(MAX_MESSAGE // KEY_BYTES + 1)]
    with authenticated(target) as sock:
        protocol.send_message(sock, MessageType.QUERY, b"".join(keys))
        assert read_to_end(sock) == b""
    still_serves(target)


def test_garbage_before_authentication_is_refused(target: PeerProcess) -> None:
    with connect(target) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # The HELLO the server opened with, then nothing.
        assert len(read_to_end(sock)) == protocol.FRAME_BYTES + protocol.HELLO_BYTES
    still_serves(target)


def test_a_server_message_sent_by_a_client_is_dropped(target: PeerProcess) -> None:
    with authenticated(target) as sock:
        protocol.send_message(sock, MessageType.CHUNK, bytes(HEADER_BYTES))
        assert read_to_end(sock) == b""


def test_a_stalled_message_is_dropped(target: PeerProcess) -> None:
    with authenticated(target) as sock:
        sock.sendall(protocol.encode_frame(MessageType.FETCH, KEY_BYTES) + b"half")
        assert read_to_end(sock) == b""  # after the 2 s request timeout, not never
    wait_until(lambda: "stalled" in target.log(), "the drop logged")


def well_formed_replies(received: bytes) -> None:
    """Assert ``received`` is a sequence of well-formed replies."""
    allowed = {
        MessageType.HOLDS: (1, MAX_MESSAGE),
        MessageType.MISSING: (0, 0),
        MessageType.CHUNK: (HEADER_BYTES, 1 << 30),
    }
    offset = 0
    while offset < len(received):
        frame = protocol.decode_frame(received[offset : offset + protocol.FRAME_BYTES], allowed)
        offset += protocol.FRAME_BYTES + frame.length
    assert offset == len(received)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.builds(
                lambda kind, length, body: protocol.encode_frame(kind, length) + body,
                st.sampled_from(list(MessageType)),
                st.one_of(st.integers(0, 200), st.integers(0, 2**64 - 1)),
                st.binary(max_size=200),
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_fuzzed_messages_never_hurt_the_node(
    target: PeerProcess, pieces: list[bytes], authenticate_first: bool
) -> None:
    sock = authenticated(target) if authenticate_first else connect(target)
    with sock:
        # The node may drop us before all is sent: that is one of the right answers.
        with contextlib.suppress(OSError):
            sock.sendall(b"".join(pieces))
            sock.shutdown(socket.SHUT_WR)  # the message ends here, complete or not
        received = read_to_end(sock)
    if not authenticate_first:
        hello = protocol.FRAME_BYTES + protocol.HELLO_BYTES
        assert len(received) in (hello, hello + protocol.FRAME_BYTES + protocol.MAC_BYTES)
    else:
        well_formed_replies(received)
    assert target.alive()


def test_the_node_serves_after_the_fuzzing(target: PeerProcess) -> None:
    still_serves(target)
