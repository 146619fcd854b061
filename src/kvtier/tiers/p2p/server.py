"""The peer service: answers other nodes' queries and streams chunks from the
primary tier, each pinned while its bytes go out. Handshakes and sessions
are admitted in two stages with budgets of their own.

See docs/p2p.md, 'Limits and timeouts'.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from kvtier.errors import PeerProtocolError
from kvtier.integrity import pack_header
from kvtier.keys import ChunkKey
from kvtier.layout import KEY_BYTES
from kvtier.primary import PrimaryTier
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.admission import HandshakeBudget, SessionBudget
from kvtier.tiers.p2p.counters import ServerCounters
from kvtier.tiers.p2p.flow import ByteBudget, SendPacer
from kvtier.tiers.p2p.gate import HandshakeGate, ThrottledLog
from kvtier.tiers.p2p.protocol import MessageType

logger = logging.getLogger(__name__)

#: Bytes handed to one ``sendall`` when the send rate is capped.
_PACE_PIECE = 256 * 1024
#: Connections the kernel queues while the gate is busy (many peers reconnect after a restart).
_BACKLOG = 512


class _Session:
    """An authenticated connection; hashed by identity."""

    def __init__(self, sock: socket.socket, name: str, welcome: bytes) -> None:
        self.sock = sock
        self.name = name
        self.welcome = welcome
        self.displaced = False


def _cut(sock: socket.socket) -> None:
    """Wake a thread blocked on ``sock`` with end-of-stream.

    ``socket.shutdown`` of the plain socket: ``SSLSocket.shutdown`` would
    also drop the TLS state under the thread still reading through it.
    """
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


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
        idle_timeout: float = 60.0,
        max_handshakes: int = 256,
        max_handshakes_per_source: int = 128,
        max_send_rate: float | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._primary: PrimaryTier | None = None
        self._slot_view = slot_view
        self._namespace = namespace
        self._slot_bytes = slot_bytes
        self._request_timeout = request_timeout
        self._idle_timeout = idle_timeout
        self._budget = ByteBudget(max_inflight_bytes)
        self._pacer = SendPacer(max_send_rate) if max_send_rate else None
        self._requests = {
            MessageType.QUERY: (KEY_BYTES, max_message_bytes),
            MessageType.FETCH: (KEY_BYTES, KEY_BYTES),
        }
        self.counters = ServerCounters()
        self._warnings = ThrottledLog()
        self._lock = threading.Lock()
        self._sessions: SessionBudget[_Session] = SessionBudget(max_connections)
        self._threads: dict[_Session, threading.Thread] = {}
        self._closing = False
        host = address[0]
        try:
            listener = socket.create_server(
                address,
                family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                backlog=_BACKLOG,
            )
        except OSError as exc:
            where = protocol.format_address(*address)
            raise OSError(exc.errno, f"p2p: cannot listen on {where}: {exc.strerror}") from exc
        self._address = listener.getsockname()[:2]
        self._gate = HandshakeGate(
            listener,
            secret=secret,
            hello=lambda: protocol.Hello(protocol.new_nonce(), namespace, slot_bytes).encode(),
            timeout=handshake_timeout,
            budget=HandshakeBudget(max_handshakes, max_handshakes_per_source),
            on_authenticated=self._admit,
            counters=self.counters,
            warnings=self._warnings,
            tls=tls,
        )
        self._gate_thread = threading.Thread(
            target=self._gate.run, name="kvtier-p2p-gate", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``: the real port when configured with port 0."""
        return str(self._address[0]), int(self._address[1])

    @property
    def open_connections(self) -> int:
        """Authenticated connections (sessions) open now."""
        return len(self._sessions)

    @property
    def idle_connections(self) -> int:
        """Authenticated connections waiting for their peer's next request."""
        with self._lock:
            return self._sessions.idle_count

    @property
    def open_handshakes(self) -> int:
        """Connections accepted and not authenticated yet."""
        return len(self._gate.budget)

    def start(self, primary: PrimaryTier) -> None:
        """Serve ``primary``'s ready chunks; connections made before wait in the backlog."""
        if primary.buffer.slot_bytes != self._slot_bytes:
            raise ValueError(
                f"p2p: primary slots of {primary.buffer.slot_bytes} bytes, "
                f"the peer service was built for {self._slot_bytes}"
            )
        self._primary = primary
        self._gate_thread.start()

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
        self._gate.close()
        if self.serving:
            self._gate_thread.join()  # it closes the listener and every handshake
        else:
            self._gate.run()  # returns at once, closing the listener and the gate's sockets
        with self._lock:
            sessions = dict(self._threads)
        for session, thread in sessions.items():
            _cut(session.sock)
            thread.join()

    # Sessions ----------------------------------------------------------------

    def _admit(self, sock: socket.socket, name: str, welcome: bytes) -> bool:
        """On the gate's thread: give an authenticated connection a session, or refuse it."""
        session = _Session(sock, name, welcome)
        with self._lock:
            if self._closing:
                return False
            admitted, displaced = self._sessions.add(session)
            if not admitted:
                self.counters.add(refused=1)
                self._warnings.warning(
                    "sessions full",
                    "peer service: refused %s: all %d authenticated connections are busy",
                    name,
                    self._sessions.limit,
                )
                return False
            if displaced is not None:
                displaced.displaced = True
                _cut(displaced.sock)
                self.counters.add(idle_closed=1)
                logger.debug("peer service: %s closed idle for %s", displaced.name, name)
            thread = threading.Thread(
                target=self._serve_session, args=(session,), name="kvtier-p2p-session", daemon=True
            )
            self._threads[session] = thread
        try:
            thread.start()
        except RuntimeError as exc:  # out of threads: refuse this one, keep serving the rest
            with self._lock:
                self._sessions.remove(session)
                del self._threads[session]
            self.counters.add(refused=1)
            self._warnings.warning("no thread", "peer service: refused %s: %s", name, exc)
            return False
        return True

    def _serve_session(self, session: _Session) -> None:
        sock, peer = session.sock, session.name
        primary = self._primary
        try:
            if primary is None:
                return
            sock.settimeout(self._request_timeout)
            self.counters.add(connections=1)  # before the peer can see it
            protocol.send_message(sock, MessageType.WELCOME, session.welcome)
            logger.debug("peer service: %s authenticated", peer)
            while self._serve_request(session, primary):
                pass
        except PeerProtocolError as exc:
            logger.warning("peer service: dropped connection from %s: %s", peer, exc)
            self.counters.add(dropped=1)
        except TimeoutError:
            logger.warning(
                "peer service: dropped connection from %s: a request stalled for over %.1fs",
                peer,
                self._request_timeout,
            )
            self.counters.add(timed_out=1)
        except OSError as exc:  # the peer went away, or close() or a newcomer cut it
            logger.debug("peer service: %s disconnected: %r", peer, exc)
        finally:
            sock.close()
            with self._lock:
                self._sessions.remove(session)
                self._threads.pop(session, None)

    def _serve_request(self, session: _Session, primary: PrimaryTier) -> bool:
        """Answer one request; ``False`` when the session ends quietly."""
        sock = session.sock
        with self._lock:
            self._sessions.idle(session, time.monotonic())
        sock.settimeout(self._idle_timeout)
        try:
            first = sock.recv(1)
        except TimeoutError:
            self.counters.add(idle_closed=1)
            logger.debug("peer service: %s idle for %.0fs", session.name, self._idle_timeout)
            return False
        with self._lock:
            if not first or not self._sessions.busy(session):
                return False  # the peer closed it, or it gave way to a newcomer
        # Once a message starts, all of it must arrive within the request timeout.
        deadline = time.monotonic() + self._request_timeout
        try:
            header = first + protocol.recv_exact(sock, protocol.FRAME_BYTES - 1, deadline)
            frame = protocol.decode_frame(header, self._requests)
            body = protocol.recv_exact(sock, frame.length, deadline)
        except ConnectionError as exc:
            if isinstance(exc, PeerProtocolError):
                raise
            raise PeerProtocolError(f"request cut short: {exc}") from None
        sock.settimeout(self._request_timeout)
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
