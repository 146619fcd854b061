"""The ``redis`` tier against real redis-server processes on loopback."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, LookupResult
from kvtier.config import load_config
from kvtier.errors import BackendUnavailableError, ConfigError, MissingDependencyError
from kvtier.integrity import HEADER_BYTES, frame
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.testing.outages import FaultProxy, recover, wait_until
from kvtier.tiers.base import Lookup, LookupContext, TransferJob
from kvtier.tiers.redis import RedisBackend, RedisTier
from kvtier.tiers.remote import RemoteTier
from tests.support.cache_tiers import backend_of
from tests.support.needs import need_redis_server
from tests.support.servers import LOOPBACK, RedisClusterServers, RedisServer, ServerError, free_port
from tests.tiers.p2p.certs import PKI, make_pki
from tests.tiers.remote.damaged_values import (
    FIELDS,
    Damage,
    assert_no_damaged_value_served,
    flipped,
)
from tests.tiers.remote.drops import an_expiry_is_heard, watched
from tests.tiers.remote.outage import on_fake_clock, outage_harness


def raw_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


class TestRedisTierContract(TierContractTests[RedisTier]):
    persistent = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer, key_prefix: str) -> None:
        self.url = redis_server.url
        self.prefix = key_prefix

    def make_config(self) -> dict[str, Any]:
        return {"type": "redis", "url": self.url, "key_prefix": self.prefix}


class TestRedisTierContractOverUnixSocket(TestRedisTierContract):
    # Loads read replies off the connection's socket themselves: over a
    # unix socket as over TCP.
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer, key_prefix: str) -> None:
        self.url = redis_server.unix_url
        self.prefix = key_prefix


class TestRedisTierContractHearingDrops(TestRedisTierContract):
    # A subscriber per server beside the workers changes nothing they promise.
    def make_config(self) -> dict[str, Any]:
        return {**super().make_config(), "watch_evictions": True}


class _TlsRedisServer(RedisServer):
    """``redis-server`` also listening for TLS, with a certificate of ``pki``'s CA."""

    def __init__(self, pki: PKI) -> None:
        self.pki = pki
        super().__init__()

    def _pick_ports(self) -> None:
        super()._pick_ports()
        self.tls_port = free_port()

    @property
    def tls_url(self) -> str:
        return f"rediss://{LOOPBACK}:{self.tls_port}/0?ssl_ca_certs={self.pki.ca}"

    def _command(self) -> list[str]:
        return [
            *super()._command(),
            "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(self.pki.node.cert),
            "--tls-key-file", str(self.pki.node.key),
            "--tls-ca-cert-file", str(self.pki.ca),
            "--tls-auth-clients", "no",
        ]  # fmt: skip


@pytest.fixture(scope="module")
def tls_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_TlsRedisServer]:
    with _TlsRedisServer(make_pki(tmp_path_factory.mktemp("pki"))) as server:
        yield server


class TestRedisTierContractOverTls(TestRedisTierContract):
    # Loads read replies off the connection's socket themselves: through TLS
    # that is the SSL socket, which must decrypt what they receive.
    @pytest.fixture(autouse=True)
    def _server(self, tls_redis_server: _TlsRedisServer, key_prefix: str) -> None:
        self.url = tls_redis_server.tls_url
        self.prefix = key_prefix


class TestRedisClusterTierContract(TierContractTests[RedisTier]):
    persistent = True

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisClusterServers, key_prefix: str) -> None:
        self.nodes = redis_cluster.startup_nodes
        self.prefix = key_prefix

    def make_config(self) -> dict[str, Any]:
        return {"type": "redis", "startup_nodes": self.nodes, "key_prefix": self.prefix}


def test_drops_are_heard_over_tls(tls_redis_server: _TlsRedisServer, key_prefix: str) -> None:
    harness, removed = watched({"url": tls_redis_server.tls_url}, key_prefix)
    try:
        assert removed == [an_expiry_is_heard(harness, removed, tls_redis_server.url)]
    finally:
        harness.close()


def test_cluster_spreads_chunks_over_every_node(
    redis_cluster: RedisClusterServers, key_prefix: str
) -> None:
    url = f"redis://{redis_cluster.startup_nodes[0]}"
    harness = TierHarness(
        {"type": "redis", "url": url, "cluster": True, "key_prefix": key_prefix}, small_layout()
    )
    try:
        keys = harness.keys(24)
        data = harness.fill(range(24))
        assert harness.store(keys, list(range(24))).success
        # Each pipeline mixed keys of many slots; every node got its share.
        held = [
            len([k for k in _scan(node.url) if k.startswith(key_prefix.encode())])
            for node in redis_cluster.nodes
        ]
        assert sum(held) == 24 and all(count > 0 for count in held)
        harness.buffer.array[:24] = 0
        assert harness.load(keys, list(range(24))).success
        np.testing.assert_array_equal(harness.buffer.array[:24], data)
    finally:
        harness.close()


@pytest.mark.parametrize("damage", ["flipped", "foreign", "torn"])
def test_a_damaged_value_received_in_its_slot_never_reaches_the_engine(
    redis_server: RedisServer, key_prefix: str, damage: str
) -> None:
    """Values are received in their slots and verified there: a damaged one
    ends the prefix a fresh cache finds, and its bytes reach no output."""
    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 12 * layout.slot_bytes,
        "secondary_tiers": [{"type": "redis", "url": redis_server.url, "key_prefix": key_prefix}],
    }
    tokens = list(range(500, 524))
    data = np.random.default_rng(3).integers(0, 256, (6, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as writer:
        assert writer.store(tokens, data) == 6
        writer.drain()
        tier = writer.manager.tiers[0]
        assert isinstance(tier, RemoteTier) and tier.store.receives_into
        names = [tier.store_name(k) for k in writer.keys(tokens)]
    client = raw_client(redis_server.url)
    value = client.get(names[3])
    if damage == "flipped":
        client.set(
            names[3],
            value[:HEADER_BYTES] + bytes([value[HEADER_BYTES] ^ 1]) + value[HEADER_BYTES + 1 :],
        )
    elif damage == "foreign":
        other = small_layout(chunk_tokens=4, model_id="another-model")
        client.set(
            names[3],
            frame(other.namespace, bytes.fromhex(names[3].rsplit(":", 1)[1]), data[3].tobytes()),
        )
    else:
        client.set(names[3], value[: len(value) // 2])
    with KVCache(config, layout) as cache:
        out = np.zeros_like(data)
        assert cache.load_prefix(tokens, out) == 3 * 4
        np.testing.assert_array_equal(out[:3], data[:3])
        assert not out[3:].any()
        tier = cache.manager.tiers[0]
        assert tier.stats.corrupt_chunks == 1
        assert not client.exists(names[3])
        # Asked again, the prefix still ends there: the slot was never published.
        out[:] = 0
        assert cache.load_prefix(tokens, out) == 3 * 4
        assert not out[3:].any()
    client.close()


def test_a_read_into_slots_stalled_mid_value_gives_up_at_its_deadline(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """The job is answered while the server still holds the rest of a value,
    and what arrives later never lands in the slot, given to another chunk."""
    with FaultProxy(redis_server.port) as proxy:
        harness = TierHarness(
            {
                "type": "redis",
                "url": f"redis://{LOOPBACK}:{proxy.port}/0",
                "key_prefix": key_prefix,
                "deadline_s": 0.3,
                "socket_timeout_s": 60,
                "retries": 0,
            },
            small_layout(),
            tier_class=RedisTier,
            call_timeout_s=30,  # far below socket_timeout_s: a read not cut fails here
        )
        try:
            [key] = harness.keys(1)
            stored = harness.fill([0])
            assert harness.store([key], [0]).success
            client = backend_of(harness.tier, RedisBackend).client
            client.connection_pool.disconnect()  # next: a held connection
            proxy.cut_after = 1000  # the reply's start, then nothing until released
            proxy.set_mode("hold")
            result = harness.load([key], [1])
            assert not result.success
            harness.buffer.array[1] = 7  # the slot's next chunk
            proxy.set_mode("forward")  # the rest of the value arrives, too late
            harness.drain()
            assert (harness.buffer.array[1] == 7).all()
            tier = harness.tier
            assert tier.stats.deadline_misses == 1
            # Nothing answered in time: the breaker opened. Its probe closes it.
            wait_until(lambda: tier.guards.admit() or tier.breaker.closed, what="closed again")
            assert harness.load([key], [2]).success  # a new connection serves it whole
            np.testing.assert_array_equal(harness.buffer.array[2], stored[0])
        finally:
            harness.close()


@pytest.mark.parametrize("timer_first", [False, True], ids=["read-cut-first", "timer-first"])
def test_a_read_cut_by_its_own_clock_is_the_jobs_missed_deadline(
    redis_server: RedisServer, key_prefix: str, timer_first: bool
) -> None:
    """The read and the deadline's timer keep one deadline on two clocks:
    whichever reaches it first, the job is answered and its miss counted once."""
    harness = TierHarness(
        {"type": "redis", "url": redis_server.url, "key_prefix": key_prefix, "deadline_s": 30},
        small_layout(),
        tier_class=RedisTier,
        call_timeout_s=10,  # far below deadline_s: only the cut read can answer the job
    )
    try:
        tier = harness.tier
        [key] = harness.keys(1)
        harness.fill([0])
        assert harness.store([key], [0]).success
        read = tier.backend.get_into
        answer_late = tier.guards.answer_late
        states: list[Any] = []

        def cut(names: Any, headers: Any, payloads: Any, deadline: float, touch: Any) -> Any:
            if timer_first:  # the timer answers while the read holds the slots
                answer_late(states[0].job.job_id)
            return read(names, headers, payloads, time.monotonic(), touch)  # its clock: past

        tier.backend.get_into = cut  # type: ignore[method-assign]
        bound_job = tier.guards.bound_job

        def bound(state: Any) -> None:
            states.append(state)
            bound_job(state)

        tier.guards.bound_job = bound  # type: ignore[method-assign]
        harness.buffer.array[1] = 7
        result = harness.load([key], [1])
        assert not result.success and not result.succeeded
        assert (harness.buffer.array[1] == 7).all()
        assert tier.stats.deadline_misses == 1
        assert tier.stats.backend_errors == 0  # not a failed call: the deadline ended it
    finally:
        harness.close()


def test_every_read_into_slots_is_bounded_by_its_jobs_deadline(
    redis_server: RedisServer, key_prefix: str
) -> None:
    harness = TierHarness(
        {"type": "redis", "url": redis_server.url, "key_prefix": key_prefix, "io_threads": 4},
        small_layout(),
        tier_class=RedisTier,
    )
    try:
        tier = harness.tier
        keys = harness.keys(16)
        harness.fill(range(16))
        assert harness.store(keys, list(range(16))).success
        reads: list[tuple[float, float]] = []  # (when, its deadline)
        read = tier.backend.get_into

        def recording(*args: Any) -> Any:
            reads.append((time.monotonic(), args[3]))
            return read(*args)

        tier.backend.get_into = recording  # type: ignore[method-assign, assignment]  # called positionally
        bound_job = tier.guards.bound_job

        def slow_bound_job(state: Any) -> None:  # as on a loaded machine
            time.sleep(0.05)
            bound_job(state)

        tier.guards.bound_job = slow_bound_job  # type: ignore[method-assign]
        for _ in range(3):
            assert harness.load(keys, list(range(16, 32))).success
        assert reads and all(
            when < deadline <= when + tier.options.deadline_s for when, deadline in reads
        )
    finally:
        harness.close()


def _scan(url: str) -> list[bytes]:
    return list(raw_client(url).scan_iter(count=1000))


def test_corrupt_torn_and_foreign_values_are_never_served(
    redis_server: RedisServer, key_prefix: str
) -> None:
    harness = TierHarness(
        {"type": "redis", "url": redis_server.url, "key_prefix": key_prefix},
        small_layout(),
        tier_class=RedisTier,
    )
    client = raw_client(redis_server.url)
    try:
        keys = harness.keys(4)
        harness.fill(range(4))
        assert harness.store(keys, [0, 1, 2, 3]).success
        tier = harness.tier
        names = [tier.store_name(k) for k in keys]
        flipped = bytearray(client.get(names[0]))
        flipped[HEADER_BYTES + 100] ^= 0x01
        client.set(names[0], bytes(flipped))
        client.set(names[1], client.get(names[1])[:-1000])  # torn write
        foreign = small_layout(model_id="another-model")
        client.set(names[2], frame(foreign.namespace, keys[2], harness.buffer.array[2].tobytes()))
        harness.buffer.array[8:12] = 7
        result = harness.load(keys, [8, 9, 10, 11])
        assert not result.success
        assert result.succeeded == frozenset([keys[3]])
        # Bad values were not served, and were deleted and counted. Values are
        # received in their slots and verified there: a flipped or foreign one
        # fails there, in a slot its failure leaves unpublished; a torn one, of
        # the wrong length, is never received at all.
        assert (harness.buffer.array[9] == 7).all()
        np.testing.assert_array_equal(harness.buffer.array[11], harness.buffer.array[3])
        assert tier.stats.corrupt_chunks == 3
        assert client.exists(*names[:3]) == 0
        assert [harness.lookup(k) for k in keys] == [Lookup.MISS] * 3 + [Lookup.HIT]
    finally:
        harness.close()


LAYOUT_4 = small_layout(chunk_tokens=4)


def stored_but_the_last(url: str, key_prefix: str, chunks: int) -> tuple[dict[str, Any], list[int]]:
    """A cache config over the server at ``url`` and the tokens of ``chunks``
    chunks of 4, all but the last stored there by a writer that closed."""
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 2 * chunks * LAYOUT_4.slot_bytes,
        "secondary_tiers": [{"type": "redis", "url": url, "key_prefix": key_prefix}],
    }
    tokens = list(range(4 * chunks))
    stored = chunks - 1
    with KVCache(config, LAYOUT_4) as writer:
        rows = np.ones((stored, LAYOUT_4.slot_bytes), np.uint8)
        assert writer.store(tokens[: 4 * stored], rows) == stored
        writer.drain()
    return config, tokens


def test_the_documented_hit_rate_counts_each_chunk_once(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # A fresh cache checks the server first: its lookup waits, asking again
    # about the chunks still pending, and every answer counts as a lookup.
    # Each chunk found counts one hit (its promotion starts, and it is not
    # asked about again), and so does the miss past them (the request does
    # not ask about it again): hits / (hits + misses) (docs/metrics.md) is
    # 64 / 65 here, where hits / lookups is at most a half.
    config, tokens = stored_but_the_last(redis_server.url, key_prefix, chunks=65)
    with KVCache(config, LAYOUT_4) as cache:
        assert cache.cached_prefix(tokens) == 4 * 64

        def total(name: str) -> float:
            labels = {"tier": "0", "tier_type": "redis"}
            sample = cache.metrics.registry.get_sample_value(f"kvtier_tier_{name}_total", labels)
            assert sample is not None
            return sample

        hits, misses, pending = total("hits"), total("misses"), total("pending")
        assert (hits, misses) == (64, 1) and pending >= 65
        assert total("lookups") == hits + misses + pending
        assert hits / (hits + misses) == 64 / 65 and hits / total("lookups") <= 0.5


def test_a_miss_answers_the_next_requests_without_another_check(
    own_redis_server: RedisServer, key_prefix: str
) -> None:
    # The next requests for a prompt whose new tail a request found missing
    # (or that request asked again at each step, blocked on memory) get the
    # MISS at once: not PENDING, a step later, after another EXISTS.
    import redis

    config, tokens = stored_but_the_last(own_redis_server.url, key_prefix, chunks=5)
    server = redis.Redis.from_url(own_redis_server.url)
    with KVCache(config, LAYOUT_4) as cache:
        assert cache.cached_prefix(tokens) == 16
        tier = cache.manager.tiers[0]
        assert isinstance(tier, RedisTier)
        tier.checks.miss_answer_s = 3600.0  # no wall clock in the test: it has not passed
        server.config_resetstat()
        for request in ("b", "c"):
            assert cache.probe(cache.keys(tokens), request_id=request) == LookupResult(4, False)
            cache.end_request(request)
        assert "cmdstat_exists" not in server.info("commandstats")
        assert tier.stats.misses == 3  # one per request
        tier.checks.miss_answer_s = 0.0  # it has passed: the next lookup checks again
        assert cache.probe(cache.keys(tokens), request_id="d").pending
        cache.end_request("d")
    server.close()


def test_a_cold_prefix_in_several_jobs_comes_back_byte_exact_through_load_prefix(
    redis_server: RedisServer, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Promotion jobs of 4 chunks (PROMOTION_JOB_BYTES), each copied out by
    # load_prefix as it lands: every chunk in its own row, none twice.
    from kvtier import manager as manager_module

    monkeypatch.setattr(manager_module, "PROMOTION_JOB_BYTES", 4 * LAYOUT_4.slot_bytes)
    config, tokens = stored_but_the_last(redis_server.url, key_prefix, chunks=17)
    data = np.random.default_rng(3).integers(0, 256, (16, LAYOUT_4.slot_bytes), np.uint8)
    with KVCache(config, LAYOUT_4) as writer:  # the 16 chunks again, with distinct bytes
        writer.manager.tiers[0].discard(writer.keys(tokens)[:16])
        assert writer.store(tokens[:64], data) == 16
        writer.drain()
    with KVCache(config, LAYOUT_4) as cache:
        tier = cache.manager.tiers[0]
        sizes: list[int] = []
        submit = tier.submit_load

        def counted(job: TransferJob) -> None:
            sizes.append(len(job.keys))
            submit(job)

        monkeypatch.setattr(tier, "submit_load", counted)
        out = np.zeros((17, LAYOUT_4.slot_bytes), np.uint8)
        assert cache.load_prefix(tokens, out) == 64
        assert cache.manager.primary.busy_counts()["pinned"] == 0
    assert sum(sizes) == 16 and max(sizes) <= 4
    assert np.array_equal(out[:16], data) and not out[16].any()


def test_server_outage_turns_into_misses_and_recovers(
    own_redis_server: RedisServer, key_prefix: str
) -> None:
    server = own_redis_server
    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 16 * layout.slot_bytes,
        "secondary_tiers": [
            {
                "type": "redis",
                "url": "",
                "key_prefix": key_prefix,
                "retries": 0,
                "socket_timeout_s": 1.0,
                "connect_timeout_s": 1.0,
            }
        ],
    }
    tokens = list(range(16))
    data = np.random.default_rng(3).integers(0, 256, (4, layout.slot_bytes), dtype=np.uint8)
    config["secondary_tiers"][0]["url"] = server.url  # type: ignore[index]
    with KVCache(config, layout) as cache:
        tier, clock = on_fake_clock(cache.manager.tiers[0], RedisTier)
        server.stop()
        assert cache.store(tokens, data) == 4  # the primary tier takes them
        cache.drain()
        assert tier.stats.store_failures == 4
        assert tier.stats.backend_errors >= 1
        cache.manager.reset()
        assert cache.cached_prefix(tokens) == 0  # a miss, not an error
        assert tier.stats.misses >= 1
        server.start()  # same port, empty
        assert recover(tier, clock)
        assert cache.store(tokens, data) == 4
        cache.drain()
        assert tier.stats.chunks_stored == 4
        cache.manager.reset()
        assert cache.cached_prefix(tokens) == 16
        out = np.zeros_like(data)
        cache.load(tokens, 16, out)
        np.testing.assert_array_equal(out, data)


def test_a_hung_server_times_out_and_recovers(
    own_redis_server: RedisServer, key_prefix: str
) -> None:
    server = own_redis_server
    with outage_harness(
        {
            "type": "redis",
            "url": server.url,
            "key_prefix": key_prefix,
            "retries": 0,
            "socket_timeout_s": 0.5,
        },
        RedisTier,
    ) as (harness, tier, clock):
        keys = harness.keys(3)
        harness.fill(range(3))
        assert harness.store(keys, [0, 1, 2]).success
        server.pause()
        # Without timeouts these would wait for ever; run_job would give up instead.
        assert not harness.load(keys, [3, 4, 5]).success
        assert harness.lookup(keys[0]) is Lookup.MISS
        assert not harness.store(harness.keys(1), [6]).success
        assert tier.backend_down
        assert [check.ok for check in tier.health()] == [False]
        assert [m.value for m in tier.metrics() if m.name == "backend_up"] == [0.0]
        server.resume()
        assert recover(tier, clock)
        result = harness.load(keys, [3, 4, 5])
        assert result.success
        np.testing.assert_array_equal(harness.buffer.array[3:6], harness.buffer.array[0:3])
        assert not harness.tier.backend_down
        assert [check.ok for check in harness.tier.health()] == [True]


def test_ttl_is_set_on_store_and_refreshed_on_read(
    redis_server: RedisServer, key_prefix: str
) -> None:
    harness = TierHarness(
        {"type": "redis", "url": redis_server.url, "key_prefix": key_prefix, "ttl_s": 300},
        small_layout(),
        tier_class=RedisTier,
    )
    client = raw_client(redis_server.url)
    try:
        [key] = harness.keys(1)
        harness.fill([0])
        assert harness.store([key], [0]).success
        name = harness.tier.store_name(key)
        assert 0 < client.pttl(name) <= 300_000
        client.pexpire(name, 5_000)
        assert harness.load([key], [1]).success
        assert client.pttl(name) > 5_000
    finally:
        harness.close()


def test_unreachable_server_fails_at_start_naming_it(redis_server: RedisServer) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(BackendUnavailableError, match=r"127\.0\.0\.1") as caught:
        TierHarness({"type": "redis", "url": url, "connect_timeout_s": 1.0}, small_layout())
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "exactly one of 'url'"),
        ({"url": "redis://h:1", "startup_nodes": ["h:1"]}, "exactly one of 'url'"),
        ({"startup_nodes": ["nohostport"]}, "not host:port"),
        ({"startup_nodes": ["h:99999"]}, "out of range"),
        ({"startup_nodes": ["::1:7000"]}, "IPv6 address in brackets"),
        ({"startup_nodes": ["no de:7000"]}, "not a host name"),
        ({"startup_nodes": ["-node:7000"]}, "not a host name"),
        ({"url": " redis://h:1"}, "whitespace"),
        ({"url": "redis:// h:1"}, "whitespace"),
        ({"url": "redis://h:1?db=x"}, "query option is invalid"),
        ({"url": "redis://h:1/٣"}, "database must be a number"),
        ({"url": "redis://h:1/0/1"}, "database must be a number"),
        ({"url": "redis://rédis:1"}, "not ASCII"),
        ({"url": "redis://"}, "names no host"),
        ({"url": "redis://h:1", "io_threads": 8, "max_connections": 4}, "below io_threads"),
        ({"url": "redis://h:1", "ttl_s": 0}, "greater than 0"),
        ({"url": "redis://h:1", "ttl_s": float("inf")}, "less than or equal to"),
        ({"url": "redis://h:1", "ttl_s": 1e300}, "less than or equal to"),
        ({"url": "redis://h:1", "socket_timeout_s": float("inf")}, "less than or equal to"),
        ({"url": "redis://h:1", "connect_timeout_s": 1e300}, "less than or equal to"),
        ({"url": "redis://h:1", "startup_timeout_s": float("inf")}, "less than or equal to"),
        (
            {"url": "redis://h:1", "breaker_backoff_s": 1, "breaker_max_backoff_s": float("inf")},
            "less than or equal to",
        ),
        ({"url": "redis://h:1", "key_prefx": "x"}, "did you mean 'key_prefix'"),
    ],
)
def test_bad_options_fail_validation_with_the_path(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_config({"secondary_tiers": [{"type": "redis", **options}]})
    assert "secondary_tiers[0]" in str(caught.value)


def test_password_is_secret(redis_server: RedisServer) -> None:
    config = load_config(
        {"secondary_tiers": [{"type": "redis", "url": redis_server.url, "password": "s3cret"}]}
    )
    assert "s3cret" not in repr(config.secondary_tiers[0].options)


def test_missing_client_library_raises_missing_dependency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(MissingDependencyError, match=r"kvtier\[redis\]"):
        TierHarness({"type": "redis", "url": "redis://127.0.0.1:1/0"}, small_layout())


def _fill_up(server: RedisServer) -> Callable[[], object]:
    """Every write now answers OOM (Redis's default policy, noeviction, when full)."""
    server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    server.command("CONFIG", "SET", "maxmemory", "1")
    return lambda: server.command("CONFIG", "SET", "maxmemory", "0")


def _read_only_user(server: RedisServer) -> Callable[[], object]:
    """Every write now answers NOPERM: the tier's ACL user may only read."""
    server.command("ACL", "SETUSER", "kvtier", "-@write")
    return lambda: server.command("ACL", "SETUSER", "kvtier", "+@write")


@pytest.mark.parametrize("refuse", [_fill_up, _read_only_user], ids=["full", "read-only-user"])
def test_a_server_refusing_writes_is_no_outage_and_serves_what_it_holds(
    own_redis_server: RedisServer,
    key_prefix: str,
    refuse: Callable[[RedisServer], Callable[[], object]],
) -> None:
    server = own_redis_server
    server.command("ACL", "SETUSER", "kvtier", "on", ">kvtier-secret", "~*", "&*", "+@all")
    options = {"username": "kvtier", "password": "kvtier-secret", "breaker_failures": 2}
    harness = TierHarness(
        {"type": "redis", "url": server.url, "key_prefix": key_prefix, **options},
        small_layout(),
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    try:
        keys = harness.keys(4)
        stored = harness.fill(range(4))
        assert harness.store(keys[:2], [0, 1]).success
        undo = refuse(server)
        for _ in range(3):  # past breaker_failures: still no outage
            result = harness.store(keys[2:], [2, 3])
            assert not result.success and result.succeeded == frozenset()
            assert tier.breaker.closed
        assert tier.stats.refused_stores == 6
        assert tier.stats.backend_errors == 6
        assert tier.stats.backend_outages == 0
        assert [m.value for m in tier.metrics() if m.name == "backend_up"] == [1.0]
        # What the server holds is still found and served, byte-exact.
        assert [harness.lookup(key) for key in keys[:2]] == [Lookup.HIT, Lookup.HIT]
        assert harness.load(keys[:2], [4, 5]).success
        np.testing.assert_array_equal(harness.buffer.array[4:6], stored[:2])
        undo()
        assert harness.store(keys[2:], [2, 3]).success
        assert harness.load(keys[2:], [6, 7]).success
        np.testing.assert_array_equal(harness.buffer.array[6:8], stored[2:])
    finally:
        harness.close()


def test_skip_existing_sends_only_missing_chunks_and_refreshes_ttl(
    redis_server: RedisServer, key_prefix: str
) -> None:
    harness = TierHarness(
        {
            "type": "redis",
            "url": redis_server.url,
            "key_prefix": key_prefix,
            "skip_existing": True,
            "ttl_s": 300,
        },
        small_layout(),
        tier_class=RedisTier,
    )
    client = raw_client(redis_server.url)
    try:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys[:1], [0]).success
        held = harness.tier.store_name(keys[0])
        client.set(held, b"marker", px=5_000)
        assert harness.store(keys, [0, 1]).success
        assert client.get(held) == b"marker"  # held already: not sent again
        assert client.pttl(held) > 5_000  # but its life was extended
        harness.buffer.array[2] = 0
        assert harness.load(keys[1:], [2]).success
        np.testing.assert_array_equal(harness.buffer.array[2], harness.buffer.array[1])
    finally:
        harness.close()


def test_test_server_moves_to_fresh_ports_when_its_port_is_taken() -> None:
    need_redis_server()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = RedisServer()
        server.port = taken  # as if another process bound it after free_port()
        with server:
            assert server.port != taken
            assert server.command("PING").startswith(b"+PONG")
        stubborn = RedisServer()
        stubborn.start_attempts = 1
        stubborn.port = taken
        with pytest.raises(ServerError, match=r"(?s)exited with .*Address already in use"):
            stubborn.start()
        stubborn.close()


def test_a_value_of_the_wrong_type_is_a_corrupt_chunk_not_an_outage(
    redis_server: RedisServer, key_prefix: str
) -> None:
    harness = TierHarness(
        {"type": "redis", "url": redis_server.url, "key_prefix": key_prefix, "ttl_s": 300},
        small_layout(),
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    client = raw_client(redis_server.url)
    try:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        name = tier.store_name(keys[0])
        client.delete(name)
        client.rpush(name, b"not", b"a", b"chunk")
        for _ in range(3):  # as often as breaker_failures: still no outage
            harness.buffer.array[2:4] = 5
            result = harness.load(keys, [2, 3])
            assert result.succeeded == frozenset([keys[1]])
            assert (harness.buffer.array[2] == 5).all()
            client.delete(name)
            client.rpush(name, b"again")
        assert tier.stats.corrupt_chunks == 3
        assert tier.stats.backend_errors == 0
        assert tier.breaker.closed
        assert [m.value for m in tier.metrics() if m.name == "backend_up"] == [1.0]
        client.delete(name)
        client.hset(name, "field", "value")
        assert not harness.load(keys[:1], [2]).success
        assert client.exists(name) == 0  # deleted, like any corrupt chunk
        assert harness.lookup(keys[0]) is Lookup.MISS
    finally:
        harness.close()


def test_per_item_check_errors_never_flap_the_outage_state(
    own_redis_server: RedisServer, key_prefix: str
) -> None:
    server = own_redis_server
    server.command("ACL", "SETUSER", "kvtier", "on", ">kvtier-secret", "~*", "&*", "+@all")
    options = {"username": "kvtier", "password": "kvtier-secret"}
    harness = TierHarness(
        {"type": "redis", "url": server.url, "key_prefix": key_prefix, **options},
        small_layout(),
    )
    tier = harness.tier
    assert isinstance(tier, RedisTier)
    changes: list[object] = []
    tier.breaker.on_change = lambda old, new, why: changes.append(new)
    try:
        keys = harness.keys(3)
        harness.fill([0])
        assert harness.store(keys[:1], [0]).success
        # The user may no longer touch keys[1]: its EXISTS alone answers NOPERM.
        allowed = [f"~{tier.store_name(key)}" for key in (keys[0], keys[2])]
        server.command("ACL", "SETUSER", "kvtier", "resetkeys", *allowed)
        ctx = LookupContext()
        answers = []
        for _ in range(tier.check_attempts + 1):
            answers.append([tier.lookup(k, ctx) for k in keys])
            tier.on_step_end()
            wait_until(lambda: not tier.checks.checking, what="checks done")
        assert answers[0] == [Lookup.PENDING] * 3
        assert answers[1] == [Lookup.HIT, Lookup.PENDING, Lookup.MISS]
        # The key the server refuses is asked again, then given up as a miss.
        assert [a[1] for a in answers] == [Lookup.PENDING] * 3 + [Lookup.MISS]
        assert tier.stats.backend_errors == tier.check_attempts
        assert changes == [] and tier.breaker.closed
        # Checked alone, past the breaker's count of failures: still answered "no".
        for _ in range(tier.options.breaker_failures + 1):
            assert tier.store.contains_many(keys[1:2]) == [None]
        assert tier.stats.backend_errors == tier.check_attempts + tier.options.breaker_failures + 1
        assert changes == [] and tier.breaker.closed
    finally:
        harness.close()


@pytest.mark.parametrize(
    "url",
    [
        "localhost:6379",
        "not a url",
        "redis://[::1",
        "http://h:6379/0",
        "redis://h:1/db",
        "redis://",
    ],
)
def test_a_malformed_url_fails_when_the_config_loads(url: str) -> None:
    layout = small_layout()
    config = {"secondary_tiers": [{"type": "memory"}, {"type": "redis", "url": url}]}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\]\.url: .*redis://") as caught:
        KVCache(config, layout)
    assert "write it as redis://" in str(caught.value)


def test_a_malformed_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"secondary_tiers": [{"type": "redis", "url": "redis://u:hunter2@[::1"}]})
    assert "hunter2" not in str(caught.value) and "***" in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0",
        "rediss://user:pw@h:6380/2",
        "redis://[::1]:6379",
        "unix:///run/r.sock",
        "redis://h:6379/0?socket_keepalive=true",
        "redis://redis.cache.internal.:6379",
        "redis://kv_cache:6379",  # a container service name
    ],
)
def test_well_formed_urls_load(url: str) -> None:
    load_config({"secondary_tiers": [{"type": "redis", "url": url}]})


def test_one_failing_cluster_node_costs_its_chunks_only(
    redis_cluster: RedisClusterServers, key_prefix: str
) -> None:
    harness = TierHarness(
        {"type": "redis", "startup_nodes": redis_cluster.startup_nodes, "key_prefix": key_prefix},
        small_layout(),
        num_slots=48,
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    full = redis_cluster.nodes[0]
    try:
        full.command("CONFIG", "SET", "maxmemory", "1")  # its writes answer OOM
        keys = harness.keys(24)
        harness.fill(range(24))
        for _ in range(tier.breaker.failures + 1):
            result = harness.store(keys, list(range(24)))
            assert 0 < len(result.succeeded) < 24  # the other nodes took theirs
        assert tier.breaker.closed and tier.stats.backend_outages == 0
        failed_per_round = 24 - len(result.succeeded)
        assert tier.stats.backend_errors == failed_per_round * (tier.breaker.failures + 1)
        held = [k for k in keys if k in result.succeeded]
        loaded = harness.load(held, list(range(24, 24 + len(held))))
        assert loaded.success
        rows = [keys.index(k) for k in held]
        np.testing.assert_array_equal(
            harness.buffer.array[24 : 24 + len(held)], harness.buffer.array[rows]
        )
    finally:
        full.command("CONFIG", "SET", "maxmemory", "0")
        harness.close()


def test_a_frozen_seed_never_holds_up_a_cluster_start(key_prefix: str) -> None:
    """redis-py tries its seeds one by one, in a random order, and waits
    socket_timeout_s (5 s here) on a frozen one: kvtier asks them all at once
    and seeds it with those that answer, so no start waits for the frozen one."""
    need_redis_server()
    with RedisClusterServers() as cluster:
        # Not the first primary: redis-py asks it for its command table
        # whatever the seeds (docs/shared-tiers.md).
        frozen = cluster.nodes[-1]
        entry: dict[str, Any] = {"type": "redis", "startup_nodes": cluster.startup_nodes}
        entry |= {"key_prefix": key_prefix, "startup_timeout_s": 1}
        frozen.pause()
        try:
            for _ in range(5):  # each start in an order of its own
                TierHarness(entry, small_layout()).close()
        finally:
            frozen.resume()


@pytest.mark.parametrize("user", ["tier", "index"])
def test_a_cluster_client_is_seeded_with_the_seeds_that_answer(
    monkeypatch: pytest.MonkeyPatch, user: str
) -> None:
    """The tier and the cluster index alike; an IPv6 seed keeps its address."""
    import redis.cluster

    from kvtier.fleet.redis import RedisIndexOptions
    from kvtier.tiers import redis as redis_module

    def ping(connection: Any) -> None:
        if connection.host != "::1":
            raise ConnectionError(f"refused: {connection.host}")

    seeded: list[list[tuple[str, int]]] = []

    def cluster(startup_nodes: list[Any], **settings: Any) -> None:
        seeded.append([(node.host, node.port) for node in startup_nodes])

    monkeypatch.setattr(redis_module, "_ping", ping)
    monkeypatch.setattr(redis.cluster, "RedisCluster", cluster)
    seeds = ["10.0.0.5:7000", "[::1]:7001", "10.0.0.6:7002"]
    options_class = redis_module.RedisTierOptions if user == "tier" else RedisIndexOptions
    redis_module.redis_client(options_class(startup_nodes=seeds))
    assert seeded == [[("::1", 7001)]]


def test_a_cluster_probe_answers_while_a_node_is_frozen(
    redis_cluster: RedisClusterServers, key_prefix: str
) -> None:
    """The breaker's probe asks every node at once: the cluster serves while
    one is frozen, even the client's default node (the first primary), and
    fails only when none answers."""
    import redis

    entry: dict[str, Any] = {"type": "redis", "startup_nodes": redis_cluster.startup_nodes}
    entry |= {"key_prefix": key_prefix, "socket_timeout_s": 0.5}
    harness = TierHarness(entry, small_layout())
    tier = harness.tier
    assert isinstance(tier, RedisTier)
    client = backend_of(tier, RedisBackend).client
    assert client.get_default_node().port == redis_cluster.nodes[0].port
    frozen: list[RedisServer] = []
    try:
        for node in redis_cluster.nodes[:-1]:
            node.pause()
            frozen.append(node)
            tier.backend.ping()  # before: asked the default node, and timed out
        redis_cluster.nodes[-1].pause()
        frozen.append(redis_cluster.nodes[-1])
        with pytest.raises(redis.exceptions.TimeoutError):
            tier.backend.ping()
    finally:
        for node in frozen:
            node.resume()
        harness.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_an_oversized_value_is_corrupt_and_its_neighbours_load_byte_exact(
    redis_server: RedisServer, key_prefix: str, protocol: int
) -> None:
    # Loads receive values straight into buffers: a value longer than a
    # chunk must be read past whole, so the replies after it still line up.
    url = f"{redis_server.url}?protocol={protocol}"
    harness = TierHarness(
        {"type": "redis", "url": url, "key_prefix": key_prefix, "ttl_s": 300}, small_layout()
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    client = raw_client(redis_server.url)
    try:
        keys = harness.keys(3)
        harness.fill([0, 1, 2])
        assert harness.store(keys, [0, 1, 2]).success
        name = tier.store_name(keys[1])
        client.set(name, client.get(name) + bytes(3 * 2**20 + 5))
        harness.buffer.array[3:6] = 9
        result = harness.load(keys, [3, 4, 5])
        assert result.succeeded == frozenset([keys[0], keys[2]])
        np.testing.assert_array_equal(harness.buffer.array[3], harness.buffer.array[0])
        assert (harness.buffer.array[4] == 9).all()
        np.testing.assert_array_equal(harness.buffer.array[5], harness.buffer.array[2])
        assert tier.stats.corrupt_chunks == 1
        assert client.exists(name) == 0
        assert 0 < client.pttl(tier.store_name(keys[2])) <= 300_000
        # The connection went back to the pool clean: the next loads are whole.
        harness.buffer.array[3:6] = 9
        assert harness.load([keys[2], keys[0]], [3, 4]).success
        np.testing.assert_array_equal(harness.buffer.array[3], harness.buffer.array[2])
        np.testing.assert_array_equal(harness.buffer.array[4], harness.buffer.array[0])
        assert tier.stats.backend_errors == 0
    finally:
        harness.close()


@pytest.mark.parametrize(
    ("slot_bytes", "chunks"), [(64 << 20, 1), (2 << 20, 2), (1 << 20, 4), (256 << 10, 8), (4096, 8)]
)
def test_pipelines_carry_a_few_mib_of_large_chunks_and_io_batch_of_small_ones(
    slot_bytes: int, chunks: int
) -> None:
    assert RedisBackend.batch_chunks(slot_bytes) == chunks


def test_a_probe_never_waits_for_a_pooled_connection(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """Workers stuck on a frozen server can hold every pooled connection; the
    probe that decides recovery opens its own, so it answers at once."""
    options: dict[str, Any] = {"url": redis_server.url, "key_prefix": key_prefix}
    options |= {"max_connections": 2, "io_threads": 2, "socket_timeout_s": 0.5}
    harness = TierHarness({"type": "redis", **options}, small_layout(chunk_tokens=4), 4)
    try:
        tier = harness.tier
        assert isinstance(tier, RedisTier)
        pool = backend_of(tier, RedisBackend).client.connection_pool
        held = [pool.get_connection() for _ in range(2)]
        try:
            tier.backend.ping()  # before: waited socket_timeout_s, then "No connection available"
        finally:
            for connection in held:
                pool.release(connection)
        assert len(pool._connections) == 2  # the probe's connection was never pooled
    finally:
        harness.close()


def test_a_tls_url_for_a_server_without_tls_fails_at_start_saying_so(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url.replace("redis://", "rediss://")
    with pytest.raises(BackendUnavailableError) as failure:
        TierHarness({"type": "redis", "url": url, "startup_timeout_s": 0.5}, small_layout())
    message = str(failure.value)
    assert url in message
    # Either the handshake waits for an answer that never comes, or the
    # server's plain-text reply breaks it: both name the likely cause.
    assert "TLS" in message or "SSL" in message


def _damages(client: Any, chunk_bytes: int) -> list[Damage]:
    """Ways a chunk's value may be damaged at its name in redis."""

    def flip(at: int) -> Damage:
        return lambda name, _other: client.set(name, flipped(client.get(name), at))

    def retype(write: Callable[[str], object]) -> Damage:
        def damage(name: str, _other: str) -> None:
            client.delete(name)
            write(name)

        return damage

    return [
        *(flip(at) for at in FIELDS.values()),
        flip(HEADER_BYTES + chunk_bytes - 1),  # the last payload byte
        lambda name, other: client.set(name, client.get(other)),  # another chunk's value
        lambda name, _other: client.append(name, b"\0" * 8),  # extended
        lambda name, _other: client.set(name, client.get(name)[:HEADER_BYTES]),  # header only
        lambda name, _other: client.set(name, b"KVTC"),  # shorter than a header
        lambda name, _other: client.set(name, b""),
        retype(lambda name: client.hset(name, "f", "v")),
        retype(lambda name: client.sadd(name, "m")),
        retype(lambda name: client.zadd(name, {"m": 1.0})),
        retype(lambda name: client.xadd(name, {"f": "v"})),
    ]


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_no_damaged_value_is_ever_served_nor_taken_for_an_outage(
    where: str, request: pytest.FixtureRequest, key_prefix: str
) -> None:
    import redis

    if where == "server":
        server: RedisServer = request.getfixturevalue("redis_server")
        options: dict[str, Any] = {"url": server.url}
        client: Any = redis.Redis.from_url(server.url)
    else:
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        options = {"startup_nodes": cluster.startup_nodes}
        host, port = cluster.startup_nodes[0].rsplit(":", 1)
        client = redis.RedisCluster(host=host, port=int(port))
    layout = small_layout()
    damages = _damages(client, layout.slot_bytes)
    harness = TierHarness(
        {"type": "redis", "key_prefix": key_prefix, "breaker_failures": 1, **options},
        layout,
        num_slots=2 * len(damages) + 4,
    )
    try:
        assert_no_damaged_value_served(
            harness,
            damages,
            remove=client.delete,  # evicted by the server: gone, not corrupt
            present=lambda name: bool(client.exists(name)),
        )
    finally:
        harness.close()
        client.close()


def test_shutdown_closes_every_connection_of_the_tier(
    own_redis_server: RedisServer, key_prefix: str
) -> None:
    server = own_redis_server

    def clients() -> int:
        return server.command("CLIENT", "LIST").count(b"id=")  # this command's own included

    alone = clients()
    harness = TierHarness(
        {"type": "redis", "url": server.url, "key_prefix": key_prefix}, small_layout()
    )
    keys = harness.keys(16)
    harness.fill(range(16))
    assert harness.store(keys, list(range(16))).success
    assert harness.load(keys, list(range(16, 32))).success
    assert clients() > alone
    harness.close()
    wait_until(lambda: clients() == alone, what="the tier's connections closed")
