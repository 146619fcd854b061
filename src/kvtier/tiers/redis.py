"""``redis``: chunks shared by many engines through Redis or Valkey, single
server or cluster, every batch one pipeline.

See docs/shared-tiers.md for batching, outages and eviction.
"""

from __future__ import annotations

import queue
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, Self, TypeVar

from pydantic import Field, SecretStr, field_validator, model_validator

from kvtier.errors import (
    CorruptChunkError,
    MissingDependencyError,
)
from kvtier.options import Options
from kvtier.tiers.addresses import host_problem, parse_host_port, split_url
from kvtier.tiers.backend import (
    MAX_WAIT_S,
    Backend,
    BackendRuntime,
    Exists,
    Fetched,
    FramedValue,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.redis_events import DropWatcher, Server
from kvtier.tiers.redis_wire import exists, get_into, set_many
from kvtier.tiers.remote import RemoteTier

_T = TypeVar("_T")

_URL_SCHEMES = ("redis", "rediss", "unix")
#: Longest ``ttl_s`` (ten years): Redis refuses expiry times past its clock's range.
MAX_TTL_S = 10 * 365 * 86400.0


class RedisServerOptions(Options):
    """Where the Redis or Valkey server (or cluster) is and how to log in:
    the options the tier and the cluster index share."""

    url: str | None = None
    """``redis://[user[:password]@]host:port/db`` (``rediss://`` for TLS); with
    ``cluster: true``, any one node of the cluster."""

    cluster: bool = False
    """Talk to a Redis Cluster (seeded by ``url``) instead of a single server."""

    startup_nodes: tuple[str, ...] = ()
    """``host:port`` seed nodes of a Redis Cluster, instead of ``url``; implies ``cluster``."""

    username: str | None = None
    """ACL user, if not in ``url``."""

    password: SecretStr | None = None
    """Password, if not in ``url``."""

    @property
    def is_cluster(self) -> bool:
        return self.cluster or bool(self.startup_nodes)

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None:
            problem = redis_url_problem(url)
            if problem:
                raise ValueError(
                    f"{problem}; write it as redis://[user[:password]@]host:port/db "
                    "(rediss:// for TLS, unix:///path/to.sock for a socket)"
                )
        return url

    @model_validator(mode="after")
    def _check_target(self) -> Self:
        if (self.url is None) == (not self.startup_nodes):
            raise ValueError(
                "set exactly one of 'url' (a server, or a cluster node with cluster: true) "
                "and 'startup_nodes' (cluster seeds as host:port)"
            )
        for node in self.startup_nodes:
            try:
                parse_host_port(node)
            except ValueError as exc:
                raise ValueError(f"startup_nodes: {exc}") from None
        return self


class RedisTierOptions(RemoteTierOptions, RedisServerOptions):
    key_prefix: str = "kvtier:"
    """Prepended to every key, before the namespace and chunk digests."""

    ttl_s: float | None = Field(default=None, gt=0, le=MAX_TTL_S)
    """Expire chunks this many seconds after they were last stored or read; none if unset."""

    max_connections: int = Field(default=16, ge=1)
    """Connection pool size (per node in cluster mode); at least ``io_threads``."""

    connect_timeout_s: float = Field(default=2.0, gt=0, le=MAX_WAIT_S)
    """Seconds to wait for a connection to open."""

    socket_timeout_s: float = Field(default=5.0, gt=0, le=MAX_WAIT_S)
    """Seconds to wait for any one reply, and for a free pooled connection."""

    retries: int = Field(default=1, ge=0, le=10)
    """Further attempts after a connection error or timeout, before a batch fails."""

    io_threads: int = Field(default=4, ge=1, le=64)
    """Worker threads, each running one pipeline at a time."""

    watch_evictions: bool = False
    """Hear the chunks the server drops by itself (its ``maxmemory``
    evictions, ``ttl_s`` expiries) as they go, through its keyspace
    notifications: residency (KV events for routers) announces them removed
    at once, not when a load finds them gone, and ``evictions`` counts the
    evicted ones. One more connection and thread per server (per node of a
    cluster, whose nodes are listed again every 10 s: one that joins is heard
    too). The server must raise ``Exe`` in ``notify-keyspace-events``:
    kvtier adds them at start, and the start fails, saying so, where the
    server refuses ``CONFIG SET``."""

    def store_location(self) -> str | None:
        if self.url is not None:
            # Without the user and password the URL may hold.
            url = urllib.parse.urlsplit(self.url)
            netloc = url.netloc.rpartition("@")[2]
            query = [(k, v) for k, v in urllib.parse.parse_qsl(url.query) if k != "password"]
            server = f"{url.scheme}://{netloc}{url.path}"
            if query:  # ?db=1 names another database
                server += "?" + urllib.parse.urlencode(sorted(query))
        else:
            server = "cluster " + ",".join(sorted(self.startup_nodes))
        return f"redis {server}, key prefix {self.key_prefix!r}"

    @model_validator(mode="after")
    def _check_connections(self) -> RedisTierOptions:
        if self.max_connections < self.io_threads:
            raise ValueError(
                f"max_connections={self.max_connections} is below io_threads={self.io_threads}: "
                "every worker needs a connection"
            )
        return self


class RedisBackend(Backend[RedisTierOptions]):
    """Chunks as values in Redis/Valkey, moved in pipelines."""

    Options: ClassVar[type[RemoteTierOptions]] = RedisTierOptions
    #: Most chunks per pipeline: enough to hide the round trip of small
    #: chunks, few enough that a job's batches spread over the workers.
    io_batch: ClassVar[int] = 8
    #: Payload bytes per pipeline, which caps it for large chunks: a worker
    #: verifies a value while it is still in cache, and the server serves
    #: many workers' short pipelines at once rather than a few long ones
    #: (2 MiB chunks: 2 a pipeline loaded 1.3-1.5x faster than 8, in one run).
    batch_bytes: ClassVar[int] = 4 << 20
    #: Values are read into buffers of the largest size, so any shorter one fits.
    variable_payloads: ClassVar[bool] = True

    def __init__(self, options: RedisTierOptions, runtime: BackendRuntime) -> None:
        super().__init__(options, runtime)
        self._ttl_ms = None if options.ttl_s is None else max(1, round(options.ttl_s * 1000))
        self._target = _target(options)
        self._cluster = options.is_cluster
        # A cluster client keeps redis-py's own connections (and packer).
        self.sends_framed = self.receives_into = not self._cluster
        tls = (options.url or "").lower().startswith("rediss://")
        self.client: Any = self.start_client(
            lambda: _connected(options),
            lambda client: client.close(),
            self._target,
            hint="; a rediss:// URL (TLS) for a server without TLS also waits like this"
            if tls
            else "",
        )
        #: The subscribers to the servers' drops, with ``watch_evictions``.
        self.drops: DropWatcher | None = None
        if options.watch_evictions:
            try:
                with self.starting(self._target):  # it bounds its own wait
                    self.drops = self._watch_drops(options.startup_timeout_s)
            except BaseException:
                self.close()
                raise

    def _watch_drops(self, start_wait_s: float) -> DropWatcher:
        """Subscribers to every server's evictions and expiries of this tier's
        chunks, the start waiting at most ``start_wait_s`` for their answers."""
        thread_name = f"kvtier-{self.runtime.tier_type}-drops"
        if self._cluster:
            return DropWatcher(
                self._cluster_nodes(),
                0,
                self._dropped,
                thread_name,
                relist=self._relisted_nodes,
                start_wait_s=start_wait_s,
            )
        pool = self.client.connection_pool
        db = int(pool.connection_kwargs.get("db") or 0)
        server = (self._target, _single_client(pool))
        return DropWatcher([server], db, self._dropped, thread_name, start_wait_s=start_wait_s)

    def _cluster_nodes(self) -> list[Server]:
        """Every node the cluster client knows, primaries and replicas."""
        return [
            (f"cluster node {node.name}", _single_client(node.redis_connection.connection_pool))
            for node in self.client.get_nodes()
        ]

    def _relisted_nodes(self) -> list[Server]:
        # The client learns of a node only once a reply redirects it there:
        # asking the cluster finds one that joined and holds chunks other
        # engines wrote, as redis-py asks itself after a redirect.
        self.client.nodes_manager.initialize()
        return self._cluster_nodes()

    def _dropped(self, event: str, names: list[bytes]) -> None:
        ours = self.runtime.report_removed(names)  # other namespaces' and applications' left out
        if event == "evicted" and ours:
            self.runtime.count(evictions=ours)

    @classmethod
    def name_prefix(cls, options: RedisTierOptions) -> str:
        return options.key_prefix

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def exists_many(self, names: Sequence[str]) -> list[Exists]:
        if not self._cluster:
            return self._on_connection(lambda connection: exists(connection, names))
        pipe = self._pipeline()
        for name in names:
            pipe.exists(name)
        # Per item: on a cluster, one node's error leaves the others' answers good.
        return [
            reply if isinstance(reply, BaseException) else reply == 1
            for reply in pipe.execute(raise_on_error=False)
        ]

    def put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        return self._set_many(names, values)

    def put_framed(self, names: Sequence[str], values: Sequence[FramedValue]) -> PutErrors:
        return self._set_many(names, values)

    def _set_many(
        self, names: Sequence[str], values: Sequence[ValueBuffer | FramedValue]
    ) -> PutErrors:
        if not self._cluster:
            return self._on_connection(
                lambda connection: set_many(connection, names, values, ttl_ms=self._ttl_ms)
            )
        pipe = self._pipeline()
        for name, value in zip(names, values, strict=True):
            pipe.set(name, value, px=self._ttl_ms)
        replies = pipe.execute(raise_on_error=False)
        return [reply if isinstance(reply, BaseException) else None for reply in replies]

    def get_many(self, names: Sequence[str]) -> list[Fetched]:
        """Values received straight into this worker's buffers (see :mod:`.redis_wire`)."""
        if self._cluster:
            return self._get_pipelined(names)
        return self._read(names, self.runtime.scratch_values(len(names))[: len(names)])

    def get_into(
        self,
        names: Sequence[str],
        headers: Sequence[memoryview],
        payloads: Sequence[memoryview],
        deadline: float,
        touch: Callable[[], AbstractContextManager[bool]],
    ) -> list[Fetched]:
        return self._read(names, headers, payloads=payloads, deadline=deadline, touch=touch)

    def _read(
        self, names: Sequence[str], buffers: Sequence[ValueBuffer], **split: Any
    ) -> list[Fetched]:
        return self._on_connection(
            lambda connection: get_into(connection, names, buffers, ttl_ms=self._ttl_ms, **split)
        )

    def _on_connection(self, call: Callable[[Any], _T]) -> _T:
        """``call`` on a pooled connection (not a cluster's), retried as redis-py
        retries its own commands: a failed attempt closed the connection, and
        the next one reconnects."""
        pool = self.client.connection_pool
        connection = pool.get_connection()
        try:
            result: _T = connection.retry.call_with_retry(
                lambda: call(connection), lambda _error: None
            )
            return result
        finally:
            pool.release(connection)

    def _get_pipelined(self, names: Sequence[str]) -> list[Fetched]:
        """Values as redis-py reads them (a cluster client keeps its own connections)."""
        pipe = self._pipeline()
        for name in names:
            pipe.get(name)
            if self._ttl_ms is not None:
                pipe.pexpire(name, self._ttl_ms)
        replies = pipe.execute(raise_on_error=False)
        return [_wrong_type_is_corrupt(v) for v in replies[:: 1 if self._ttl_ms is None else 2]]

    def refresh_many(self, names: Sequence[str]) -> None:
        if self._ttl_ms is None or not names:
            return
        pipe = self._pipeline()
        for name in names:
            pipe.pexpire(name, self._ttl_ms)
        pipe.execute(raise_on_error=False)

    def delete(self, name: str) -> None:
        self.client.delete(name)

    def refuses(self, error: BaseException) -> bool:
        # OOM (full under maxmemory-policy noeviction, Redis's default),
        # READONLY (a replica), NOPERM (an ACL user that may only read).
        from redis.exceptions import NoPermissionError, OutOfMemoryError, ReadOnlyError

        return isinstance(error, (OutOfMemoryError, ReadOnlyError, NoPermissionError))

    def ping(self) -> None:
        if self._cluster:
            _any_node_answers(self.client)
        else:
            # A connection of the probe's own, made as the pool makes them: a
            # probe never waits for a pooled connection that stuck workers
            # hold, and it tries what recovery needs, a fresh connect.
            _ping(_pooled_connection(self.client.connection_pool))

    def close(self) -> None:
        if self.drops is not None:
            self.drops.close()
        self.client.close()
        if not self.options.is_cluster:
            # A client given its pool leaves the pool open on close(): its
            # connections would stay open on the server until collected.
            self.client.connection_pool.disconnect()

    def describe(self) -> dict[str, object]:
        options = self.options
        return {
            "target": self._target,
            "cluster": options.is_cluster,
            "key_prefix": options.key_prefix,
            "ttl_s": options.ttl_s,
            "watch_evictions": options.watch_evictions,
        }


class RedisTier(RemoteTier[RedisTierOptions]):
    """The ``redis`` tier: the remote-tier runtime over :class:`RedisBackend`."""

    backend_class = RedisBackend


def _wrong_type_is_corrupt(reply: Any) -> Fetched:
    """A GET of a list or hash: a corrupt chunk, not a failing server."""
    if isinstance(reply, BaseException) and str(reply).startswith("WRONGTYPE"):
        return CorruptChunkError(f"the value is not a string: {reply}")
    return reply


def _connected(options: RedisTierOptions) -> Any:
    """A client for ``options`` that answered: a server's ``PING``, or the
    topology a cluster's client is built from (it reads it from a seed, so
    no further check is needed)."""
    client = redis_client(options)
    if options.is_cluster:
        return client
    try:
        client.ping()  # on a pooled connection, the first request's
    except BaseException:
        client.close()
        raise
    return client


def _any_node_answers(client: Any) -> None:
    """Raise unless some node of the cluster answers ``PING``, all asked at
    once, each on a connection of its own: the nodes that answer serve their
    chunks while one is down or frozen, whichever it is."""
    nodes = [node for node in client.get_nodes() if node.redis_connection is not None]
    pools = [node.redis_connection.connection_pool for node in nodes]
    _first_answers(pools, lambda pool: _ping(_pooled_connection(pool)))


def _first_answers(targets: Sequence[_T], ping: Callable[[_T], None]) -> list[_T]:
    """The ``targets`` that answered by the time the first did, all pinged at
    once on threads of their own (left to end on their own timeouts); the
    last error when none answers."""
    if not targets:
        raise ConnectionError("no server to ask")
    outcomes: queue.SimpleQueue[tuple[_T, BaseException | None]] = queue.SimpleQueue()

    def ask(target: _T) -> None:
        try:
            ping(target)
        except BaseException as exc:  # handed to the caller
            outcomes.put((target, exc))
        else:
            outcomes.put((target, None))

    for target in targets:
        threading.Thread(target=ask, args=(target,), name="kvtier-redis-ping", daemon=True).start()
    error: BaseException | None = None
    for _ in targets:
        target, error = outcomes.get()
        if error is None:
            answered = [target]
            while not outcomes.empty():
                other, failed = outcomes.get()
                if failed is None:
                    answered.append(other)
            return answered
    assert error is not None
    raise error


def _ping(connection: Any) -> None:
    """One ``PING`` on ``connection``, closed after."""
    try:
        connection.send_command("PING")
        reply = connection.read_response()
    finally:
        connection.disconnect()
    if reply not in (b"PONG", "PONG", True):
        raise ConnectionError(f"PING answered {reply!r}")


def _pooled_connection(pool: Any) -> Any:
    """A new connection made as ``pool`` makes them, not in the pool."""
    return pool.connection_class(**pool.connection_kwargs)


def _single_client(pool: Any) -> Callable[[], Any]:
    """A maker of clients of ``pool``'s server, each with a pool of its own."""

    def connect() -> Any:
        import redis

        own = redis.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
        return redis.Redis.from_pool(own)

    return connect


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL, or ``None``."""
    try:
        parts = split_url(url, _URL_SCHEMES)
    except ValueError as exc:
        return str(exc)
    if parts.scheme == "unix":
        return None if parts.path else "a unix:// URL needs the socket's path"
    problem = host_problem(parts.hostname or "")
    if problem:
        return problem
    database = parts.path.strip("/")
    if database and not (database.isascii() and database.isdigit()):
        return f"the database must be a number, got {database!r}"
    return _query_problem(url) if parts.query else None


def _query_problem(url: str) -> str | None:
    """What redis-py finds wrong in a URL's query options (``?db=x``), or ``None``."""
    try:
        from redis.connection import parse_url
    except ImportError:
        return None  # the tier's start names the missing extra
    try:
        parse_url(url)
    except ValueError as exc:
        return f"a query option is invalid ({exc})"
    return None


class RedisTarget(Protocol):
    """The connection options :func:`redis_client` reads (the tier's, the cluster index's)."""

    @property
    def url(self) -> str | None: ...

    @property
    def startup_nodes(self) -> tuple[str, ...]: ...

    @property
    def username(self) -> str | None: ...

    @property
    def password(self) -> SecretStr | None: ...

    @property
    def max_connections(self) -> int: ...

    @property
    def connect_timeout_s(self) -> float: ...

    @property
    def socket_timeout_s(self) -> float: ...

    @property
    def retries(self) -> int: ...

    @property
    def is_cluster(self) -> bool: ...


def require_redis() -> None:
    """Raise :class:`MissingDependencyError` unless redis-py is installed."""
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError("redis", "redis") from exc


def redis_client(options: RedisTarget) -> Any:
    """A redis-py client for ``options``: a blocking pool, or a cluster client
    seeded with the seeds that answer."""
    require_redis()
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    common: dict[str, Any] = {
        **_connection_settings(options),
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), options.retries),
    }
    if options.is_cluster:
        common["max_connections"] = options.max_connections
        if options.url is not None:
            return RedisCluster.from_url(options.url, **common)
        nodes = [ClusterNode(host, port) for host, port in _answering_seeds(options)]
        return RedisCluster(startup_nodes=nodes, **common)
    pool = redis.BlockingConnectionPool.from_url(
        str(options.url),
        max_connections=options.max_connections,
        timeout=options.socket_timeout_s,
        **common,
    )
    return redis.Redis(connection_pool=pool)


def _answering_seeds(options: RedisTarget) -> list[tuple[str, int]]:
    """The cluster's seeds that answer, as hosts and ports: redis-py tries
    its seeds one by one, in a random order, and would wait
    ``socket_timeout_s`` on a frozen one first. All are asked at once."""
    seeds = [parse_host_port(seed) for seed in options.startup_nodes]
    if len(seeds) == 1:  # the client's own attempt says all there is to say
        return seeds
    settings = _connection_settings(options)
    return _first_answers(seeds, lambda seed: _ping(_connection(*seed, **settings)))


def _connection_settings(options: RedisTarget) -> dict[str, Any]:
    """The timeouts and login of every connection to ``options``' servers."""
    settings: dict[str, Any] = {
        "socket_timeout": options.socket_timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
    }
    if options.username is not None:
        settings["username"] = options.username
    if options.password is not None:
        settings["password"] = options.password.get_secret_value()
    return settings


def _connection(host: str, port: int, **settings: Any) -> Any:
    """A connection to one server, opened on its first command."""
    import redis

    return redis.Connection(host=host, port=port, **settings)


def _target(options: RedisTierOptions) -> str:
    """Where the tier points, for messages: the URL without its password."""
    if options.url is None:
        return "cluster " + ",".join(options.startup_nodes)
    parts = urllib.parse.urlsplit(options.url)
    if parts.password is not None:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        parts = parts._replace(netloc=netloc)
    return urllib.parse.urlunsplit(parts)
