"""Budgets for incoming connections: one for handshakes, one for authenticated peers.

Connections that have not authenticated yet and connections that have are
counted apart, so silent or slow strangers can never take the places of
peers that proved they know the secret. Both budgets are pure bookkeeping
(no sockets, no threads, an injected clock): the peer service decides what
to close.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)

#: An IPv6 host usually holds a whole /64: a per-source limit per address would
#: let it rotate through addresses of its own network.
IPV6_SOURCE_PREFIX = 64


def source_of(host: str) -> str:
    """The source a connection from ``host`` counts against: an IPv4 address,
    or the /64 network of an IPv6 one (IPv4-mapped addresses count as IPv4)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX), strict=False))
    return str(address)


class HandshakeBudget(Generic[C]):
    """Connections still in their handshake, oldest first, in all and per source.

    A newcomer always gets in. When its source already holds ``per_source``
    handshakes, that source's oldest gives way; when all sources together
    hold ``limit``, the oldest handshake of the source holding most gives
    way. A source that floods connections thus only ever displaces its own,
    and an honest handshake (one round trip) can be displaced only by a
    flood faster than that round trip, never by connections that merely sit
    and wait: those end at their deadline.
    """

    def __init__(self, limit: int, per_source: int) -> None:
        if not 1 <= per_source <= limit:
            raise ValueError(f"need 1 <= per_source ({per_source}) <= limit ({limit})")
        self.limit = limit
        self.per_source = per_source
        # Insertion order is deadline order: every handshake gets the same time.
        self._deadlines: OrderedDict[C, float] = OrderedDict()
        self._sources: dict[C, str] = {}
        self._by_source: dict[str, OrderedDict[C, None]] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, conn: object) -> bool:
        return conn in self._deadlines

    def held_by(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def add(self, conn: C, source: str, deadline: float) -> C | None:
        """Count ``conn`` in; returns the connection it displaces, if any."""
        displaced = None
        if self.held_by(source) >= self.per_source:
            displaced = next(iter(self._by_source[source]))
        elif len(self._deadlines) >= self.limit:
            largest = max(self._by_source, key=lambda name: len(self._by_source[name]))
            displaced = next(iter(self._by_source[largest]))
        if displaced is not None:
            self.remove(displaced)
        self._deadlines[conn] = deadline
        self._sources[conn] = source
        self._by_source.setdefault(source, OrderedDict())[conn] = None
        return displaced

    def remove(self, conn: C) -> None:
        """Count ``conn`` out (it authenticated, failed, or closed); no-op if absent."""
        if self._deadlines.pop(conn, None) is None:
            return
        source = self._sources.pop(conn)
        held = self._by_source[source]
        del held[conn]
        if not held:
            del self._by_source[source]

    def next_deadline(self) -> float | None:
        """The earliest deadline, or ``None`` when no handshake is pending."""
        return next(iter(self._deadlines.values()), None)

    def expired(self, now: float) -> list[C]:
        """Count out and return the handshakes whose deadline has passed."""
        late = []
        for conn, deadline in self._deadlines.items():
            if deadline > now:
                break
            late.append(conn)
        for conn in late:
            self.remove(conn)
        return late


class SessionBudget(Generic[C]):
    """Authenticated connections, at most ``limit``; idle ones give way to newcomers.

    A session is idle while it waits for its peer's next request. When the
    budget is full, a newcomer takes the place of the session idle the
    longest; if every session is busy, the newcomer is refused.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"session budget must be positive, got {limit}")
        self.limit = limit
        # None while busy, else the instant the session became idle.
        self._idle_since: dict[C, float | None] = {}

    def __len__(self) -> int:
        return len(self._idle_since)

    def __contains__(self, conn: object) -> bool:
        return conn in self._idle_since

    def add(self, conn: C) -> tuple[bool, C | None]:
        """Try to count ``conn`` in, busy: ``(admitted, idle session it displaces)``."""
        displaced: C | None = None
        if len(self._idle_since) >= self.limit:
            idle = [
                (since, order, conn)
                for order, (conn, since) in enumerate(self._idle_since.items())
                if since is not None
            ]
            if not idle:
                return False, None
            displaced = min(idle)[2]
            del self._idle_since[displaced]
        self._idle_since[conn] = None
        return True, displaced

    @property
    def idle_count(self) -> int:
        """Sessions waiting for their peer's next request."""
        return sum(since is not None for since in self._idle_since.values())

    def idle(self, conn: C, now: float) -> None:
        if conn in self._idle_since:
            self._idle_since[conn] = now

    def busy(self, conn: C) -> bool:
        """Mark ``conn`` busy; ``False`` if it is no longer counted (it was displaced)."""
        if conn not in self._idle_since:
            return False
        self._idle_since[conn] = None
        return True

    def remove(self, conn: C) -> None:
        self._idle_since.pop(conn, None)
