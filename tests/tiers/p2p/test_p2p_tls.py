"""TLS between peers: round trips, client certificates, and plaintext refused both ways."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.tiers.p2p.tls import TLSSettings
from tests.tiers.p2p.certs import PKI, make_pki
from tests.tiers.p2p.p2p_nodes import (
    PeerProcess,
    Spawn,
    connect,
    load_all,
    node,
    peer_client,
    read_to_end,
    served,
    spawner,
    wait_until,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def server_tls(pki: PKI, **extra: Any) -> dict[str, Any]:
    return {
        "tls": True,
        "tls_cert_file": str(pki.node.cert),
        "tls_key_file": str(pki.node.key),
        "tls_ca_file": str(pki.ca),
        **extra,
    }


def client_tls(pki: PKI, identity: Any = None) -> dict[str, Any]:
    options: dict[str, Any] = {"tls": True, "tls_ca_file": str(pki.ca), "listen": None}
    if identity is not None:
        options.update(tls_cert_file=str(identity.cert), tls_key_file=str(identity.key))
    return options


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, pki: PKI
) -> Iterator[tuple[PeerProcess, PeerProcess, PeerProcess]]:
    """T serves over TLS; M also requires client certificates; P serves plaintext."""
    spawn, started = spawner(tmp_path_factory.mktemp("tls"))
    try:
        yield (
            spawn("T", seed=21, **server_tls(pki)),
            spawn("M", seed=22, **server_tls(pki, tls_require_client_cert=True)),
            spawn("P", seed=23),
        )
    finally:
        for peer in started:
            peer.stop()


def test_chunks_round_trip_over_tls(nodes: tuple[PeerProcess, ...], pki: PKI) -> None:
    tls_node = nodes[0]
    with node([tls_node.address], **client_tls(pki)) as c:
        assert c.cached_prefix(tls_node.tokens) == len(tls_node.tokens)
        np.testing.assert_array_equal(load_all(c, tls_node.tokens), tls_node.data)
        assert c.manager.tiers[0].describe()["tls"] is True


def test_a_plaintext_client_is_refused_by_a_tls_node(
    nodes: tuple[PeerProcess, ...], pki: PKI
) -> None:
    tls_node = nodes[0]
    with node([tls_node.address]) as c:
        assert c.cached_prefix(tls_node.tokens) == 0
        assert c.manager.tiers[0].stats.chunks_loaded == 0
    with connect(tls_node) as sock:
        # A TLS node says nothing in the clear: no HELLO, no namespace, no nonce.
        assert read_to_end(sock) == b""
    wait_until(lambda: "stuck in TLS handshake" in tls_node.log(), "the refusal logged")


def test_a_tls_client_is_refused_by_a_plaintext_node(
    nodes: tuple[PeerProcess, ...], pki: PKI
) -> None:
    plain = nodes[2]
    with node([plain.address], **client_tls(pki)) as c:
        assert c.cached_prefix(plain.tokens) == 0
    wait_until(lambda: "does not use TLS" in plain.log(), "the refusal logged")


def test_client_certificates_are_required_when_configured(
    nodes: tuple[PeerProcess, ...], pki: PKI
) -> None:
    mutual = nodes[1]
    with node([mutual.address], **client_tls(pki, pki.client)) as c:
        assert c.cached_prefix(mutual.tokens) == len(mutual.tokens)
        np.testing.assert_array_equal(load_all(c, mutual.tokens), mutual.data)
    for identity in (None, pki.stranger):
        with node([mutual.address], **client_tls(pki, identity)) as c:
            assert c.cached_prefix(mutual.tokens) == 0
    wait_until(lambda: "TLS handshake failed" in mutual.log(), "the refusal logged")


def test_a_certificate_for_another_host_is_refused(spawn_peer: Spawn, pki: PKI) -> None:
    # Signed by the CA, but it names no host: only a client without hostname checks accepts it.
    unnamed = spawn_peer(
        "U",
        seed=24,
        **server_tls(pki, tls_cert_file=str(pki.client.cert), tls_key_file=str(pki.client.key)),
    )
    with node([unnamed.address], **client_tls(pki)) as c:
        assert c.cached_prefix(unnamed.tokens) == 0
    with node([unnamed.address], **client_tls(pki), tls_check_hostname=False) as c:
        assert c.cached_prefix(unnamed.tokens) == len(unnamed.tokens)


def tier_config(**entry: Any) -> dict[str, Any]:
    return {"secondary_tiers": [{"type": "p2p", "secret": "x" * 16, **entry}]}


def test_tls_options_are_checked_at_startup(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls is off"):
        load_config(tier_config(tls_ca_file=str(pki.ca)))
    with pytest.raises(ConfigError, match="needs tls_cert_file"):
        load_config(tier_config(tls=True))
    with pytest.raises(ConfigError, match=r"tls_cert_file"):
        load_config(tier_config(tls=True, tls_cert_file=str(tmp_path / "missing.pem")))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load the TLS files"):
        load_config(tier_config(tls=True, tls_cert_file=str(garbage)))
    with pytest.raises(ConfigError, match="cannot load the TLS files"):
        # The key of another certificate.
        load_config(
            tier_config(
                tls=True, tls_cert_file=str(pki.node.cert), tls_key_file=str(pki.client.key)
            )
        )
    load_config(tier_config(**server_tls(pki)))
    load_config(tier_config(**client_tls(pki)))


def test_idle_tls_sessions_are_closed_and_clients_reconnect(pki: PKI) -> None:
    settings = TLSSettings(pki.node.cert, pki.node.key, pki.ca)
    with served(idle_timeout=0.2, tls=settings.server_context()) as node:
        client = peer_client(node, idle_timeout=3600.0, tls=settings.client_context())
        try:
            assert client.query([node.key, node.other]) == [True, False]
            wait_until(lambda: node.server.counters.idle_closed == 1, "the idle close")
            assert client.query([node.key]) == [True]  # over a new connection
            assert client.counters.connects == 2
            assert node.server.counters.refused == node.server.counters.timed_out == 0
        finally:
            client.close()


def test_an_encrypted_key_is_a_clear_error_not_a_prompt(pki: PKI, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.node.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"hunter2"),
        )
    )
    # OpenSSL would otherwise ask for the pass phrase on the terminal.
    for entry in (server_tls(pki), client_tls(pki, pki.client)):
        entry["tls_key_file"] = str(encrypted)
        with pytest.raises(ConfigError, match=r"encrypted\.key is encrypted; .*openssl pkey"):
            load_config(tier_config(**entry))


class _TricklingProxy:
    """Forwards to ``target``; the server's bytes go back one at a time, slowly."""

    def __init__(self, target: tuple[str, int], interval_s: float) -> None:
        self.target, self.interval_s = target, interval_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.stop = threading.Event()
        #: Cleared: the server's bytes go back at full speed.
        self.trickling = threading.Event()
        self.trickling.set()
        self.forwarded_back = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            while not self.stop.is_set():
                byte = server.recv(1)
                if not byte:
                    break
                client.sendall(byte)
                self.forwarded_back += 1
                if self.trickling.is_set():
                    self.stop.wait(self.interval_s)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_peer_trickling_its_tls_handshake_is_given_up_at_the_deadline(pki: PKI) -> None:
    settings = TLSSettings(pki.node.cert, pki.node.key, pki.ca)
    with served(tls=settings.server_context()) as node:
        # A handshake of ~1 KB at 20 bytes a second: each read is quick, the whole is not.
        proxy = _TricklingProxy(node.server.address, interval_s=0.05)
        client = peer_client(node, tls=settings.client_context(), connect_timeout=0.5)
        client.address = proxy.address
        try:
            with pytest.raises((TimeoutError, OSError)):
                client.query([node.key])
            assert client.counters.connects == 0
        finally:
            client.close()
            proxy.close()


def test_an_authenticated_peer_trickling_its_reply_is_given_up_at_the_deadline() -> None:
    """``request_timeout_s`` bounds the whole answer, not each read of it."""
    with served() as node:
        proxy = _TricklingProxy(node.server.address, interval_s=0.05)
        proxy.trickling.clear()
        # Each byte comes 0.05 s after the last: well inside a per-read timeout,
        # but the whole answer takes several times the request timeout.
        client = peer_client(node, request_timeout=0.3)
        client.address = proxy.address
        try:
            assert client.query([node.key]) == [True]  # authenticated, pooled
            proxy.trickling.set()
            with pytest.raises((TimeoutError, OSError)):
                client.query([node.key])
        finally:
            client.close()
            proxy.close()
