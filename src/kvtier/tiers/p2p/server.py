"""The peer service: answers other nodes' queries and streams chunks from the primary tier.

One thread per connection (bounded by ``max_connections``). A connection must
authenticate within the handshake timeout; after that it may send QUERY and
FETCH requests. A chunk is pinned in the primary tier while its bytes go out,
so eviction can never reuse the slot under a send, and every chunk is framed
with the integrity header, so the receiver can verify it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import PeerAuthError, PeerProtocolError
from kvtier.integrity import pack_header
from kvtier.keys import ChunkKey
from kvtier.layout import KEY_BYTES
from kvtier.primary import PrimaryTier
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.flow import ByteBudget, SendPacer
from kvtier.tiers.p2p.protocol import MessageType

logger = logging.getLogger(__name__)

#: Bytes handed to one ``sendall`` when the send rate is capped.
_PACE_PIECE = 256 * 1024


@dataclass
class ServerCounters:
    """What the peer service did, for ``describe`` and logs."""

    connections: int = 0
    refused: int = 0
    dropped: int = 0
    queries: int = 0
    chunks_served: int = 0
    bytes_served: int = 0
    misses_served: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {
                name: getattr(self, name)
                for name in (
                    "connections",
                    "refused",
                    "dropped",
                    "queries",
                    "chunks_served",
                    "bytes_served",
                    "misses_served",
                )
            }


class _Listener(socketserver.ThreadingTCPServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins every connection thread
    allow_reuse_address = True
    request_queue_size = 128  # many peers may connect at once after a restart

    def __init__(self, address: tuple[str, int], owner: PeerServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.owner = owner
        super().__init__(address, _Handler)

    def verify_request(self, request: socket.socket, client_address: object) -> bool:  # type: ignore[override]
        return self.owner.admit(client_address)


class _Handler(socketserver.BaseRequestHandler):
    server: _Listener

    def handle(self) -> None:
        self.server.owner.serve_connection(self.request, self.client_address)


class PeerServer:
    """Serves one node's primary tier to authenticated peers."""

    def __init__(
        self,
        *,
        address: tuple[str, int],
        slot_view: Callable[[int], memoryview],
        slot_bytes: int,
        namespace: bytes,
        secret: bytes,
        handshake_timeout: float,
        request_timeout: float,
        max_message_bytes: int,
        max_inflight_bytes: int,
        max_connections: int,
        max_send_rate: float | None = None,
    ) -> None:
        self._primary: PrimaryTier | None = None
        self._slot_view = slot_view
        self._namespace = namespace
        self._slot_bytes = slot_bytes
        self._secret = secret
        self._handshake_timeout = handshake_timeout
        self._request_timeout = request_timeout
        self._max_connections = max_connections
        self._budget = ByteBudget(max_inflight_bytes)
        self._pacer = SendPacer(max_send_rate) if max_send_rate else None
        self._requests = {
            MessageType.QUERY: (KEY_BYTES, max_message_bytes),
            MessageType.FETCH: (KEY_BYTES, KEY_BYTES),
        }
        self.counters = ServerCounters()
        self._lock = threading.Lock()
        self._active: set[socket.socket] = set()
        self._admitted = 0
        self._closing = False
        try:
            self._listener = _Listener(address, self)
        except OSError as exc:
            where = protocol.format_address(*address)
            raise OSError(exc.errno, f"p2p: cannot listen on {where}: {exc.strerror}") from exc
        self._thread = threading.Thread(
            target=self._listener.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="kvtier-p2p-accept",
            daemon=True,
        )

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``: the real port when configured with port 0."""
        host, port = self._listener.server_address[:2]
        return str(host), int(port)

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet ended."""
        return self._admitted

    def start(self, primary: PrimaryTier) -> None:
        """Serve ``primary``'s ready chunks; connections made before wait in the backlog."""
        if primary.buffer.slot_bytes != self._slot_bytes:
            raise ValueError(
                f"p2p: primary slots of {primary.buffer.slot_bytes} bytes, "
                f"the peer service was built for {self._slot_bytes}"
            )
        self._primary = primary
        self._thread.start()

    @property
    def serving(self) -> bool:
        """Whether :meth:`start` ran: the service answers requests."""
        return self._primary is not None

    def close(self) -> None:
        """Stop accepting, cut every connection, and wait for their threads to end.

        When this returns no thread of the service touches the primary tier.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            active = list(self._active)
        if self.serving:
            # Waits for serve_forever to return: it would wait forever if never started.
            self._listener.shutdown()
        for sock in active:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._listener.server_close()
        if self.serving:
            self._thread.join()

    # Connections -----------------------------------------------------------

    def admit(self, client_address: object) -> bool:
        """Called on the accept thread: refuse connections beyond the cap."""
        with self._lock:
            if self._closing or self._admitted >= self._max_connections:
                logger.warning(
                    "peer service: refused connection from %s: %d connections already open",
                    _peer_name(client_address),
                    self._admitted,
                )
                self.counters.add(refused=1)
                return False
            self._admitted += 1
            return True

    def serve_connection(self, sock: socket.socket, client_address: object) -> None:
        peer = _peer_name(client_address)
        with self._lock:
            self._active.add(sock)
            closing = self._closing
        authenticated = False
        primary = self._primary
        try:
            if closing or primary is None:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._handshake_timeout)
            self._handshake(sock)
            authenticated = True
            self.counters.add(connections=1)
            logger.debug("peer service: %s authenticated", peer)
            while self._serve_request(sock, primary):
                pass
        except PeerAuthError as exc:
            logger.warning("peer service: refused %s: %s", peer, exc)
            self.counters.add(refused=1)
        except PeerProtocolError as exc:
            if authenticated:
                logger.warning("peer service: dropped connection from %s: %s", peer, exc)
                self.counters.add(dropped=1)
            else:
                logger.warning("peer service: refused %s: %s", peer, exc)
                self.counters.add(refused=1)
        except TimeoutError:
            if authenticated:
                logger.warning(
                    "peer service: dropped connection from %s: stalled for over %.1fs",
                    peer,
                    self._request_timeout,
                )
                self.counters.add(dropped=1)
            else:
                logger.warning(
                    "peer service: refused %s: no authentication within %.1fs",
                    peer,
                    self._handshake_timeout,
                )
                self.counters.add(refused=1)
        except OSError as exc:  # the peer went away, or close() cut the connection
            if not authenticated:
                logger.warning("peer service: refused %s: closed before authenticating", peer)
                self.counters.add(refused=1)
            else:
                logger.debug("peer service: %s disconnected: %r", peer, exc)
        finally:
            with self._lock:
                self._active.discard(sock)
                self._admitted -= 1

    def _handshake(self, sock: socket.socket) -> None:
        hello = protocol.Hello(protocol.new_nonce(), self._namespace, self._slot_bytes).encode()
        protocol.send_message(sock, MessageType.HELLO, hello)
        frame = protocol.read_frame(
            sock, {MessageType.AUTH: (protocol.AUTH_BYTES, protocol.AUTH_BYTES)}
        )
        try:
            body = protocol.recv_exact(sock, frame.length)
        except ConnectionError as exc:
            raise PeerProtocolError(f"AUTH message cut short: {exc}") from None
        welcome = protocol.check_client_proof(self._secret, hello, body)
        protocol.send_message(sock, MessageType.WELCOME, welcome)

    def _serve_request(self, sock: socket.socket, primary: PrimaryTier) -> bool:
        """Answer one request; ``False`` when the peer closed the connection."""
        # An authenticated connection may idle between requests, but once a
        # message starts, all of it must arrive within the request timeout.
        sock.settimeout(None)
        first = sock.recv(1)
        if not first:
            return False
        sock.settimeout(self._request_timeout)
        try:
            header = first + protocol.recv_exact(sock, protocol.FRAME_BYTES - 1)
        except ConnectionError as exc:
            raise PeerProtocolError(f"frame header cut short: {exc}") from None
        frame = protocol.decode_frame(header, self._requests)
        try:
            body = protocol.recv_exact(sock, frame.length)
        except ConnectionError as exc:
            raise PeerProtocolError(f"{frame.kind.name} message cut short: {exc}") from None
        if frame.kind is MessageType.QUERY:
            keys = protocol.decode_keys(body)
            found = [primary.is_ready(ChunkKey(key)) for key in keys]
            self.counters.add(queries=1)
            protocol.send_message(sock, MessageType.HOLDS, protocol.encode_holds(found))
        else:
            self._send_chunk(sock, primary, ChunkKey(body))
        return True

    def _send_chunk(self, sock: socket.socket, primary: PrimaryTier, key: ChunkKey) -> None:
        length = protocol.chunk_length(self._slot_bytes)
        with self._budget.hold(length):
            try:
                slot = primary.prepare_load([key])[0]
            except KeyError:
                self.counters.add(misses_served=1)
                protocol.send_message(sock, MessageType.MISSING)
                return
            try:
                payload = self._slot_view(slot)
                header = pack_header(self._namespace, key, payload)
                sock.sendall(protocol.encode_frame(MessageType.CHUNK, length) + header)
                self._send_payload(sock, payload)
            finally:
                primary.complete_load([key])
        self.counters.add(chunks_served=1, bytes_served=length)

    def _send_payload(self, sock: socket.socket, payload: memoryview) -> None:
        if self._pacer is None:
            sock.sendall(payload)
            return
        for start in range(0, len(payload), _PACE_PIECE):
            piece = payload[start : start + _PACE_PIECE]
            self._pacer.wait(len(piece))
            sock.sendall(piece)


def _peer_name(client_address: object) -> str:
    if isinstance(client_address, tuple) and len(client_address) >= 2:
        return protocol.format_address(str(client_address[0]), int(client_address[1]))
    return str(client_address)
