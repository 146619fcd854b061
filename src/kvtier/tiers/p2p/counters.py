"""What the peer service and the peer clients did: counters for metrics and ``describe``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class _Counters:
    """Integer fields that any thread may add to."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}


@dataclass
class ServerCounters(_Counters):
    """Incoming connections and what they were served."""

    #: Connections that authenticated.
    connections: int = 0
    #: Connections turned away: wrong secret, broken handshake, TLS failure,
    #: displaced from a full handshake budget, or no room among the sessions.
    refused: int = 0
    #: Connections ended because a handshake or a request outlived its timeout.
    timed_out: int = 0
    #: Authenticated connections closed idle: after the idle timeout, or to
    #: make room for a newcomer.
    idle_closed: int = 0
    #: Authenticated connections dropped for a malformed message.
    dropped: int = 0
    queries: int = 0
    chunks_served: int = 0
    bytes_served: int = 0
    misses_served: int = 0


@dataclass
class ClientCounters(_Counters):
    """Outgoing connections of one node, to all its peers together."""

    #: Connections opened (and authenticated) to peers.
    connects: int = 0
    #: Pooled connections closed unused after half the idle timeout.
    idle_closed: int = 0
    #: Requests repeated on a new connection because the pooled one had been
    #: closed by the peer (its idle timeout, a restart).
    reconnects: int = 0
