"""The ``p2p`` tier's options: the peer service, the peers, their limits and TLS."""

from __future__ import annotations

import ssl

from pydantic import ByteSize, Field, FilePath, SecretStr, field_validator, model_validator

from kvtier.tiers.options import ThreadedTierOptions
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.tls import TLSSettings

_MIN_SECRET_CHARS = 16


class PeerTierOptions(ThreadedTierOptions):
    secret: SecretStr
    """Shared by every peer; each connection proves it knows it. Required.
    Generate one with ``python -c "import secrets; print(secrets.token_urlsafe(32))"``."""

    listen: str | None = "127.0.0.1:0"
    """``host:port`` of this node's peer service (port 0: any free port); ``null``
    serves nothing. A non-loopback address is allowed and logged."""

    peers: tuple[str, ...] = ()
    """``host:port`` of every peer to fetch from."""

    connect_timeout_s: float = Field(default=1.0, gt=0, le=300)
    """Seconds to connect to a peer: TCP, TLS and authentication, all together.
    A handshake that times out or is cut short is tried again, three times in all."""

    handshake_timeout_s: float = Field(default=1.0, gt=0, le=300)
    """Seconds an incoming connection has, from its accept, to finish TLS and
    authentication: the whole handshake, however its bytes are paced."""

    request_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds a peer has to deliver its whole answer to a request, however it
    paces the bytes (and the peer service's limit for receiving a whole
    request); a lookup gives all peers
    together 3 × connect (a handshake cut short is tried again, three times
    in all) + request timeout."""

    idle_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    """The peer service closes an authenticated connection idle this long;
    clients close pooled connections unused for half of it, and reconnect
    transparently when a peer closed one first."""

    index_fanout: int = Field(default=2, ge=1, le=1024)
    """With a cluster index (the top-level ``index`` section): peers one lookup
    batch asks, those the index names as holding most of its chunks. An index
    that is down or slow costs one bounded wait, then every peer is asked."""

    retry_after_s: float = Field(default=2.0, ge=0, le=3600)
    """After a peer fails, seconds before it is asked again."""

    max_inflight_bytes: ByteSize = Field(default=ByteSize(256 << 20), gt=0)
    """Chunk bytes in flight at once, per direction (fetching, and serving)."""

    max_message_bytes: ByteSize = Field(default=ByteSize(64 << 10), ge=1024, le=64 << 20)
    """Largest control message (a query) accepted or sent; chunks are bounded by the slot size."""

    max_connections: int = Field(default=256, ge=1, le=65536)
    """Authenticated connections the peer service keeps open at once, a thread
    each; when all are taken, the one idle longest gives way to a newcomer.
    The default serves 32 nodes that all fetch from each other with up to
    ``io_threads + 1`` connections per pair."""

    max_handshakes: int = Field(default=256, ge=1, le=65536)
    """Incoming connections still in their handshake, all sources together
    (no thread each); beyond it, the oldest of the source holding most is closed."""

    max_handshakes_per_source: int | None = Field(default=None, ge=1, le=65536)
    """Incoming connections in their handshake from one IP address; beyond
    it, that address's oldest is closed. At most ``max_handshakes``;
    ``null``: half of it (128 by default)."""

    max_send_rate: ByteSize | None = Field(default=None, gt=0)
    """Bytes per second the peer service sends, all connections together; ``null``: no cap."""

    tls: bool = False
    """Run every peer connection inside TLS (on top of the shared secret). All
    nodes of a fleet must agree: a TLS node refuses plaintext peers and the reverse."""

    tls_cert_file: FilePath | None = None
    """PEM certificate (chain) of this node, presented by its peer service and
    to peers that require client certificates. Needed with ``tls`` and ``listen``."""

    tls_key_file: FilePath | None = None
    """PEM private key of ``tls_cert_file``; ``null``: the key is in ``tls_cert_file``."""

    tls_ca_file: FilePath | None = None
    """PEM certificates that peers' certificates must chain to; ``null``: the
    system's trusted CAs. A self-signed certificate is its own CA."""

    tls_require_client_cert: bool = False
    """The peer service requires clients to present a certificate that chains
    to ``tls_ca_file``."""

    tls_check_hostname: bool = True
    """Peers' certificates must name the host of their ``peers`` address
    (an IP address needs an IP entry in the certificate's subjectAltName)."""

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value()) < _MIN_SECRET_CHARS:
            raise ValueError(
                f"the shared secret must be at least {_MIN_SECRET_CHARS} characters long"
            )
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str | None) -> str | None:
        if value is not None:
            protocol.parse_address(value, allow_port_zero=True)
        return value

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for peer in value:
            protocol.parse_address(peer)
        return value

    @model_validator(mode="after")
    def _check_limits_and_tls(self) -> PeerTierOptions:
        if self.handshakes_per_source > self.max_handshakes:
            raise ValueError(
                f"max_handshakes_per_source ({self.max_handshakes_per_source}) exceeds "
                f"max_handshakes ({self.max_handshakes})"
            )
        tls_options = [
            name
            for name in ("tls_cert_file", "tls_key_file", "tls_ca_file")
            if getattr(self, name) is not None
        ]
        if self.tls_require_client_cert:
            tls_options.append("tls_require_client_cert")
        if not self.tls:
            if tls_options:
                raise ValueError(f"{', '.join(tls_options)} set, but tls is off: set tls: true")
            return self
        if self.listen is not None and self.tls_cert_file is None:
            raise ValueError("tls with a listen address needs tls_cert_file (and its key)")
        settings = self._tls_files()
        try:
            settings.client_context()
            if self.listen is not None:
                settings.server_context()
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ValueError(f"cannot load the TLS files: {exc}") from None
        return self

    @property
    def handshakes_per_source(self) -> int:
        """``max_handshakes_per_source``, its default resolved."""
        if self.max_handshakes_per_source is not None:
            return self.max_handshakes_per_source
        return max(1, self.max_handshakes // 2)

    def tls_settings(self) -> TLSSettings | None:
        """The TLS part of these options; ``None`` without ``tls``."""
        return self._tls_files() if self.tls else None

    def _tls_files(self) -> TLSSettings:
        return TLSSettings(
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            ca_file=self.tls_ca_file,
            require_client_cert=self.tls_require_client_cert,
            check_hostname=self.tls_check_hostname,
        )
