"""One remote peer, seen from a node that fetches: a pool of authenticated connections.

Every method blocks and is meant for the tier's worker threads. Connecting
(TCP, TLS when configured, the challenge-response) must finish within
``connect_timeout``, all of it. Pooled connections are reused; one unused
for half of ``idle_timeout`` is closed before the peer's service would close
it, and a request that meets a pooled connection the peer closed anyway is
repeated on a fresh one, so callers never see an idle close. A peer that
fails otherwise (refused, timed out, cut mid-transfer, failed the
handshake) is skipped for ``retry_after`` seconds, so a dead peer costs one
timeout, not one per lookup.
"""

from __future__ import annotations

import functools
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.errors import CorruptChunkError, PeerAuthError, PeerProtocolError
from kvtier.integrity import HEADER_BYTES, unpack_header
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.counters import ClientCounters
from kvtier.tiers.p2p.protocol import MessageType

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Handshakes tried per new connection when one is cut short (see ``_connect``).
CONNECT_ATTEMPTS = 3


class _HandshakeCut(PeerAuthError):
    """The peer closed the connection before WELCOME: a wrong secret, no room, or its deadline."""


class PeerClient:
    """Connections to one peer, opened on demand and reused."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        secret: bytes,
        namespace: bytes,
        slot_bytes: int,
        connect_timeout: float,
        request_timeout: float,
        retry_after: float,
        max_message_bytes: int,
        idle_timeout: float = 60.0,
        tls: ssl.SSLContext | None = None,
        counters: ClientCounters | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.name = protocol.format_address(*address)
        self._secret = secret
        self._namespace = namespace
        self._slot_bytes = slot_bytes
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._retry_after = retry_after
        self._query_keys = protocol.max_query_keys(max_message_bytes)
        # Unused this long, a pooled connection is closed before the peer closes it.
        self._max_idle = idle_timeout / 2
        self._tls = tls
        self.counters = counters or ClientCounters()
        self._clock = clock
        self._lock = threading.Lock()
        # (connection, when it was last returned to the pool), most recent last
        self._idle: list[tuple[socket.socket, float]] = []
        self._down_until = 0.0
        self._closed = False

    def available(self) -> bool:
        """False while the peer sits out its ``retry_after`` after a failure."""
        return not self._closed and self._clock() >= self._down_until

    def query(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the peer holds ready in its primary tier."""
        found: list[bool] = []
        for start in range(0, len(keys), self._query_keys):
            batch = list(keys[start : start + self._query_keys])
            found += self._request(functools.partial(self._query, keys=batch))
        return found

    def fetch_into(self, key: bytes, out: memoryview) -> bool:
        """Stream the chunk ``key`` into ``out`` and verify it.

        Returns ``False`` if the peer no longer holds it. Raises
        :class:`CorruptChunkError` when the bytes fail verification (``out``
        then holds garbage and must not be used), ``OSError`` when the
        connection fails.
        """
        return self._request(functools.partial(self._fetch, key=key, out=out))

    def probe(self) -> None:
        """Connect and authenticate once; raises what a request would meet."""
        try:
            self._connect().close()
        except (OSError, PeerProtocolError) as exc:
            self._mark_down(exc)
            raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    # Requests ----------------------------------------------------------------

    def _send(self, sock: socket.socket, kind: MessageType, body: bytes) -> float:
        """Send a request; returns the instant its whole reply must have arrived by.

        One deadline for the reply, not one per read: a peer that trickles its
        answer a byte at a time would otherwise hold a worker indefinitely.
        """
        sock.settimeout(self._request_timeout)
        protocol.send_message(sock, kind, body)
        return time.monotonic() + self._request_timeout

    def _query(self, sock: socket.socket, *, keys: list[bytes]) -> list[bool]:
        deadline = self._send(sock, MessageType.QUERY, protocol.encode_keys(keys))
        frame = protocol.read_frame(sock, {MessageType.HOLDS: (len(keys), len(keys))}, deadline)
        holds = protocol.recv_exact(sock, frame.length, deadline)
        return protocol.decode_holds(holds, len(keys))

    def _fetch(self, sock: socket.socket, *, key: bytes, out: memoryview) -> bool:
        deadline = self._send(sock, MessageType.FETCH, key)
        length = protocol.chunk_length(len(out))
        frame = protocol.read_frame(
            sock, {MessageType.CHUNK: (length, length), MessageType.MISSING: (0, 0)}, deadline
        )
        if frame.kind is MessageType.MISSING:
            return False
        header = unpack_header(
            protocol.recv_exact(sock, HEADER_BYTES, deadline),
            namespace=self._namespace,
            key=key,
            payload_bytes=len(out),
        )
        # Straight into the reserved slot; verified before anyone may read it.
        protocol.recv_into_exact(sock, out, deadline)
        header.verify(out)
        return True

    def _request(self, operation: Callable[[socket.socket], T]) -> T:
        try:
            while True:
                sock, pooled = self._checkout()
                try:
                    result = operation(sock)
                except BaseException as exc:
                    # The stream's position is unknown after any failure: never reuse it.
                    sock.close()
                    if pooled and _closed_by_peer(exc):
                        self.counters.add(reconnects=1)
                        continue  # requests are idempotent: repeat on the next connection
                    raise
                self._checkin(sock)
                return result
        except CorruptChunkError:
            raise  # the peer answered; its bytes were bad
        except (OSError, PeerProtocolError) as exc:
            self._mark_down(exc)
            raise

    def _checkout(self) -> tuple[socket.socket, bool]:
        """A pooled connection still open (``True``), else a new one (``False``)."""
        while True:
            with self._lock:
                stale = self._expire_idle()
                taken = self._idle.pop()[0] if self._idle else None
            for sock in stale:
                sock.close()
            if taken is None:
                return self._connect(), False
            # An idle connection that reads as ready was closed by the peer.
            readable, _, _ = select.select([taken], [], [], 0)
            if not readable:
                return taken, True
            taken.close()

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            keep = not self._closed
            if keep:
                self._idle.append((sock, self._clock()))
            stale = self._expire_idle()
        for old in stale if keep else [*stale, sock]:
            old.close()

    def _expire_idle(self) -> list[socket.socket]:
        """Under the lock: take out pooled connections unused for too long."""
        limit = self._clock() - self._max_idle
        fresh = [(sock, since) for sock, since in self._idle if since > limit]
        stale = [sock for sock, since in self._idle if since <= limit]
        self._idle = fresh
        if stale:
            self.counters.add(idle_closed=len(stale))
        return stale

    def _connect(self) -> socket.socket:
        """A new authenticated connection; a handshake cut short is tried again.

        On a loaded machine a handshake can miss its deadline on either side;
        that is worth another try, up to :data:`CONNECT_ATTEMPTS` in all. A
        refusal that says something definite (nothing listens, another
        layout, a TLS or proof failure) is not.
        """
        attempt = 1
        while True:
            try:
                return self._connect_once()
            except (OSError, PeerProtocolError) as exc:
                if attempt == CONNECT_ATTEMPTS or not _cut_short(exc):
                    raise
                attempt += 1
                logger.debug("p2p: handshake with %s cut short (%r); trying again", self.name, exc)

    def _connect_once(self) -> socket.socket:
        deadline = time.monotonic() + self._connect_timeout
        sock = socket.create_connection(self.address, timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock.settimeout(protocol.time_left(deadline))
                sock = self._tls.wrap_socket(sock, server_hostname=self.address[0])
            self._authenticate(sock, deadline)
            sock.settimeout(self._request_timeout)
        except BaseException:
            sock.close()
            raise
        self.counters.add(connects=1)
        if self._down_until:
            logger.info("p2p: peer %s is reachable again", self.name)
            self._down_until = 0.0
        return sock

    def _authenticate(self, sock: socket.socket, deadline: float) -> None:
        frame = protocol.read_frame(
            sock, {MessageType.HELLO: (protocol.HELLO_BYTES, protocol.HELLO_BYTES)}, deadline
        )
        hello_body = protocol.recv_exact(sock, frame.length, deadline)
        hello = protocol.Hello.decode(hello_body)
        if hello.namespace != self._namespace or hello.slot_bytes != self._slot_bytes:
            raise PeerProtocolError(
                f"peer serves another layout ({hello.slot_bytes}-byte chunks, namespace "
                f"{hello.namespace.hex()[:16]}); it can share no chunk with this node"
            )
        nonce = protocol.new_nonce()
        protocol.send_message(
            sock, MessageType.AUTH, protocol.client_proof(self._secret, hello_body, nonce)
        )
        try:
            frame = protocol.read_frame(
                sock, {MessageType.WELCOME: (protocol.MAC_BYTES, protocol.MAC_BYTES)}, deadline
            )
            welcome = protocol.recv_exact(sock, frame.length, deadline)
        except ConnectionError as exc:
            if isinstance(exc, PeerProtocolError):
                raise
            raise _HandshakeCut(
                "peer closed the connection during authentication (do the secrets differ, "
                "is the peer at its connection limit, or too loaded to answer in time?)"
            ) from None
        protocol.check_server_proof(self._secret, hello_body, nonce, welcome)

    def _mark_down(self, exc: BaseException) -> None:
        was_up = self._clock() >= self._down_until
        self._down_until = self._clock() + self._retry_after
        log = logger.warning if was_up else logger.debug
        log("p2p: peer %s failed (%s); skipping it for %.1fs", self.name, exc, self._retry_after)


def _closed_by_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says the peer had closed the connection (not that it misbehaved)."""
    if isinstance(exc, PeerProtocolError):
        return False
    return isinstance(exc, (ConnectionError, ssl.SSLEOFError))


def _cut_short(exc: BaseException) -> bool:
    """Whether a failed handshake may just have been too slow (worth another try)."""
    if isinstance(exc, (_HandshakeCut, TimeoutError, ssl.SSLEOFError)):
        return True
    return isinstance(exc, ConnectionError) and not isinstance(
        exc, (PeerProtocolError, ConnectionRefusedError)
    )
