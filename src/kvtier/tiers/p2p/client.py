"""One remote peer, seen from a node that fetches: a pool of authenticated connections.

Every method blocks and is meant for the tier's worker threads. A peer that
fails a connection (refused, timed out, cut mid-transfer, failed the
handshake) is skipped for ``retry_after`` seconds, so a dead peer costs one
timeout, not one per lookup.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvtier.errors import CorruptChunkError, PeerAuthError, PeerProtocolError
from kvtier.integrity import HEADER_BYTES, unpack_header
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.protocol import MessageType

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
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
        for sock in idle:
            sock.close()

    # Requests ----------------------------------------------------------------

    def _query(self, sock: socket.socket, *, keys: list[bytes]) -> list[bool]:
        protocol.send_message(sock, MessageType.QUERY, protocol.encode_keys(keys))
        frame = protocol.read_frame(sock, {MessageType.HOLDS: (len(keys), len(keys))})
        return protocol.decode_holds(protocol.recv_exact(sock, frame.length), len(keys))

    def _fetch(self, sock: socket.socket, *, key: bytes, out: memoryview) -> bool:
        protocol.send_message(sock, MessageType.FETCH, key)
        length = protocol.chunk_length(len(out))
        frame = protocol.read_frame(
            sock, {MessageType.CHUNK: (length, length), MessageType.MISSING: (0, 0)}
        )
        if frame.kind is MessageType.MISSING:
            return False
        header = unpack_header(
            protocol.recv_exact(sock, HEADER_BYTES),
            namespace=self._namespace,
            key=key,
            payload_bytes=len(out),
        )
        # Straight into the reserved slot; verified before anyone may read it.
        protocol.recv_into_exact(sock, out)
        header.verify(out)
        return True

    def _request(self, operation: Callable[[socket.socket], T]) -> T:
        try:
            with self._connection() as sock:
                return operation(sock)
        except CorruptChunkError:
            raise  # the peer answered; its bytes were bad
        except (OSError, PeerProtocolError) as exc:
            self._mark_down(exc)
            raise

    @contextlib.contextmanager
    def _connection(self) -> Iterator[socket.socket]:
        sock = self._take_idle() or self._connect()
        try:
            yield sock
        except BaseException:
            # The stream's position is unknown after any failure: never reuse it.
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
            else:
                self._idle.append(sock)

    def _take_idle(self) -> socket.socket | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                sock = self._idle.pop()
            # An idle connection that reads as ready was closed by the peer.
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return sock
            sock.close()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frame = protocol.read_frame(
                sock, {MessageType.HELLO: (protocol.HELLO_BYTES, protocol.HELLO_BYTES)}
            )
            hello_body = protocol.recv_exact(sock, frame.length)
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
                    sock, {MessageType.WELCOME: (protocol.MAC_BYTES, protocol.MAC_BYTES)}
                )
                welcome = protocol.recv_exact(sock, frame.length)
            except ConnectionError:
                raise PeerAuthError(
                    "peer closed the connection during authentication (do the secrets differ?)"
                ) from None
            protocol.check_server_proof(self._secret, hello_body, nonce, welcome)
            sock.settimeout(self._request_timeout)
        except BaseException:
            sock.close()
            raise
        if self._down_until:
            logger.info("p2p: peer %s is reachable again", self.name)
            self._down_until = 0.0
        return sock

    def _mark_down(self, exc: BaseException) -> None:
        was_up = self._clock() >= self._down_until
        self._down_until = self._clock() + self._retry_after
        log = logger.warning if was_up else logger.debug
        log("p2p: peer %s failed (%s); skipping it for %.1fs", self.name, exc, self._retry_after)
