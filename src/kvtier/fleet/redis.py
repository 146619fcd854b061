"""``redis``: the cluster index in Redis or Valkey, single server or cluster:
a sorted set per chunk of the node processes holding it, and a lease per
process, every command naming one key.

See docs/fleet.md, 'What a node publishes', for the key layout.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field

from kvtier.fleet.base import (
    INCARNATION_CHARS,
    MAX_NAME_CHARS,
    ClusterIndex,
    Holders,
    IndexOptions,
    NodeLease,
)
from kvtier.keys import ChunkKey
from kvtier.tiers.addresses import parse_host_port
from kvtier.tiers.redis import RedisServerOptions, redis_client, require_redis

_MAX_LEASE_BYTES = 4096


class RedisIndexOptions(IndexOptions, RedisServerOptions):
    key_prefix: str = "kvtier:index:"
    """Prepended to every key of the index."""

    max_connections: int = Field(default=8, ge=2, le=1024)
    """Connection pool size (per node in cluster mode)."""

    connect_timeout_s: float = Field(default=0.25, gt=0, le=60)
    """Seconds to wait for a connection to open."""

    retries: int = Field(default=0, ge=0, le=5)
    """Further attempts of a failed call; each adds up to ``timeout_s`` to a wait."""

    @property
    def socket_timeout_s(self) -> float:
        return self.timeout_s


class RedisIndex(ClusterIndex):
    """The cluster index as sorted sets and leases in Redis or Valkey."""

    Options: ClassVar[type[IndexOptions]] = RedisIndexOptions

    def __init__(self, options: IndexOptions) -> None:
        if not isinstance(options, RedisIndexOptions):
            raise TypeError(f"RedisIndex takes RedisIndexOptions, not {type(options).__name__}")
        super().__init__(options)
        self._options = options
        self._prefix = options.key_prefix.encode()
        require_redis()  # a missing library fails the start, not the first use
        # Built on first use, and again on each use until built: a cluster's
        # client reads the topology from a seed at construction, and an index
        # down at start must only delay publishing (it is advice), as a single
        # server's, whose pool connects on first use, does anyway.
        self._built: Any = None
        self._building = threading.Lock()
        # Leases read recently: a routing call asks for each node once a second
        # at most, not once per chunk entry.
        self._leases: dict[str, tuple[float, NodeLease | None]] = {}
        self._leases_lock = threading.Lock()
        self._lease_cache_s = min(1.0, options.lease_s / 4)

    @property
    def _client(self) -> Any:
        client = self._built
        if client is not None:
            return client
        # One build at a time, and no caller queues behind it: each waits
        # one bounded attempt at most, as a call to a server down would.
        if not self._building.acquire(blocking=False):
            raise ConnectionError("the index's client is being built: its servers are slow")
        try:
            if self._built is None:
                self._built = redis_client(self._options)
            return self._built
        finally:
            self._building.release()

    def _chunk_name(self, key: ChunkKey) -> bytes:
        return self._prefix + b"c:" + key

    def _lease_name(self, incarnation: str) -> bytes:
        return self._prefix + b"n:" + incarnation.encode()

    def publish(
        self,
        incarnation: str,
        lease: NodeLease,
        added: Sequence[tuple[ChunkKey, str]],
        removed: Sequence[tuple[ChunkKey, str]],
    ) -> None:
        options = self._options
        now = time.time()
        expiry = now + options.entry_ttl_s
        ttl_ms = int(options.entry_ttl_s * 1000)
        pipe = self._client.pipeline(transaction=False)
        value = json.dumps({"node": lease.node, "p2p": lease.p2p_address})
        pipe.set(self._lease_name(incarnation), value, px=int(options.lease_s * 1000))
        for key, medium in added:
            name = self._chunk_name(key)
            pipe.zadd(name, {f"{incarnation}|{medium}": expiry})
            # Entries of dead nodes in a chunk that live nodes keep refreshing.
            pipe.zremrangebyscore(name, "-inf", now)
            pipe.pexpire(name, ttl_ms)
        for key, medium in removed:
            pipe.zrem(self._chunk_name(key), f"{incarnation}|{medium}")
        pipe.execute()

    def withdraw(self, incarnation: str) -> None:
        self._client.delete(self._lease_name(incarnation))

    def holders(self, keys: Sequence[ChunkKey]) -> Holders:
        try:
            holders = self._holders(keys)
        except Exception:
            self.counters.query_failures += 1
            raise
        self.counters.queries += 1
        return holders

    def _holders(self, keys: Sequence[ChunkKey]) -> Holders:
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.zrangebyscore(self._chunk_name(key), now, "+inf")
        replies = pipe.execute() if keys else []
        entries: list[list[tuple[str, str]]] = []
        for members in replies:
            entries.append([entry for m in members if (entry := self._parse_member(m))])
        incarnations = {inc for found in entries for inc, _ in found}
        leases = self._live_leases(incarnations)
        per_key: list[dict[str, frozenset[str]]] = []
        for found in entries:
            media: dict[str, set[str]] = {}
            for inc, medium in found:
                lease = leases.get(inc)
                if lease is not None:
                    media.setdefault(lease.node, set()).add(medium)
            per_key.append({node: frozenset(m) for node, m in media.items()})
        nodes = {lease.node: lease for lease in leases.values()}
        return Holders(per_key, nodes)

    def _parse_member(self, member: Any) -> tuple[str, str] | None:
        try:
            text = bytes(member).decode("ascii")
            incarnation, medium = text.split("|")
            int(incarnation, 16)
        except (TypeError, ValueError):
            self.counters.malformed_entries += 1
            return None
        if len(incarnation) != INCARNATION_CHARS or not (0 < len(medium) <= MAX_NAME_CHARS):
            self.counters.malformed_entries += 1
            return None
        return incarnation, medium

    def _live_leases(self, incarnations: set[str]) -> dict[str, NodeLease]:
        now = time.monotonic()
        live: dict[str, NodeLease] = {}
        wanted: list[str] = []
        with self._leases_lock:
            for inc in incarnations:
                cached = self._leases.get(inc)
                if cached is not None and now - cached[0] < self._lease_cache_s:
                    if cached[1] is not None:
                        live[inc] = cached[1]
                else:
                    wanted.append(inc)
        if not wanted:
            return live
        pipe = self._client.pipeline(transaction=False)
        for inc in wanted:
            pipe.get(self._lease_name(inc))
        replies = pipe.execute()
        fetched = {inc: self._parse_lease(raw) for inc, raw in zip(wanted, replies, strict=True)}
        with self._leases_lock:
            if len(self._leases) > 65536:
                self._leases.clear()
            for inc, lease in fetched.items():
                self._leases[inc] = (now, lease)
                if lease is not None:
                    live[inc] = lease
        return live

    def _parse_lease(self, raw: Any) -> NodeLease | None:
        if raw is None:
            return None  # expired or withdrawn: a dead node, not a malformed entry
        try:
            if len(raw) > _MAX_LEASE_BYTES:
                raise ValueError("too long")
            value = json.loads(raw)
            node, p2p = value["node"], value.get("p2p")
            if not isinstance(node, str) or not (0 < len(node) <= MAX_NAME_CHARS):
                raise ValueError("bad node")
            if p2p is not None:
                if not isinstance(p2p, str):
                    raise ValueError("bad p2p address")
                parse_host_port(p2p)
        except (TypeError, ValueError, KeyError, AttributeError):
            self.counters.malformed_entries += 1
            return None
        return NodeLease(node, p2p)

    def close(self) -> None:
        with self._building:  # after a build in flight: its client is closed too
            if self._built is not None:
                self._built.close()
