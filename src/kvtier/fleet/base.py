"""The cluster index contract: which node holds which chunk, in which tier.

A :class:`ClusterIndex` is a small backend of blocking, batched calls on a
distributed store. Nodes write through :meth:`~ClusterIndex.publish` (from the
publisher's own thread, :mod:`kvtier.fleet.publisher`); routers and the
``p2p`` tier read through :meth:`~ClusterIndex.holders`. Entries are chunk
keys and node names only: no KV bytes, no token ids.

The index is advice. An entry may be stale (the chunk evicted since), name a
dead node, or be forged by whoever can write to the store: a reader's answer
costs at most a miss, because a p2p fetch verifies the peer and the bytes.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field, field_validator

from kvtier.keys import ChunkKey
from kvtier.options import Options
from kvtier.tiers.addresses import parse_host_port

#: The medium of the primary (CPU) tier; a secondary tier's medium is its ``type``.
PRIMARY_MEDIUM = "cpu"
#: Hex digits of the tag a node process picks at start (its entries' owner).
INCARNATION_CHARS = 16
#: Longest node name or medium an index accepts (a name is stored with every entry).
MAX_NAME_CHARS = 256


def default_node_name() -> str:
    """``host:pid``: unique per process, which a router maps to an engine only by config."""
    return f"{socket.gethostname()}:{os.getpid()}"


class IndexOptions(Options):
    """Options every cluster index takes; a backend adds its own in a subclass."""

    node: str | None = None
    """This node's name in the index: what routing answers call it (say, the
    engine's URL). Unset: ``host:pid``."""

    p2p_address: str | None = None
    """``host:port`` peers reach this node's ``p2p`` service at; unset: the
    ``listen`` address of its ``p2p`` tier, unless that is a wildcard
    (``0.0.0.0``), which peers cannot dial: then set this."""

    media: tuple[str, ...] = (PRIMARY_MEDIUM,)
    """Tiers whose chunks this node publishes: ``cpu`` (the primary tier) and
    the ``type`` of any secondary tier. Shared tiers (``redis``, ``obj``) are
    held by every node alike: publishing them adds writes and tells a router nothing."""

    lease_s: float = Field(default=10.0, gt=0, le=3600)
    """A node's entries count for this long after its last heartbeat (sent
    every third of it): a node that dies leaves the answers within it."""

    entry_ttl_s: float = Field(default=3600.0, gt=0, le=30 * 86400)
    """An entry not published again within this long is dropped by the store.
    The node publishes its primary tier's chunks again every half of it, so
    only entries of dead nodes and of secondary tiers' own evictions age out."""

    flush_interval_s: float = Field(default=0.05, gt=0, le=60)
    """Longest a change waits before it is sent (changes go in batches)."""

    batch_size: int = Field(default=4096, ge=1, le=1 << 20)
    """Most changes sent in one batch (one round trip per store node)."""

    max_pending: int = Field(default=100_000, ge=1)
    """Changes held while the index is unreachable; past it they are dropped
    and the node republishes what it holds once the index answers again."""

    timeout_s: float = Field(default=0.25, gt=0, le=60)
    """Longest wait for one index call: a lookup's or a routing answer's
    bound when the index is slow or down."""

    max_backoff_s: float = Field(default=5.0, gt=0, le=600)
    """Longest pause between two tries of a failing publish (doubling from ``flush_interval_s``)."""

    @field_validator("node")
    @classmethod
    def _check_node(cls, value: str | None) -> str | None:
        if value is not None and not _printable_name(value):
            raise ValueError(
                f"a node name is 1 to {MAX_NAME_CHARS} printable characters without '|'"
            )
        return value

    @field_validator("p2p_address")
    @classmethod
    def _check_p2p_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @field_validator("media")
    @classmethod
    def _check_media(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for medium in value:
            if not _printable_name(medium):
                raise ValueError(f"medium {medium!r} is not a tier name")
        return value

    def node_name(self) -> str:
        return self.node or default_node_name()


def _printable_name(name: str) -> bool:
    return 0 < len(name) <= MAX_NAME_CHARS and name.isprintable() and "|" not in name


@dataclass(frozen=True)
class NodeLease:
    """A live node as its lease describes it."""

    node: str
    #: Where its ``p2p`` service listens, if it has one.
    p2p_address: str | None


@dataclass(frozen=True)
class Holders:
    """Who holds each asked key: ``per_key[i]`` maps a live node to the media
    it holds ``keys[i]`` in."""

    per_key: list[dict[str, frozenset[str]]]
    nodes: Mapping[str, NodeLease]


@dataclass
class IndexCounters:
    """What a reader saw: answered and failed queries, entries it ignored."""

    queries: int = 0
    query_failures: int = 0
    malformed_entries: int = 0


class ClusterIndex(ABC):
    """A distributed store of ``(chunk key, node, medium)`` entries with node leases.

    Constructed as ``cls(options)``; every method may block up to
    ``options.timeout_s`` per call and raises ``OSError`` or the client's own
    error when the store fails. Thread-safe.
    """

    Options: ClassVar[type[IndexOptions]] = IndexOptions

    def __init__(self, options: IndexOptions) -> None:
        self.options = options
        self.counters = IndexCounters()

    @abstractmethod
    def publish(
        self,
        incarnation: str,
        lease: NodeLease,
        added: Sequence[tuple[ChunkKey, str]],
        removed: Sequence[tuple[ChunkKey, str]],
    ) -> None:
        """Renew the lease of this node's ``incarnation`` and apply the
        ``(key, medium)`` changes, in one batch."""

    @abstractmethod
    def withdraw(self, incarnation: str) -> None:
        """End the lease now (a node that stops cleanly leaves the answers at once)."""

    @abstractmethod
    def holders(self, keys: Sequence[ChunkKey]) -> Holders:
        """The live nodes holding each of ``keys``, and in which media."""

    @abstractmethod
    def close(self) -> None:
        """Release the client's connections."""
