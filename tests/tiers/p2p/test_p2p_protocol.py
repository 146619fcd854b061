"""The peer protocol's decoders, fuzzed: anything malformed raises PeerProtocolError."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import PeerAuthError, PeerProtocolError
from kvtier.layout import KEY_BYTES
from kvtier.tiers.addresses import is_loopback
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.flow import ByteBudget, SendPacer
from kvtier.tiers.p2p.protocol import MessageType

SERVER_ACCEPTS = {
    MessageType.QUERY: (KEY_BYTES, 4096),
    MessageType.FETCH: (KEY_BYTES, KEY_BYTES),
}


def frames() -> st.SearchStrategy[bytes]:
    """Headers near the valid ones (right magic, small fields) and plain noise."""
    near = st.builds(
        lambda magic, version, kind, length: (
            magic + bytes([version, kind]) + length.to_bytes(8, "little")
        ),
        st.sampled_from([protocol.MAGIC, b"KQ", b"\0\0"]),
        st.integers(0, 3),
        st.integers(0, 12),
        st.one_of(st.integers(0, 5000), st.integers(0, 2**64 - 1)),
    )
    return st.one_of(near, st.binary(min_size=0, max_size=2 * protocol.FRAME_BYTES))


@given(frames())
def test_frame_decoder_accepts_only_allowed_frames_within_limits(raw: bytes) -> None:
    try:
        frame = protocol.decode_frame(raw, SERVER_ACCEPTS)
    except PeerProtocolError:
        return
    low, high = SERVER_ACCEPTS[frame.kind]
    assert low <= frame.length <= high
    assert protocol.encode_frame(frame.kind, frame.length) == raw


@given(st.binary(max_size=300))
def test_query_decoder_takes_whole_keys_only(body: bytes) -> None:
    try:
        keys = protocol.decode_keys(body)
    except PeerProtocolError:
        assert not body or len(body) % KEY_BYTES
        return
    assert keys and all(len(k) == KEY_BYTES for k in keys)
    assert protocol.encode_keys(keys) == body


@given(st.binary(max_size=64), st.integers(0, 70))
def test_holds_decoder_takes_one_flag_per_key(body: bytes, count: int) -> None:
    try:
        found = protocol.decode_holds(body, count)
    except PeerProtocolError:
        return
    assert len(found) == count
    assert protocol.encode_holds(found) == body


@given(st.binary(max_size=100))
def test_hello_decoder_takes_exact_bodies(body: bytes) -> None:
    try:
        hello = protocol.Hello.decode(body)
    except PeerProtocolError:
        assert len(body) != protocol.HELLO_BYTES
        return
    assert hello.encode() == body


@given(st.binary(max_size=100))
def test_random_auth_bodies_never_authenticate(body: bytes) -> None:
    hello = protocol.Hello(bytes(32), bytes(32), 4096).encode()
    with pytest.raises(PeerProtocolError):  # PeerAuthError is one
        protocol.check_client_proof(b"kvtier-test-secret-0123", hello, body)


def test_a_proof_for_one_hello_fails_for_another() -> None:
    secret = b"kvtier-test-secret-0123"
    first = protocol.Hello(protocol.new_nonce(), bytes(32), 4096).encode()
    second = protocol.Hello(protocol.new_nonce(), bytes(32), 4096).encode()
    proof = protocol.client_proof(secret, first, protocol.new_nonce())
    protocol.check_client_proof(secret, first, proof)
    with pytest.raises(PeerAuthError):
        protocol.check_client_proof(secret, second, proof)


@given(st.text(max_size=40))
def test_address_parser_returns_a_port_in_range_or_refuses(text: str) -> None:
    try:
        host, port = protocol.parse_address(text)
    except ValueError:
        return
    assert host and 1 <= port <= 65535
    assert protocol.parse_address(protocol.format_address(host, port)) == (host, port)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::1]:9", ("::1", 9)),
        ("node-a:7000", ("node-a", 7000)),
    ],
)
def test_address_parser_reads_hosts_and_ports(text: str, expected: tuple[str, int]) -> None:
    assert protocol.parse_address(text) == expected


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("node-a")


def test_byte_budget_holds_back_what_does_not_fit() -> None:
    budget = ByteBudget(100)
    with budget.hold(60):
        with pytest.raises(TimeoutError), budget.hold(60, timeout=0):
            pass
        entered = threading.Event()

        def second() -> None:
            with budget.hold(60):
                entered.set()

        worker = threading.Thread(target=second)
        worker.start()
        assert not entered.wait(0.05)
    worker.join()
    assert entered.is_set() and budget.used == 0
    with budget.hold(10_000):  # larger than the budget: runs alone
        assert budget.used == 100


def test_send_pacer_spaces_pieces_at_the_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = SendPacer(1000.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(4):
        pacer.wait(500)
    assert slept == pytest.approx([0.5, 0.5, 0.5])
    assert now[0] == pytest.approx(1.5)
