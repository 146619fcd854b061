"""The cluster index: configuration, publishing from a node, faults, and the Redis backend."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint
from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvtier import KVCache, plugins
from kvtier.cli.peer import synthetic_chunks
from kvtier.cli.probe import probe_layout
from kvtier.config import load_config
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.fleet import ANY_TIER, FleetIndex, build_index, leading_runs
from kvtier.fleet.base import NodeLease
from kvtier.fleet.publisher import IndexPublisher
from kvtier.fleet.redis import RedisIndex
from kvtier.keys import ChunkKey, chunk_keys
from tests.fleet import fleet_doubles
from tests.support.needs import need_redis_server
from tests.support.servers import RedisClusterServers, RedisServer, free_port

CHUNK_TOKENS = 16
LAYOUT = probe_layout(CHUNK_TOKENS, 16)
SAFETY_S = 60.0
DICT_INDEX = {"type": "DictIndex", "module_path": "tests.fleet.fleet_doubles", "node": "node-a"}


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Safety net only: a test passes on the condition, never on time."""
    deadline = time.monotonic() + SAFETY_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def store() -> Iterator[fleet_doubles.DictStore]:
    fleet_doubles.STORE = fleet_doubles.DictStore()
    yield fleet_doubles.STORE


def node(slots: int, index: dict[str, Any], **config: Any) -> KVCache:
    return KVCache(
        {
            "chunk_tokens": CHUNK_TOKENS,
            "cpu_bytes_to_use": slots * LAYOUT.slot_bytes,
            "index": {"flush_interval_s": 0.01, **index},
            **config,
        },
        LAYOUT,
    )


def keys_of(tokens: np.ndarray) -> list[ChunkKey]:
    return list(chunk_keys(LAYOUT.namespace, tokens, CHUNK_TOKENS))


# Configuration ------------------------------------------------------------------


def test_index_errors_name_their_path() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config({"index": {"type": "redis", "url": "http://x:1", "lease_s": -1, "nodes": "a"}})
    message = str(raised.value)
    assert "index.url" in message and "index.lease_s" in message
    assert "index.nodes: unknown key; did you mean 'node'?" in message


def test_an_unknown_index_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config({"index": {"type": "etcd"}})
    assert "index.type" in str(raised.value) and "redis" in str(raised.value)
    assert "module_path" in str(raised.value)


def test_an_out_of_tree_index_loads_by_module_path(store: fleet_doubles.DictStore) -> None:
    config = load_config({"index": DICT_INDEX})
    assert config.index is not None and config.index.index_class is fleet_doubles.DictIndex


def test_an_index_resolves_through_the_kvtier_indexes_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declared = EntryPoint("dict-index", "tests.fleet.fleet_doubles:DictIndex", "kvtier.indexes")

    def installed(**selection: str) -> list[EntryPoint]:
        wanted = selection.get("group") == declared.group
        named = selection.get("name", declared.name) == declared.name
        return [declared] if wanted and named else []

    monkeypatch.setattr(plugins, "entry_points", installed)
    config = load_config({"index": {"type": "dict-index"}})
    assert config.index is not None and config.index.index_class is fleet_doubles.DictIndex


# Publishing ---------------------------------------------------------------------


def test_stores_and_evictions_reach_the_index(store: fleet_doubles.DictStore) -> None:
    with node(4, DICT_INDEX) as cache:
        first, data = synthetic_chunks(LAYOUT, 3, 1)
        cache.store(first, data)
        wait_until(lambda: store.held() == set(keys_of(first)), "the first chunks published")
        second, data = synthetic_chunks(LAYOUT, 3, 2)
        cache.store(second, data)  # evicts two of the first
        held = set(cache.manager.primary.ready_keys())
        assert len(held & set(keys_of(first))) == 1
        wait_until(lambda: store.held() == held, "the evictions published")
    assert store.leases == {}  # a node that stops withdraws its lease


def test_a_secondary_tier_is_published_as_its_medium(store: fleet_doubles.DictStore) -> None:
    index = {**DICT_INDEX, "media": ["cpu", "memory"]}
    with node(8, index, secondary_tiers=[{"type": "memory"}]) as cache:
        tokens, data = synthetic_chunks(LAYOUT, 2, 3)
        cache.store(tokens, data)
        wanted = set(keys_of(tokens))

        def published() -> bool:
            cache.step()  # the tier's store results reach the manager at a step
            return store.held("memory") == wanted

        wait_until(published, "the memory tier's chunks")


def test_publishing_backs_off_and_catches_up(store: fleet_doubles.DictStore) -> None:
    store.failing = True
    with node(8, {**DICT_INDEX, "max_backoff_s": 0.05}) as cache:
        tokens, data = synthetic_chunks(LAYOUT, 4, 4)
        cache.store(tokens, data)
        publisher = cache.manager.attachments[0]
        assert isinstance(publisher, IndexPublisher)
        wait_until(lambda: publisher.failures >= 3, "failed publishes")
        assert store.held() == set()
        # Lookups never wait for the index: they answer from the node.
        with cache.lookup(tokens, timeout=0) as found:
            assert found.num_tokens == len(tokens)
        store.failing = False
        wait_until(lambda: store.held() == set(keys_of(tokens)), "the changes caught up")


def test_past_max_pending_the_node_republishes_what_it_holds(
    store: fleet_doubles.DictStore,
) -> None:
    store.failing = True
    with node(4, {**DICT_INDEX, "max_pending": 2, "max_backoff_s": 0.05}) as cache:
        publisher: Any = cache.manager.attachments[0]
        # The first publish names every chunk held: let it come (and fail) first.
        wait_until(lambda: publisher.republished == 1 and publisher.failures, "a first try")
        for seed in range(3):
            tokens, data = synthetic_chunks(LAYOUT, 3, 10 + seed)
            cache.store(tokens, data)
        assert publisher.dropped > 0
        store.failing = False
        held = set(cache.manager.primary.ready_keys())
        wait_until(lambda: store.held() == held, "the held chunks republished")
        assert publisher.republished >= 2  # at start, and after an overflow


def test_the_index_metrics_are_exported(store: fleet_doubles.DictStore) -> None:
    with node(4, DICT_INDEX) as cache:
        tokens, data = synthetic_chunks(LAYOUT, 2, 5)
        cache.store(tokens, data)
        wait_until(lambda: store.held() == set(keys_of(tokens)), "publishing")
        text = generate_latest(cache.metrics.registry).decode()
    assert "kvtier_index_published_adds_total 2.0" in text
    assert "kvtier_index_malformed_entries_total 0.0" in text


# Routing scores -----------------------------------------------------------------


def test_leading_runs_end_at_the_first_chunk_a_node_lacks() -> None:
    per_key = [
        {"a": frozenset({"cpu"}), "b": frozenset({"fs"})},
        {"a": frozenset({"fs"}), "b": frozenset({"fs"})},
        {"a": frozenset({"cpu"})},
        {"c": frozenset({"cpu"})},
    ]
    runs = leading_runs(per_key)
    assert runs == {"a": {"cpu": 1, ANY_TIER: 3}, "b": {"fs": 2, ANY_TIER: 2}}
    assert "c" not in runs  # holds nothing of the prefix


# The Redis backend --------------------------------------------------------------


def redis_index(url: str, **options: Any) -> RedisIndex:
    config = load_config({"index": {"type": "redis", "url": url, **options}})
    assert config.index is not None
    index = build_index(config.index.index_class, config.index.options)
    assert isinstance(index, RedisIndex)
    return index


def test_a_node_is_routed_to_by_what_it_holds(redis_server: RedisServer) -> None:
    prefix = "t-routed:"
    index = {"type": "redis", "url": redis_server.url, "node": "engine-1", "key_prefix": prefix}
    reader = FleetIndex(redis_index(redis_server.url, key_prefix=prefix), CHUNK_TOKENS, LAYOUT)
    with node(8, index) as cache:
        tokens, data = synthetic_chunks(LAYOUT, 3, 6)
        cache.store(tokens, data)
        wait_until(lambda: bool(reader.scores_for_tokens(tokens)), "the chunks in the index")
        [score] = reader.scores_for_tokens(tokens)
        assert (score.node, score.tokens) == ("engine-1", {"any": 48, "cpu": 48})
        # A prompt sharing two chunks, then going its own way.
        other = np.concatenate([tokens[:32], tokens[:16] + 1])
        assert reader.scores_for_tokens(other)[0].tokens == {"any": 32, "cpu": 32}
    reader.close()
    fresh = FleetIndex(redis_index(redis_server.url, key_prefix=prefix), CHUNK_TOKENS, LAYOUT)
    assert fresh.scores_for_tokens(tokens) == []  # the lease was withdrawn
    fresh.close()


def test_a_routers_bad_keys_are_its_own_error_not_the_indexs(redis_server: RedisServer) -> None:
    reader = FleetIndex(redis_index(redis_server.url, key_prefix="t-badkeys:"), CHUNK_TOKENS)
    with pytest.raises(TypeError, match=r"keys\[1\]: expected a chunk key of 32 bytes"):
        reader.scores([ChunkKey(bytes(32)), "ab" * 16])  # type: ignore[list-item]  # a str key
    with pytest.raises(TypeError, match="keys: expected a sequence of chunk keys"):
        reader.scores(bytes(32))  # type: ignore[arg-type]  # one key, not a sequence
    assert reader.index.counters.query_failures == 0  # never asked
    assert reader.scores([ChunkKey(bytes(32))]) == []
    reader.close()


def test_malformed_entries_are_ignored_and_counted(redis_server: RedisServer) -> None:
    import redis

    prefix = "t-malformed:"
    index = redis_index(redis_server.url, key_prefix=prefix)
    key = keys_of(np.arange(CHUNK_TOKENS))[0]
    index.publish("0123456789abcdef", NodeLease("good", None), [(key, "cpu")], [])
    client = redis.Redis.from_url(redis_server.url)
    name = prefix.encode() + b"c:" + key
    far = time.time() + 3600
    client.zadd(name, {b"not-a-member": far, b"zzzzzzzzzzzzzzzz|cpu": far, b"\xff|cpu": far})
    client.zadd(name, {b"fedcba9876543210|cpu": far})  # its lease is not JSON
    client.set(prefix.encode() + b"n:fedcba9876543210", b"{not json")
    holders = index.holders([key])
    assert holders.per_key == [{"good": frozenset({"cpu"})}]
    assert index.counters.malformed_entries == 4
    index.close()
    client.close()


def test_an_index_that_is_down_fails_only_itself() -> None:
    down = f"redis://127.0.0.1:{free_port()}/0"
    with node(8, {"type": "redis", "url": down, "max_backoff_s": 0.05}) as cache:
        tokens, data = synthetic_chunks(LAYOUT, 2, 7)
        assert cache.store(tokens, data) == 2
        with cache.lookup(tokens, timeout=0) as found:
            assert found.num_tokens == len(tokens)
        publisher: Any = cache.manager.attachments[0]
        wait_until(lambda: publisher.failures >= 2, "failed publishes")
        assert publisher.added == publisher.dropped == 0  # kept for when it comes back
    reader = FleetIndex(redis_index(down), CHUNK_TOKENS, LAYOUT)
    with pytest.raises(Exception, match=r"(?i)connect|refused"):
        reader.scores_for_tokens(tokens)
    assert reader.index.counters.query_failures == 1


def test_a_cluster_index_down_at_start_publishes_once_it_answers() -> None:
    """The index is advice: a Redis Cluster not up yet when the engine starts
    (its client reads the topology from a seed) delays publishing, as a
    single server down does, and fails no start."""
    need_redis_server()
    cluster = RedisClusterServers()  # its ports chosen, nothing listening yet
    index = {"type": "redis", "startup_nodes": cluster.startup_nodes, "max_backoff_s": 0.05}
    try:
        with node(8, index) as cache:
            tokens, data = synthetic_chunks(LAYOUT, 2, 7)
            assert cache.store(tokens, data) == 2
            publisher: Any = cache.manager.attachments[0]
            wait_until(lambda: publisher.failures >= 2, "failed publishes")
            cluster.start()
            reader = FleetIndex(
                build_index(RedisIndex, publisher.index.options), CHUNK_TOKENS, LAYOUT
            )
            try:
                wait_until(lambda: bool(reader.scores_for_tokens(tokens)), "the chunks published")
                [score] = reader.scores_for_tokens(tokens)
                assert (score.node, score.tokens["cpu"]) == (publisher.lease.node, len(tokens))
            finally:
                reader.close()
    finally:
        cluster.close()


def test_a_call_while_the_client_is_built_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No caller queues behind a build (a cluster's seeds slow to answer): each
    call waits one bounded attempt at most, and a failed build is tried anew."""
    import kvtier.fleet.redis as fleet_redis

    building, release = threading.Event(), threading.Event()
    builds: list[Any] = []

    def slow_client(options: Any) -> Any:
        builds.append(options)
        building.set()
        assert release.wait(30), "never released"
        raise ConnectionError("no seed answered")

    monkeypatch.setattr(fleet_redis, "redis_client", slow_client)
    index = redis_index("redis://127.0.0.1:1/0")
    [key] = keys_of(np.arange(CHUNK_TOKENS))
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            index.holders([key])
        except ConnectionError as exc:
            errors.append(exc)

    first = threading.Thread(target=ask)
    first.start()
    assert building.wait(30)
    with pytest.raises(ConnectionError, match="being built"):
        index.holders([key])  # while the first call builds: no second build
    release.set()
    first.join()
    assert [str(error) for error in errors] == ["no seed answered"]
    with pytest.raises(ConnectionError, match="no seed answered"):
        index.holders([key])  # built anew
    assert len(builds) == 2 and index.counters.query_failures == 3
    index.close()


def test_an_index_without_its_client_library_fails_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"kvtier\[redis\]"):
        redis_index("redis://127.0.0.1:1/0")


def test_a_redis_cluster_holds_the_index(redis_cluster: RedisClusterServers) -> None:
    seeds = redis_cluster.startup_nodes
    config = load_config({"index": {"type": "redis", "startup_nodes": seeds}})
    assert config.index is not None
    index = build_index(config.index.index_class, config.index.options)
    keys = keys_of(np.arange(CHUNK_TOKENS * 6))  # spread over the cluster's slots
    index.publish(
        "00000000000000aa", NodeLease("n1", "127.0.0.1:9"), [(k, "cpu") for k in keys], []
    )
    index.publish("00000000000000bb", NodeLease("n2", None), [(keys[0], "fs")], [])
    index.publish("00000000000000aa", NodeLease("n1", "127.0.0.1:9"), [], [(keys[5], "cpu")])
    holders = index.holders(keys)
    assert holders.per_key[0] == {"n1": frozenset({"cpu"}), "n2": frozenset({"fs"})}
    assert [h.get("n1") for h in holders.per_key] == [frozenset({"cpu"})] * 5 + [None]
    index.withdraw("00000000000000aa")
    index.withdraw("00000000000000bb")
    index.close()


def test_an_entry_not_published_again_ages_out(redis_server: RedisServer) -> None:
    short = redis_index(redis_server.url, key_prefix="t-aging:", entry_ttl_s=0.2, lease_s=60)
    index = redis_index(redis_server.url, key_prefix="t-aging:", lease_s=60)
    [old, fresh] = keys_of(np.arange(CHUNK_TOKENS * 2))
    lease = NodeLease("n", None)
    short.publish("00000000000000cc", lease, [(old, "fs")], [])
    index.publish("00000000000000cc", lease, [(fresh, "fs")], [])  # an hour's entry
    wait_until(lambda: index.holders([old]).per_key == [{}], "the short entry to expire")
    # The node's lease lives on, and so do its entries still within their time.
    assert index.holders([old, fresh]).per_key == [{}, {"n": frozenset({"fs"})}]
    index.withdraw("00000000000000cc")
    short.close()
    index.close()


def test_the_lease_names_the_p2p_service_or_the_configured_address(
    store: fleet_doubles.DictStore,
) -> None:
    p2p = {"type": "p2p", "secret": "s" * 16}
    with node(4, DICT_INDEX, secondary_tiers=[p2p]) as cache:
        publisher: Any = cache.manager.attachments[0]
        tier: Any = cache.manager.tiers[0]
        assert publisher.lease.p2p_address == tier.advertised_address()
        assert publisher.lease.p2p_address.startswith("127.0.0.1:")
    with node(4, {**DICT_INDEX, "p2p_address": "10.0.0.5:7420"}, secondary_tiers=[p2p]) as cache:
        publisher = cache.manager.attachments[0]
        assert publisher.lease.p2p_address == "10.0.0.5:7420"
    with pytest.raises(ConfigError, match=r"index\.p2p_address"):
        load_config({"index": {**DICT_INDEX, "p2p_address": "nowhere"}})
