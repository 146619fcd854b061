"""The peer service's front door: one thread accepts connections and runs every handshake.

Handshakes run on non-blocking sockets under one selector, so a connection
that has not authenticated yet costs a file descriptor and a few hundred
bytes, never a thread: hundreds of silent or trickling strangers cannot
starve the threads that serve authenticated peers. Each handshake (TLS when
configured, then the challenge-response) must finish within
``handshake_timeout`` of its accept, all of it, however its bytes are paced.
:class:`~kvtier.tiers.p2p.admission.HandshakeBudget` bounds how many wait at
once, in all and per source address.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import cast

from kvtier.errors import PeerProtocolError
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.admission import HandshakeBudget, source_of
from kvtier.tiers.p2p.counters import ServerCounters
from kvtier.tiers.p2p.protocol import MessageType

logger = logging.getLogger("kvtier.tiers.p2p.server")

#: Connections accepted in one go before handshakes in progress get a turn.
_ACCEPT_BATCH = 64
#: Seconds accepting pauses when the process runs out of file descriptors.
_ACCEPT_PAUSE_S = 0.1
_AUTH_MESSAGE_BYTES = protocol.FRAME_BYTES + protocol.AUTH_BYTES
_TLS_RECORD_HANDSHAKE = 0x16


class Stage(enum.Enum):
    TLS = "TLS handshake"
    HELLO = "HELLO"
    AUTH = "authentication"


class Step(enum.Enum):
    """What a handshake waits for after :meth:`Handshake.advance`."""

    READ = selectors.EVENT_READ
    WRITE = selectors.EVENT_WRITE
    VERIFIED = 0


class Handshake:
    """One incoming connection on its way to authentication."""

    def __init__(self, sock: socket.socket, source: str, name: str, hello: bytes) -> None:
        self.sock = sock
        self.source = source
        self.name = name
        self.hello = hello
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.stage = Stage.TLS if self.tls else Stage.HELLO
        self.welcome = b""
        self.events = 0  # what the selector watches for it; 0: not registered
        self._outbox = b"" if self.tls else self._hello_message()
        self._inbox = bytearray()

    def _hello_message(self) -> bytes:
        return protocol.encode_frame(MessageType.HELLO, len(self.hello)) + self.hello

    def advance(self, secret: bytes) -> Step:
        """Go as far as the socket allows without blocking.

        Raises :class:`PeerProtocolError` (or :class:`~kvtier.errors.PeerAuthError`)
        for a peer that breaks the handshake, ``OSError`` for one that went away.
        """
        try:
            while True:
                if self.stage is Stage.TLS:
                    cast(ssl.SSLSocket, self.sock).do_handshake()
                    self.stage, self._outbox = Stage.HELLO, self._hello_message()
                elif self._outbox:
                    sent = self.sock.send(self._outbox)
                    self._outbox = self._outbox[sent:]
                elif self.stage is Stage.HELLO:
                    self.stage = Stage.AUTH
                else:
                    data = self.sock.recv(_AUTH_MESSAGE_BYTES - len(self._inbox))
                    if not data:
                        raise ConnectionError("closed before authenticating")
                    self._inbox += data
                    if self._read_auth(secret):
                        return Step.VERIFIED
        except (BlockingIOError, ssl.SSLWantReadError):
            return Step.READ
        except ssl.SSLWantWriteError:
            return Step.WRITE

    def _read_auth(self, secret: bytes) -> bool:
        """Check what arrived of AUTH; ``True`` once all of it verified."""
        if not self.tls and self._inbox[0] == _TLS_RECORD_HANDSHAKE:
            raise PeerProtocolError("a TLS client, but this peer service does not use TLS")
        if len(self._inbox) < protocol.FRAME_BYTES:
            return False
        protocol.decode_frame(
            bytes(self._inbox[: protocol.FRAME_BYTES]),
            {MessageType.AUTH: (protocol.AUTH_BYTES, protocol.AUTH_BYTES)},
        )
        if len(self._inbox) < _AUTH_MESSAGE_BYTES:
            return False
        body = bytes(self._inbox[protocol.FRAME_BYTES :])
        self.welcome = protocol.check_client_proof(secret, self.hello, body)
        return True


class ThrottledLog:
    """Warnings that a flood would repeat thousands of times a second.

    Of each kind, the first ``burst`` within ``interval`` seconds are logged;
    the rest are counted and reported with the next one logged.
    """

    def __init__(
        self,
        burst: int = 20,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = burst
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> (window start, logged in the window, held back since the last logged)
        self._windows: dict[str, tuple[float, int, int]] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        with self._lock:
            now = self._clock()
            start, logged, held = self._windows.get(kind, (now, 0, 0))
            if now - start >= self._interval:
                start, logged = now, 0
            if logged >= self._burst:
                self._windows[kind] = (start, logged, held + 1)
                return
            self._windows[kind] = (start, logged + 1, 0)
        if held:
            message += " (%d more like it not logged)"
            args = (*args, held)
        logger.warning(message, *args)


#: Hands an authenticated connection over: ``(socket, peer name, WELCOME body)``;
#: ``False`` if the service has no room for it (the gate then closes it).
OnAuthenticated = Callable[[socket.socket, str, bytes], bool]


class HandshakeGate:
    """Accepts on ``listener`` and drives handshakes until :meth:`close`."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        secret: bytes,
        hello: Callable[[], bytes],
        timeout: float,
        budget: HandshakeBudget[Handshake],
        on_authenticated: OnAuthenticated,
        counters: ServerCounters,
        warnings: ThrottledLog,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        listener.setblocking(False)
        self._listener = listener
        self._secret = secret
        self._hello = hello
        self._timeout = timeout
        self.budget = budget
        self._on_authenticated = on_authenticated
        self._counters = counters
        self._warnings = warnings
        self._tls = tls
        self._clock = clock
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._closing = False
        self._accept_paused_until: float | None = None

    def close(self) -> None:
        """Make :meth:`run` return; safe from any thread."""
        self._closing = True
        with contextlib.suppress(OSError):  # already woken and closed
            self._wake_write.send(b"x")

    def run(self) -> None:
        """The gate's thread: accept, advance handshakes, end those past their deadline."""
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        try:
            while not self._closing:
                for key, _ in self._selector.select(self._wait()):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, Handshake):
                        self._advance(key.data)
                now = self._clock()
                for late in self.budget.expired(now):
                    self._end(
                        late,
                        "timed_out",
                        f"handshake not done within {self._timeout}s (stuck in {late.stage.value})",
                    )
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._selector.register(self._listener, selectors.EVENT_READ, None)
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, Handshake):
                    key.data.sock.close()
            self._selector.close()
            self._listener.close()
            self._wake_read.close()
            self._wake_write.close()

    def _wait(self) -> float | None:
        """Seconds until the next deadline or the end of an accept pause."""
        moments = [self.budget.next_deadline(), self._accept_paused_until]
        soonest = min((m for m in moments if m is not None), default=None)
        return None if soonest is None else max(0.0, soonest - self._clock())

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of file descriptors: the backlog holds the rest
                self._warnings.warning("accept", "peer service: cannot accept: %s", exc)
                self._selector.unregister(self._listener)
                self._accept_paused_until = self._clock() + _ACCEPT_PAUSE_S
                return
            try:
                self._start(sock, address)
            except OSError as exc:  # reset before its handshake began
                sock.close()
                self._counters.add(refused=1)
                logger.debug("peer service: connection from %s lost at once: %r", address, exc)

    def _start(self, sock: socket.socket, address: tuple[str, int]) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        host = str(address[0])
        handshake = Handshake(
            sock, source_of(host), protocol.format_address(host, int(address[1])), self._hello()
        )
        displaced = self.budget.add(handshake, handshake.source, self._clock() + self._timeout)
        if displaced is not None:
            self._end(
                displaced,
                "refused",
                f"displaced by a newer connection ({self.budget.held_by(displaced.source)} "
                f"handshakes from {displaced.source}, {len(self.budget)} in all)",
            )
        self._advance(handshake)

    def _advance(self, handshake: Handshake) -> None:
        try:
            step = handshake.advance(self._secret)
        except PeerProtocolError as exc:  # PeerAuthError included
            self._end(handshake, "refused", str(exc))
            return
        except ssl.SSLError as exc:
            self._end(handshake, "refused", f"TLS handshake failed: {exc.reason or exc}")
            return
        except OSError:
            self._end(handshake, "refused", "closed before authenticating")
            return
        except Exception:  # a bug must cost one connection, never the whole service
            logger.exception("peer service: handshake with %s failed", handshake.name)
            self._end(handshake, "refused", "internal error")
            return
        if step is Step.VERIFIED:
            self._forget(handshake)
            if not self._on_authenticated(handshake.sock, handshake.name, handshake.welcome):
                handshake.sock.close()
        elif handshake.events == 0:
            handshake.events = step.value
            self._selector.register(handshake.sock, step.value, handshake)
        elif handshake.events != step.value:
            handshake.events = step.value
            self._selector.modify(handshake.sock, step.value, handshake)

    def _forget(self, handshake: Handshake) -> None:
        if handshake.events:
            self._selector.unregister(handshake.sock)
            handshake.events = 0
        self.budget.remove(handshake)

    def _end(self, handshake: Handshake, outcome: str, reason: str) -> None:
        self._forget(handshake)
        self._counters.add(**{outcome: 1})  # before the peer can see the close
        handshake.sock.close()
        self._warnings.warning(outcome, "peer service: refused %s: %s", handshake.name, reason)
