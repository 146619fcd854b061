"""kvtier's peer protocol, version 1: framing, messages, the authenticating
handshake, and reads bounded by a deadline.

See docs/p2p.md, 'The protocol', for the frame layout and the messages.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import PeerAuthError, PeerProtocolError
from kvtier.integrity import HEADER_BYTES
from kvtier.layout import KEY_BYTES
from kvtier.tiers.addresses import parse_host_port

MAGIC = b"KP"
VERSION = 1
_FRAME = struct.Struct("<2sBBQ")
#: Length of a frame header in bytes.
FRAME_BYTES = _FRAME.size
NONCE_BYTES = 32
MAC_BYTES = 32
_HELLO = struct.Struct(f"<{NONCE_BYTES}s{KEY_BYTES}sQ")
_AUTH = struct.Struct(f"<{NONCE_BYTES}s{MAC_BYTES}s")


class MessageType(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    QUERY = 4
    HOLDS = 5
    FETCH = 6
    CHUNK = 7
    MISSING = 8


@dataclass(frozen=True)
class Frame:
    """A decoded frame header: what comes next and how long it is."""

    kind: MessageType
    length: int


def encode_frame(kind: MessageType, length: int) -> bytes:
    return _FRAME.pack(MAGIC, VERSION, kind, length)


def decode_frame(raw: bytes, allowed: dict[MessageType, tuple[int, int]]) -> Frame:
    """Parse a frame header; ``allowed`` maps each acceptable type to its
    ``(min, max)`` body length. Anything else is a :class:`PeerProtocolError`."""
    if len(raw) != FRAME_BYTES:
        raise PeerProtocolError(f"frame header is {len(raw)} bytes, expected {FRAME_BYTES}")
    magic, version, kind, length = _FRAME.unpack(raw)
    if magic != MAGIC:
        raise PeerProtocolError(f"not a kvtier peer frame (magic {magic!r})")
    if version != VERSION:
        raise PeerProtocolError(f"peer protocol version {version}, expected {VERSION}")
    try:
        message = MessageType(kind)
    except ValueError:
        raise PeerProtocolError(f"unknown message type {kind}") from None
    if message not in allowed:
        expected = ", ".join(m.name for m in allowed)
        raise PeerProtocolError(f"unexpected {message.name} message; expected {expected}")
    low, high = allowed[message]
    if not low <= length <= high:
        raise PeerProtocolError(
            f"{message.name} body of {length} bytes; allowed {low}..{high} bytes"
        )
    return Frame(message, length)


# Bodies ---------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    nonce: bytes
    namespace: bytes
    slot_bytes: int

    def encode(self) -> bytes:
        return _HELLO.pack(self.nonce, self.namespace, self.slot_bytes)

    @classmethod
    def decode(cls, body: bytes) -> Hello:
        if len(body) != _HELLO.size:
            raise PeerProtocolError(f"HELLO body is {len(body)} bytes, expected {_HELLO.size}")
        return cls(*_HELLO.unpack(body))


HELLO_BYTES = _HELLO.size
AUTH_BYTES = _AUTH.size


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """A QUERY body."""
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key)}")
    return b"".join(keys)


def decode_keys(body: bytes) -> list[bytes]:
    """Keys of a QUERY body; its length is a positive multiple of the key size."""
    if not body or len(body) % KEY_BYTES:
        raise PeerProtocolError(f"QUERY body of {len(body)} bytes is not whole keys")
    return [body[i : i + KEY_BYTES] for i in range(0, len(body), KEY_BYTES)]


def encode_holds(found: list[bool]) -> bytes:
    return bytes(found)


def decode_holds(body: bytes, count: int) -> list[bool]:
    """A HOLDS body answering a query of ``count`` keys: one 0 or 1 byte each."""
    if len(body) != count:
        raise PeerProtocolError(f"HOLDS body of {len(body)} bytes answers {count} keys")
    if body.strip(b"\x00\x01"):
        raise PeerProtocolError("HOLDS body holds bytes other than 0 and 1")
    return [byte == 1 for byte in body]


def chunk_length(slot_bytes: int) -> int:
    """Body length of a CHUNK carrying one ``slot_bytes`` chunk."""
    return HEADER_BYTES + slot_bytes


def max_query_keys(max_message_bytes: int) -> int:
    return max(1, max_message_bytes // KEY_BYTES)


# Authentication ---------------------------------------------------------------


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(secret: bytes, label: bytes, hello: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + hello + client_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, hello: bytes, client_nonce: bytes) -> bytes:
    """The AUTH body: the client's nonce and its MAC over the handshake."""
    return _AUTH.pack(client_nonce, _mac(secret, b"kvtier-p2p/1 client", hello, client_nonce))


def check_client_proof(secret: bytes, hello: bytes, body: bytes) -> bytes:
    """Verify an AUTH body; returns the server's WELCOME MAC. Raises :class:`PeerAuthError`."""
    if len(body) != _AUTH.size:
        raise PeerProtocolError(f"AUTH body is {len(body)} bytes, expected {_AUTH.size}")
    client_nonce, mac = _AUTH.unpack(body)
    expected = _mac(secret, b"kvtier-p2p/1 client", hello, client_nonce)
    if not hmac.compare_digest(mac, expected):
        raise PeerAuthError("wrong shared secret")
    return _mac(secret, b"kvtier-p2p/1 server", hello, client_nonce)


def check_server_proof(secret: bytes, hello: bytes, client_nonce: bytes, body: bytes) -> None:
    """Verify a WELCOME body. Raises :class:`PeerAuthError`."""
    expected = _mac(secret, b"kvtier-p2p/1 server", hello, client_nonce)
    if not hmac.compare_digest(body, expected):
        raise PeerAuthError("peer does not know the shared secret")


# Socket helpers -----------------------------------------------------------------


def recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """Read exactly ``size`` bytes, or raise ``ConnectionError`` at end of stream.

    With a ``deadline`` (a :func:`time.monotonic` instant) all of it must
    arrive by then, or ``TimeoutError``; without one, the socket's own
    timeout applies to each read.
    """
    buffer = bytearray(size)
    recv_into_exact(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def recv_into_exact(sock: socket.socket, out: memoryview, deadline: float | None = None) -> None:
    """Fill ``out`` from the socket, or raise ``ConnectionError`` at end of stream."""
    filled = 0
    while filled < len(out):
        if deadline is not None:
            sock.settimeout(time_left(deadline))
        got = sock.recv_into(out[filled:])
        if got == 0:
            raise ConnectionError(f"peer closed the connection after {filled}/{len(out)} bytes")
        filled += got


def time_left(deadline: float) -> float:
    """Seconds until ``deadline``; ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def read_frame(
    sock: socket.socket,
    allowed: dict[MessageType, tuple[int, int]],
    deadline: float | None = None,
) -> Frame:
    return decode_frame(recv_exact(sock, FRAME_BYTES, deadline), allowed)


def send_message(sock: socket.socket, kind: MessageType, body: bytes = b"") -> None:
    sock.sendall(encode_frame(kind, len(body)) + body)


# Addresses -------------------------------------------------------------------


def parse_address(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``host:port`` or ``[v6-address]:port`` as ``(host, port)``; ``ValueError`` if not."""
    return parse_host_port(text, allow_port_zero=allow_port_zero)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
