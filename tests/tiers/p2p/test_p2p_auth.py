"""Every connection authenticates: a wrong or missing secret is refused and nothing is served."""

from __future__ import annotations

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError, PeerAuthError
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.protocol import MessageType
from tests.tiers.p2p.p2p_nodes import PeerProcess, connect, node, read_to_end, wait_until


def test_a_wrong_secret_is_refused_and_nothing_served(
    fleet: tuple[PeerProcess, PeerProcess],
) -> None:
    a, _ = fleet
    with node([a.address], secret="not-the-fleet-secret-000") as c:
        assert c.cached_prefix(a.tokens) == 0
        tier = c.manager.tiers[0]
        assert tier.stats.chunks_loaded == tier.stats.bytes_loaded == 0
        assert tier.stats.hits == 0
    wait_until(lambda: "wrong shared secret" in a.log(), "A to log the refusal")
    assert "refused 127.0.0.1:" in a.log()


def test_a_client_that_skips_authentication_is_refused(
    fleet: tuple[PeerProcess, PeerProcess],
) -> None:
    a, _ = fleet
    with connect(a) as sock:
        hello = protocol.recv_exact(sock, protocol.FRAME_BYTES + protocol.HELLO_BYTES)
        assert hello[: len(protocol.MAGIC)] == protocol.MAGIC
        # Straight to a query, as if the handshake were optional.
        protocol.send_message(sock, MessageType.QUERY, protocol.encode_keys(a.keys))
        assert read_to_end(sock) == b""
    wait_until(lambda: "unexpected QUERY message" in a.log(), "A to log the refusal")


def test_a_forged_proof_is_refused(fleet: tuple[PeerProcess, PeerProcess]) -> None:
    a, _ = fleet
    with connect(a) as sock:
        protocol.recv_exact(sock, protocol.FRAME_BYTES + protocol.HELLO_BYTES)
        protocol.send_message(sock, MessageType.AUTH, bytes(protocol.AUTH_BYTES))
        assert read_to_end(sock) == b""


def test_a_replayed_handshake_is_refused(fleet: tuple[PeerProcess, PeerProcess]) -> None:
    a, _ = fleet
    with connect(a) as first:
        frame = protocol.recv_exact(first, protocol.FRAME_BYTES)
        hello = protocol.recv_exact(first, protocol.HELLO_BYTES)
        proof = protocol.client_proof(b"kvtier-test-secret-0123456789", hello, bytes(32))
        protocol.send_message(first, MessageType.AUTH, proof)
        assert protocol.recv_exact(first, protocol.FRAME_BYTES)[3] == MessageType.WELCOME
    assert frame[3] == MessageType.HELLO
    # The server's nonce differs per connection: the recorded proof is worthless.
    with connect(a) as second:
        protocol.recv_exact(second, protocol.FRAME_BYTES + protocol.HELLO_BYTES)
        protocol.send_message(second, MessageType.AUTH, proof)
        assert read_to_end(second) == b""


def test_a_server_without_the_secret_is_refused_by_the_client() -> None:
    hello = protocol.Hello(protocol.new_nonce(), bytes(32), 4096).encode()
    nonce = protocol.new_nonce()
    server_proof = protocol.check_client_proof(
        b"secret-one-0123456789",
        hello,
        protocol.client_proof(b"secret-one-0123456789", hello, nonce),
    )
    protocol.check_server_proof(b"secret-one-0123456789", hello, nonce, server_proof)
    with pytest.raises(PeerAuthError):
        protocol.check_server_proof(b"secret-two-0123456789", hello, nonce, server_proof)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"type": "p2p"}, "secondary_tiers[0].secret"),
        ({"type": "p2p", "secret": "short"}, "at least 16 characters"),
        ({"type": "p2p", "secret": "x" * 16, "peers": ["no-port"]}, "is not host:port"),
        ({"type": "p2p", "secret": "x" * 16, "listen": "::1:80"}, "in brackets"),
    ],
)
def test_bad_options_are_config_errors(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config({"secondary_tiers": [entry]})


def test_the_secret_never_shows(fleet: tuple[PeerProcess, PeerProcess]) -> None:
    a, _ = fleet
    config = load_config({"secondary_tiers": [{"type": "p2p", "secret": "visible-if-leaked-123"}]})
    assert "visible-if-leaked-123" not in repr(config)
    with pytest.raises(ConfigError) as error:
        load_config({"secondary_tiers": [{"type": "p2p", "secret": "leaked-too-short"[:15]}]})
    assert "leaked-too-shor" not in str(error.value)
    with node([a.address], secret="visible-if-leaked-123") as c:
        assert "visible-if-leaked-123" not in repr(c.manager.tiers[0].describe())
