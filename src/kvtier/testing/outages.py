"""Outages on demand, for tests of remote tiers.

* :class:`FaultProxy`: a TCP proxy on loopback in front of a real server
  that forwards, stalls (accepts connections, never answers), delays,
  answers every HTTP request with a status of its choosing (503...) or cuts
  replies after a number of bytes. Switch :attr:`FaultProxy.mode` at any time;
  it applies to connections opened afterwards (and a stall to open ones too).
* :class:`FakeClock` and :func:`recover`: drive a remote tier's circuit
  breaker through its backoff without waiting for it; :func:`wait_until`
  waits for a state, never asserting how long it took.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from typing_extensions import Self

    from kvtier.tiers.remote import RemoteTier

#: Every proxy listens on, and forwards to, this address only.
LOOPBACK = "127.0.0.1"

Mode = Literal["forward", "stall", "delay", "status", "cut", "hold"]


class FakeClock:
    """A clock that moves only when told: ``breaker.clock = FakeClock()``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def recover(tier: RemoteTier, clock: FakeClock, timeout: float = 30.0) -> bool:
    """Move ``clock`` past the breaker's backoff, let one probe run; whether it closed.

    ``clock`` must be the tier's ``breaker.clock``. A request admitted by the
    breaker starts the probe, as a lookup would in service.
    """
    if tier.breaker.closed:
        return True
    clock.advance(tier.breaker.max_backoff_s)
    stuck = set(tier.probes.threads)
    tier.guards.admit()
    for probe in tier.probes.threads:
        if probe not in stuck:  # the one just started; stuck ones may never end
            probe.join(timeout)
    return tier.breaker.closed


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` after ``timeout`` seconds."""
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise TimeoutError(f"still not {what or 'true'} after {timeout}s")
        time.sleep(0.005)


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port``, with faults.

    Modes: ``forward``; ``stall`` (accept, read, never answer or forward);
    ``delay`` (forward after :attr:`delay_s`); ``status`` (answer each HTTP
    request with :attr:`status` and S3 error :attr:`error_code`, then
    close); ``cut`` (forward, but close each reply after :attr:`cut_after`
    bytes); ``hold`` (forward :attr:`cut_after` bytes of the replies, the rest
    once the mode changes). :attr:`connections` counts the connections accepted.
    """

    def __init__(self, target_port: int, mode: Mode = "forward") -> None:
        self.target_port = target_port
        self.mode: Mode = mode
        self.delay_s = 0.0
        self.status = 503
        #: The S3 error code in the body of a ``status`` answer.
        self.error_code = "SlowDown"
        self.cut_after = 100
        self.connections = 0
        self._stalled = threading.Event()  # set: stalled connections may go
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def set_mode(self, mode: Mode) -> None:
        """Switch mode; leaving ``stall`` releases the connections it held (they close)."""
        self.mode = mode
        if mode != "stall":
            self._stalled.set()
            self._stalled = threading.Event()

    def close(self) -> None:
        self._closed = True
        self._stalled.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Machinery ----------------------------------------------------------------

    def _keep(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
        return sock

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._keep(client)
            threading.Thread(
                target=self._serve, args=(client, self.mode), name="fault-proxy-conn", daemon=True
            ).start()

    def _serve(self, client: socket.socket, mode: Mode) -> None:
        released = self._stalled  # set when the mode changes
        with contextlib.closing(client):
            if mode == "stall":
                self._stall(client)
                return
            if mode == "status":
                self._answer_status(client)
                return
            if mode == "delay":
                time.sleep(self.delay_s)
            try:
                upstream = self._keep(socket.create_connection((LOOPBACK, self.target_port)))
            except OSError:
                return
            with contextlib.closing(upstream):
                limit = self.cut_after if mode in ("cut", "hold") else None
                forward = threading.Thread(target=_pipe, args=(client, upstream, None), daemon=True)
                forward.start()
                _pipe(upstream, client, limit, end=mode != "hold")
                if mode == "hold" and self._held(released):
                    _pipe(upstream, client, None)
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)

    def _held(self, released: threading.Event) -> bool:
        """Wait for the mode to change; whether the proxy is still open."""
        while not released.wait(0.1):
            if self._closed:
                return False
        return not self._closed

    def _stall(self, client: socket.socket) -> None:
        released = self._stalled
        client.settimeout(0.1)
        while not released.is_set() and not self._closed:
            try:
                if not client.recv(65536):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def _answer_status(self, client: socket.socket) -> None:
        client.settimeout(5)
        with contextlib.suppress(OSError):
            request = b""
            while b"\r\n\r\n" not in request:
                data = client.recv(65536)
                if not data:
                    return
                request += data
            body = (
                f"<Error><Code>{self.error_code}</Code><Message>injected</Message></Error>".encode()
            )
            client.sendall(
                f"HTTP/1.1 {self.status} Injected\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )


def _pipe(source: socket.socket, sink: socket.socket, limit: int | None, end: bool = True) -> None:
    """Copy ``source`` to ``sink`` until either closes, or ``limit`` bytes;
    then (``end``) shut ``sink``'s sending side."""
    sent = 0
    with contextlib.suppress(OSError):
        while limit is None or sent < limit:
            data = source.recv(65536 if limit is None else min(65536, limit - sent))
            if not data:
                break
            sink.sendall(data)
            sent += len(data)
        if end:
            sink.shutdown(socket.SHUT_WR)
