"""Clients that try to starve a peer service: silent connections and trickled handshakes.

Each runs on a thread of its own until stopped, keeping ``count`` connections
open from ``source`` (a loopback address other than the honest peer's, as an
attacker's machine would be) and reopening each one the node closes.
"""

from __future__ import annotations

import selectors
import socket
import threading
from typing import Self

from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.protocol import MessageType
from tests.tiers.p2p.p2p_nodes import SAFETY_S, SECRET, PeerProcess

_HELLO_MESSAGE = protocol.FRAME_BYTES + protocol.HELLO_BYTES


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = bytearray()
        self.to_send = b""


class Attacker:
    """Holds ``count`` connections to ``peer``; subclasses decide what they send."""

    #: Seconds between two rounds of sending (and of reopening what failed to open).
    tick = 0.05

    def __init__(self, peer: PeerProcess, count: int, source: str) -> None:
        self._address = (peer.host, peer.port)
        self._count = count
        self._source = source
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        #: Connections opened so far (reopened ones included), and closed by the node.
        self.opened = 0
        self.closed_by_node = 0

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(SAFETY_S)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while len(self._selector.get_map()) < self._count and self._open():
                    pass
                for key, _ in self._selector.select(self.tick):
                    self._receive(key.data)
                for key in list(self._selector.get_map().values()):
                    self._send(key.data)
        finally:
            for key in list(self._selector.get_map().values()):
                key.data.sock.close()
            self._selector.close()

    def _open(self) -> bool:
        try:
            sock = socket.create_connection(
                self._address, timeout=SAFETY_S, source_address=(self._source, 0)
            )
        except OSError:
            return False  # the backlog is full: try again next tick
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, _Connection(sock))
        self.opened += 1
        return True

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.closed_by_node += 1
            self._drop(conn)
            return
        conn.received += data
        self.on_received(conn)

    def _send(self, conn: _Connection) -> None:
        if not conn.to_send:
            return
        try:
            sent = conn.sock.send(conn.to_send[:1])
        except BlockingIOError:
            return
        except OSError:
            self.closed_by_node += 1
            self._drop(conn)
            return
        conn.to_send = conn.to_send[sent:]

    def _drop(self, conn: _Connection) -> None:
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def on_received(self, conn: _Connection) -> None:
        """Called with every reply byte; the default says nothing back."""


class Slowloris(Attacker):
    """Connections that never say a word."""


class Trickler(Attacker):
    """Connections that send a valid AUTH (they know the secret) one byte per tick."""

    tick = 0.2

    def __init__(self, peer: PeerProcess, count: int, source: str) -> None:
        super().__init__(peer, count, source)
        #: Trickled handshakes the node accepted (answered with more than HELLO).
        self.welcomed = 0

    def on_received(self, conn: _Connection) -> None:
        if len(conn.received) > _HELLO_MESSAGE:
            self.welcomed += 1
            self._drop(conn)
        elif len(conn.received) == _HELLO_MESSAGE:
            hello = bytes(conn.received[protocol.FRAME_BYTES :])
            auth = protocol.client_proof(SECRET.encode(), hello, protocol.new_nonce())
            conn.to_send = protocol.encode_frame(MessageType.AUTH, len(auth)) + auth
