"""Test certificates for TLS between peers: a CA, a node certificate, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Identity:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    ca: Path
    #: Names 127.0.0.1 and localhost; signed by ``ca``.
    node: Identity
    #: A client certificate signed by ``ca``.
    client: Identity
    #: A self-signed client certificate that ``ca`` does not vouch for.
    stranger: Identity


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    directory: Path,
    name: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    hosts: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Identity]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(issuer[0].subject if issuer else _name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key, Identity(cert_path, key_path)


def make_pki(directory: Path) -> PKI:
    ca_cert, ca_key, ca = _issue(directory, "ca", None, ca=True)
    _, _, node = _issue(directory, "node", (ca_cert, ca_key), hosts=True)
    _, _, client = _issue(directory, "client", (ca_cert, ca_key))
    _, _, stranger = _issue(directory, "stranger", None)
    return PKI(ca.cert, node, client, stranger)
