"""``watch_evictions``: chunks a Redis server drops by itself (``maxmemory``,
``ttl_s``) reach residency as they go, against real redis-server processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.errors import BackendUnavailableError
from kvtier.testing import small_layout
from kvtier.testing.outages import wait_until
from kvtier.tiers import redis_events
from kvtier.tiers.redis import RedisBackend, RedisTier
from kvtier.tiers.redis_events import missing_flags
from tests.support.cache_tiers import backend_of, tier_at
from tests.support.needs import need_redis_server
from tests.support.servers import LOOPBACK, RedisClusterServers, RedisServer
from tests.tiers.remote.drops import an_expiry_is_heard, every_expiry_is_heard, watched
from tests.tiers.remote.test_redis_tier import raw_client

THREAD = "kvtier-redis-drops"


@pytest.fixture
def server_of(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start servers of this test's own, with ``redis-server`` options; all stopped after."""
    need_redis_server()
    servers: list[RedisServer] = []

    def start(*options: str, maxmemory: str | None = None) -> RedisServer:
        server = RedisServer(maxmemory=maxmemory, options=options)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.close()


def test_flags_that_already_hold_the_needed_classes_need_nothing() -> None:
    assert missing_flags("") == "Exe"
    assert missing_flags("KEA") == ""  # A holds e and x
    assert missing_flags("Ex") == "e"
    assert missing_flags("AK") == "E"
    assert missing_flags("xeE") == ""


def test_expiries_reach_residency_as_they_happen_and_only_this_namespaces(
    server_of: Any, key_prefix: str
) -> None:
    server = server_of()
    harness, removed = watched({"url": server.url}, key_prefix, ttl_s=0.3)
    client = raw_client(server.url)
    try:
        assert server.command("CONFIG", "GET", "notify-keyspace-events").count(b"E")
        # Names of no chunk of this tier's, expiring first: never reported.
        other = harness.keys(1)[0].hex()
        foreign = [
            f"{key_prefix}x",
            f"other:{harness.tier.store_name(harness.keys(1)[0])}",
            f"{key_prefix}{'0' * 64}:{other}",  # another namespace's
        ]
        for name in foreign:
            client.set(name, b"v", px=20)
        # Expired (a read expires a key at once): their notifications go out
        # before any of the chunks' below.
        wait_until(lambda: client.exists(*foreign) == 0, what="the foreign names expired")
        keys = harness.keys(4)
        harness.fill(range(4))
        assert harness.store(keys, list(range(4))).success
        wait_until(lambda: len(removed) >= 4, what="4 expiries reported")
        assert sorted(removed) == sorted(keys)
        assert client.exists(*[harness.tier.store_name(key) for key in keys]) == 0
        assert harness.tier.stats.evictions == 0  # an expiry is no eviction
    finally:
        harness.close()


def test_maxmemory_evictions_reach_residency_and_are_counted(
    server_of: Any, key_prefix: str
) -> None:
    server = server_of(maxmemory="2mb")
    harness, removed = watched({"url": server.url}, key_prefix)
    client = raw_client(server.url)
    try:
        keys = harness.keys(256)  # 4 MiB of 16 KiB chunks: twice what the server keeps
        for start in range(0, len(keys), 8):
            batch = keys[start : start + 8]
            harness.fill(range(len(batch)))
            harness.store(batch, list(range(len(batch))))
        names = [harness.tier.store_name(key) for key in keys]
        gone = {key for key, name in zip(keys, names, strict=True) if not client.exists(name)}
        assert len(gone) > len(keys) // 4
        wait_until(lambda: set(removed) == gone, what="every eviction reported")
        assert len(removed) == len(gone)  # each once
        assert harness.tier.stats.evictions == len(gone)
    finally:
        harness.close()


@pytest.mark.parametrize("where", ["database 3", "unix socket"])
def test_drops_are_heard_in_the_tiers_own_database_only(
    server_of: Any, key_prefix: str, where: str
) -> None:
    server = server_of()
    url = server.url[: -len("/0")] + "/3" if where == "database 3" else server.unix_url
    harness, removed = watched({"url": url}, key_prefix)
    try:
        # The same name expiring in another database: not this tier's chunk.
        other = raw_client(server.url[: -len("/0")] + "/5")
        name = harness.tier.store_name(harness.keys(1)[0])
        other.set(name, b"v", px=10)
        wait_until(lambda: not other.exists(name), what="the other database's name expired")
        assert removed == [an_expiry_is_heard(harness, removed, url)]
    finally:
        harness.close()


def test_an_eviction_reaches_the_engines_residency_watch(server_of: Any, key_prefix: str) -> None:
    """What routers learn (KV events): the chunk Redis dropped is announced gone."""
    server = server_of()
    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * layout.slot_bytes,
        "secondary_tiers": [
            {"type": "redis", "url": server.url, "key_prefix": key_prefix, "watch_evictions": True}
        ],
    }
    told: list[tuple[str, bytes, bool]] = []
    with KVCache(config, layout) as cache:
        cache.watch_residency(
            lambda tier, keys, stored: told.extend((tier, key, stored) for key in keys)
        )
        row = np.random.default_rng(0).integers(0, 256, (1, layout.slot_bytes), dtype=np.uint8)
        cache.store([0, 1, 2, 3], row)
        cache.drain()
        [key] = cache.keys([0, 1, 2, 3])
        name = tier_at(cache, 0, RedisTier).store_name(key)
        assert raw_client(server.url).pexpire(name, 10)
        wait_until(lambda: ("redis", key, False) in told, what="the expiry announced")
        assert [entry for entry in told if entry[0] == "redis"] == [
            ("redis", key, True),
            ("redis", key, False),
        ]


def test_a_restarted_server_is_watched_again_once_it_answers(
    server_of: Any, key_prefix: str
) -> None:
    server = server_of()
    harness, removed = watched({"url": server.url}, key_prefix)
    try:
        [first, second] = harness.keys(2)
        client = raw_client(server.url)
        client.set(harness.tier.store_name(first), b"v", px=10)
        wait_until(lambda: removed == [first], what="the first expiry reported")
        server.stop()
        server.start()  # the same port, and none of the settings made at run time
        wait_until(
            lambda: b"E" in server.command("CONFIG", "GET", "notify-keyspace-events"),
            what="the notifications turned on again",
        )
        wait_until(lambda: b"flags=P" in server.command("CLIENT", "LIST"), what="subscribed again")
        raw_client(server.url).set(harness.tier.store_name(second), b"v", px=10)
        wait_until(lambda: removed == [first, second], what="the second expiry reported")
    finally:
        harness.close()


@pytest.mark.parametrize(
    ("denied", "message"),
    [
        # May read the setting, not change it: the message says what to set.
        (["-config|set"], "lack 'Exe'"),
        # May not subscribe to the notifications' channels.
        (["resetchannels"], "no permissions to access one of the channels"),
    ],
)
def test_a_server_that_will_not_let_the_tier_hear_fails_the_start(
    server_of: Any, key_prefix: str, denied: list[str], message: str
) -> None:
    server = server_of()
    server.command("ACL", "SETUSER", "reader", "on", ">secret", "~*", "&*", "+@all", *denied)
    url = server.url.replace("redis://", "redis://reader:secret@")
    with pytest.raises(BackendUnavailableError) as caught:
        watched({"url": url}, key_prefix)
    said = str(caught.value)
    assert message in said and "secret" not in said
    if "lack" in message:
        assert "set notify-keyspace-events to include Exe" in said and "watch_evictions" in said
    # Nothing left behind: neither a subscriber nor a connection.
    assert not [thread for thread in threading.enumerate() if thread.name == THREAD]
    wait_until(
        lambda: server.command("CLIENT", "LIST").count(b"id=") == 1, what="connections closed"
    )


def test_a_server_that_will_not_say_but_raises_them_is_heard(
    server_of: Any, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # As a managed service: CONFIG disabled, the setting made in its own console.
    server = server_of("--rename-command", "CONFIG", "", "--notify-keyspace-events", "Ex")
    harness, removed = watched({"url": server.url}, key_prefix)
    try:
        assert "make sure its notify-keyspace-events includes Exe" in caplog.text
        assert removed == [an_expiry_is_heard(harness, removed, server.url)]
    finally:
        harness.close()


def test_every_node_of_a_cluster_is_heard(
    redis_cluster: RedisClusterServers, key_prefix: str
) -> None:
    nodes = {"startup_nodes": redis_cluster.startup_nodes}
    harness, removed = watched(nodes, key_prefix, ttl_s=0.3)
    try:
        every_expiry_is_heard(harness, removed)
    finally:
        harness.close()


def raw_cluster(cluster: RedisClusterServers) -> Any:
    import redis
    from redis.cluster import ClusterNode

    return redis.RedisCluster(startup_nodes=[ClusterNode(LOOPBACK, n.port) for n in cluster.nodes])


def _subscribers(node: RedisServer) -> int:
    """How many clients ``node`` sends its expiries to."""
    reply = node.command("PUBSUB", "NUMSUB", "__keyevent@0__:expired")
    return int(reply.rstrip(b"\r\n").rpartition(b":")[2])


def test_a_node_that_joins_the_cluster_is_heard(
    key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reshard moves chunks to a node that was not there at start: its drops
    are heard once the cluster is listed again."""
    need_redis_server()
    monkeypatch.setattr(redis_events, "RELIST_S", 0.2)
    with RedisClusterServers() as cluster:
        harness, removed = watched({"startup_nodes": cluster.startup_nodes}, key_prefix, ttl_s=2)
        try:
            joined = cluster.add_node(slots=8192)
            wait_until(lambda: _subscribers(joined) == 1, what="the joined node subscribed to")
            keys = every_expiry_is_heard(harness, removed)
            router = raw_cluster(cluster)
            names = [harness.tier.store_name(key) for key in keys]
            on_joined = [n for n in names if router.get_node_from_key(n).port == joined.port]
            assert on_joined  # half the slots moved: some of 24 chunks, surely
            assert harness.tier.stats.backend_errors == 0
        finally:
            harness.close()


def test_a_node_that_leaves_the_cluster_loses_its_subscriber(
    key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_redis_server()
    monkeypatch.setattr(redis_events, "RELIST_S", 0.2)
    with RedisClusterServers(nodes=4) as cluster:
        harness, removed = watched({"startup_nodes": cluster.startup_nodes}, key_prefix, ttl_s=2)
        try:
            leaving = cluster.nodes[-1]
            assert _subscribers(leaving) == 1
            watcher = backend_of(harness.tier, RedisBackend).drops
            assert watcher is not None and len(watcher.servers) == 4
            threads = len([t for t in threading.enumerate() if t.name == THREAD])
            cluster.remove_node(leaving)
            gone = f"cluster node {LOOPBACK}:{leaving.port}"
            wait_until(lambda: gone not in watcher.servers, what="the node left the listing")
            assert len(watcher.servers) == 3
            wait_until(
                lambda: len([t for t in threading.enumerate() if t.name == THREAD]) == threads - 1,
                what="its subscriber's thread ended",
            )
            every_expiry_is_heard(harness, removed)  # the other nodes are heard still
        finally:
            harness.close()


@pytest.mark.parametrize("outage", ["down", "frozen"])
def test_a_cluster_node_out_at_start_is_heard_once_it_answers(
    key_prefix: str, caplog: pytest.LogCaptureFixture, outage: str
) -> None:
    """The tier serves without a node that is down or frozen, so hearing drops
    does not make the node a condition of the start: its subscriber keeps
    trying. (A node that refuses still fails the start: above.)"""
    need_redis_server()
    with RedisClusterServers() as cluster:
        *up, out = cluster.nodes
        if outage == "down":
            out.stop()
        else:
            out.pause()  # takes connections, answers nothing
        # Every node a seed, the one out too. Not the first primary, though:
        # redis-py's client asks it for its command table and cannot start
        # while it is frozen (docs/shared-tiers.md).
        nodes = {"startup_nodes": cluster.startup_nodes, "startup_timeout_s": 1}
        harness, removed = watched(nodes, key_prefix, ttl_s=2)
        try:
            named = f"cluster node {LOOPBACK}:{out.port}"
            said = "to hear its drops" if outage == "down" else "did not answer within 1.0s"
            assert [r.getMessage() for r in caplog.records if named in r.getMessage()]
            assert said in caplog.text and "heard once it answers" in caplog.text
            assert [_subscribers(node) for node in up] == [1, 1]
            cluster.bring_back(out)
            wait_until(lambda: _subscribers(out) == 1, what="the node subscribed to once back")
            keys = every_expiry_is_heard(harness, removed)
            router = raw_cluster(cluster)
            names = [harness.tier.store_name(key) for key in keys]
            assert any(router.get_node_from_key(n).port == out.port for n in names)
        finally:
            harness.close()


def test_a_listing_that_fails_leaves_the_subscribers_as_they_are(
    server_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    monkeypatch.setattr(redis_events, "RELIST_S", 0.05)
    server = server_of()
    listings: list[int] = []

    def relist() -> list[redis_events.Server]:
        listings.append(1)
        raise ConnectionError("injected: the cluster did not answer")

    pool = redis.Redis.from_url(server.url).connection_pool
    connect = lambda: redis.Redis.from_pool(redis.ConnectionPool(**pool.connection_kwargs))  # noqa: E731
    watcher = redis_events.DropWatcher(
        [("the server", connect)], 0, lambda *_: None, THREAD, relist=relist
    )
    try:
        wait_until(lambda: len(listings) >= 3, what="three listings tried")
        assert watcher.servers == ["the server"]
        assert _subscribers(server) == 1
    finally:
        watcher.close()
    wait_until(lambda: _subscribers(server) == 0, what="unsubscribed at close")


def test_shutdown_stops_the_subscribers_and_closes_their_connections(
    server_of: Any, key_prefix: str
) -> None:
    server = server_of()

    def clients() -> int:
        return server.command("CLIENT", "LIST").count(b"id=")  # this command's own included

    harness, _ = watched({"url": server.url}, key_prefix)
    assert [thread for thread in threading.enumerate() if thread.name == THREAD]
    assert clients() > 1
    harness.close()
    assert not [thread for thread in threading.enumerate() if thread.name == THREAD]
    wait_until(lambda: clients() == 1, what="the tier's connections closed")
