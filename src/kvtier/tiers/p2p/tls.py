"""TLS for peer connections, from the standard library's :mod:`ssl`.

TLS encrypts and authenticates the channel; the shared-secret handshake of
:mod:`~kvtier.tiers.p2p.protocol` still runs inside it, so a peer needs both a
certificate the other side trusts and the secret. The peer service presents
``cert_file``; clients verify it against ``ca_file`` (the system's trusted
CAs when unset) and, unless ``check_hostname`` is off, check that it names
the host they dialled. With ``require_client_cert`` the service asks clients
for a certificate of their own, verified against the same ``ca_file``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSSettings:
    """Where a node's certificate, key and trusted CAs are, and what it checks."""

    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    require_client_cert: bool = False
    check_hostname: bool = True

    def server_context(self) -> ssl.SSLContext:
        """The peer service's context: presents ``cert_file``; may require client certificates."""
        if self.cert_file is None:
            raise ValueError("the peer service needs a certificate: set tls_cert_file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_own_certificate(context, self.cert_file)
        if self.require_client_cert:
            if self.ca_file is None:
                raise ValueError("requiring client certificates needs tls_ca_file")
            context.load_verify_locations(cafile=self.ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        # No session tickets: nothing is resumed, and a TLS 1.3 server would
        # otherwise send them after the handshake, making idle connections
        # look readable to the client's staleness check.
        context.num_tickets = 0
        return context

    def client_context(self) -> ssl.SSLContext:
        """The context of connections to peers: verifies them, presents ``cert_file`` if set."""
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(self.ca_file) if self.ca_file else None
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = self.check_hostname
        if self.cert_file is not None:
            self._load_own_certificate(context, self.cert_file)
        return context

    def _load_own_certificate(self, context: ssl.SSLContext, cert_file: Path) -> None:
        key_file = self.key_file or cert_file

        def refuse_password() -> str:
            # Without this, OpenSSL would prompt on the terminal and block the node.
            raise ValueError(
                f"the private key in {key_file} is encrypted; kvtier reads unencrypted keys "
                f"only: write one with `openssl pkey -in {key_file} -out KEY` and give it "
                "as tls_key_file (readable by this node's user only)"
            )

        context.load_cert_chain(cert_file, self.key_file, password=refuse_password)
