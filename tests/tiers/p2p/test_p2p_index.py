"""Node processes publishing to a real Redis: routing answers, leases, p2p asking holders."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from kvtier.config import load_config
from kvtier.fleet import FleetIndex, build_index
from kvtier.fleet.base import NodeLease
from tests.support.servers import RedisServer, free_port
from tests.tiers.p2p.p2p_nodes import (
    CHUNK_TOKENS,
    PeerProcess,
    Spawn,
    layout_of,
    load_all,
    node,
    spawner,
    wait_until,
)

CHUNK_KIB = 16
CHUNKS = 3
_prefixes = itertools.count()


@pytest.fixture
def prefix() -> str:
    """A key prefix of the test's own: tests share the session's server."""
    return f"t{next(_prefixes)}-p2p-index:"


@pytest.fixture(scope="module")
def indexed_fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[tuple[str, list[PeerProcess]]]:
    """Four nodes publishing to the session's Redis under a prefix of their own,
    each in the index once the fixture returns."""
    prefix = "fleet-p2p-index:"
    spawn, started = spawner(tmp_path_factory.mktemp("indexed-fleet"))
    try:
        peers = spawn_nodes(spawn, redis_server, prefix, 4)
        fleet = reader(redis_server, prefix)
        for peer in peers:
            wait_until(functools.partial(visible, fleet, peer), f"{peer.name} in the index")
        fleet.close()
        yield prefix, peers
    finally:
        for peer in started:
            peer.stop()


def index_section(server: RedisServer, prefix: str, **options: Any) -> dict[str, Any]:
    return {"type": "redis", "url": server.url, "key_prefix": prefix, **options}


def reader(server: RedisServer, prefix: str) -> FleetIndex:
    config = load_config({"index": index_section(server, prefix)})
    assert config.index is not None
    index = build_index(config.index.index_class, config.index.options)
    return FleetIndex(index, CHUNK_TOKENS, layout_of(CHUNK_KIB))


def spawn_nodes(
    spawn: Spawn, server: RedisServer, prefix: str, count: int, **index: Any
) -> list[PeerProcess]:
    return [
        spawn(
            f"n{i}",
            chunk_kib=CHUNK_KIB,
            chunks=CHUNKS,
            seed=100 + i,
            index=index_section(server, prefix, node=f"engine-{i}", **index),
        )
        for i in range(count)
    ]


def visible(fleet: FleetIndex, peer: PeerProcess) -> bool:
    return any(score.node == f"engine-{peer.name[1:]}" for score in fleet.scores(peer.keys))


def test_routing_answers_match_what_each_node_holds(
    indexed_fleet: tuple[str, list[PeerProcess]], redis_server: RedisServer
) -> None:
    prefix, peers = indexed_fleet
    fleet = reader(redis_server, prefix)
    for i, peer in enumerate(peers):
        [score] = fleet.scores_for_tokens(peer.tokens)
        assert score.node == f"engine-{i}" and score.p2p_address == peer.address
        assert score.tokens == {"any": CHUNKS * CHUNK_TOKENS, "cpu": CHUNKS * CHUNK_TOKENS}
        # Its first chunk, then another node's: one chunk's worth.
        mixed = np.concatenate([peer.tokens[:CHUNK_TOKENS], peers[i - 1].tokens])
        assert [(s.node, s.best) for s in fleet.scores_for_tokens(mixed)] == [
            (f"engine-{i}", CHUNK_TOKENS)
        ]
    fleet.close()


def test_a_killed_node_leaves_the_answers_within_its_lease(
    spawn_peer: Spawn, redis_server: RedisServer, prefix: str
) -> None:
    [doomed, survivor] = spawn_nodes(spawn_peer, redis_server, prefix, 2, lease_s=1.0)
    fleet = reader(redis_server, prefix)
    for peer in (doomed, survivor):
        wait_until(functools.partial(visible, fleet, peer), f"{peer.name} in the index")
    client = redis.Redis.from_url(redis_server.url)
    leases = client.keys(prefix + "n:*")
    assert len(leases) == 2
    # Redis itself drops a lease this long after its last renewal.
    assert all(0 < client.pttl(lease) <= 1000 for lease in leases)
    doomed.kill()
    wait_until(lambda: not visible(fleet, doomed), "the killed node out of the answers")
    assert visible(fleet, survivor)
    client.close()
    fleet.close()


def fetcher_tier(cache: Any) -> Any:
    return cache.manager.tiers[0]


def test_p2p_asks_only_the_nodes_the_index_names(
    indexed_fleet: tuple[str, list[PeerProcess]], redis_server: RedisServer
) -> None:
    prefix, peers = indexed_fleet
    addresses = [peer.address for peer in peers]
    index = index_section(redis_server, prefix, node="fetcher")
    with node(addresses, chunk_kib=CHUNK_KIB, index=index, listen=None) as cache:
        tier = fetcher_tier(cache)
        for peer in peers:
            assert cache.cached_prefix(peer.tokens) == len(peer.tokens)
            assert np.array_equal(load_all(cache, peer.tokens), peer.data)
        assert tier.backend.index_batches >= len(peers) and tier.backend.index_fallbacks == 0
        # Each batch asked one node (the holder), never all four.
        assert tier.backend.peer_queries <= tier.backend.index_batches
    # The same fetches without an index ask every peer per batch.
    with node(addresses, chunk_kib=CHUNK_KIB, listen=None) as cache:
        tier = fetcher_tier(cache)
        for peer in peers:
            assert cache.cached_prefix(peer.tokens) == len(peer.tokens)
        assert tier.backend.peer_queries >= len(peers) * len(peers)


def test_with_the_index_down_p2p_asks_every_peer(
    indexed_fleet: tuple[str, list[PeerProcess]],
) -> None:
    _, peers = indexed_fleet
    down = {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "max_backoff_s": 0.1}
    addresses = [peer.address for peer in peers]
    with node(addresses, chunk_kib=CHUNK_KIB, index=down, listen=None) as cache:
        for peer in peers:
            assert cache.cached_prefix(peer.tokens) == len(peer.tokens)
            assert np.array_equal(load_all(cache, peer.tokens), peer.data)
        tier = fetcher_tier(cache)
        assert tier.backend.index_fallbacks >= 1 and tier.backend.index_batches == 0


def test_a_forged_or_stale_entry_costs_a_miss(
    indexed_fleet: tuple[str, list[PeerProcess]], redis_server: RedisServer
) -> None:
    prefix, [holder, liar, *_] = indexed_fleet
    fleet = reader(redis_server, prefix)
    # Someone with write access claims the liar holds the holder's chunks,
    # and an address outside the configured peers holds them too.
    forged = [(key, "cpu") for key in holder.keys]
    fleet.index.publish("f0f0f0f0f0f0f0f0", NodeLease("forger", liar.address), forged, [])
    fleet.index.publish("e0e0e0e0e0e0e0e0", NodeLease("stranger", "127.0.0.1:9"), forged, [])
    index = index_section(redis_server, prefix, node="fetcher")
    with node([liar.address], chunk_kib=CHUNK_KIB, index=index, listen=None) as cache:
        assert cache.cached_prefix(holder.tokens) == 0  # the liar said no: a miss
        assert fetcher_tier(cache).backend.peer_queries >= 1
    fleet.index.withdraw("f0f0f0f0f0f0f0f0")
    fleet.index.withdraw("e0e0e0e0e0e0e0e0")
    fleet.close()


def test_a_frozen_index_costs_one_bounded_wait_then_every_peer_is_asked(
    indexed_fleet: tuple[str, list[PeerProcess]], own_redis_server: RedisServer
) -> None:
    _, peers = indexed_fleet
    index = {"type": "redis", "url": own_redis_server.url, "max_backoff_s": 0.1}
    addresses = [peer.address for peer in peers]
    with node(addresses, chunk_kib=CHUNK_KIB, index=index, listen=None) as cache:
        own_redis_server.pause()  # accepts connections, answers nothing
        try:
            for peer in peers:
                assert cache.cached_prefix(peer.tokens) == len(peer.tokens)
                assert np.array_equal(load_all(cache, peer.tokens), peer.data)
            tier = fetcher_tier(cache)
            assert tier.backend.index_fallbacks >= len(peers) and tier.backend.index_batches == 0
        finally:
            own_redis_server.resume()
