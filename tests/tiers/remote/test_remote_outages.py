"""Remote tiers (redis, obj) in an outage: one deadline per request, then fail fast.

Real servers on loopback, frozen with SIGSTOP or put behind a fault-injecting
proxy. No assertion is on elapsed time: each checks what was answered while
the backend was still frozen, which states the breaker went through and how
many backend calls were made.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.errors import BackendUnavailableError
from kvtier.testing import TierHarness, small_layout
from kvtier.testing.outages import FaultProxy, recover, wait_until
from kvtier.tiers.base import Lookup, LookupContext, TransferJob
from kvtier.tiers.circuit import BreakerState
from kvtier.tiers.obj import ObjectStoreBackend, ObjectStoreTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.remote import RemoteTier
from tests.support.cache_tiers import backend_of
from tests.support.needs import need_redis_server, need_s3_server
from tests.support.servers import RedisServer, S3Server, free_port
from tests.tiers.remote.outage import outage_harness
from tests.tiers.remote.remote_doubles import LateSendingBackend, LateSendingTier


class Calls:
    """Counts backend calls started and still running, around chosen methods."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = 0
        self.running = 0
        self.idle = threading.Event()
        self.idle.set()

    def wrap(self, owner: Any, *names: str) -> Calls:
        for name in names:
            setattr(owner, name, self._counted(getattr(owner, name)))
        return self

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.started += 1
                self.running += 1
                self.idle.clear()
            try:
                return call(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1
                    if self.running == 0:
                        self.idle.set()

        return counted


def backend_calls(tier: RemoteTier) -> Calls:
    """Every request the tier sends: one per object for obj, one per pipeline for redis."""
    calls = Calls()
    if isinstance(tier, ObjectStoreTier):
        client = backend_of(tier, ObjectStoreBackend).client
        return calls.wrap(client, "get_object", "put_object", "head_bucket", "delete_object")
    names = ("get_many", "get_into", "put_many", "exists_many", "ping", "delete")
    return calls.wrap(tier.backend, *names)


class BrokenBackend:
    def exists_many(self, names: Any) -> Any:
        raise ConnectionError("injected")


Backend = tuple[Any, dict[str, Any]]


def stored_by_another_engine(options: dict[str, Any], count: int) -> None:
    """Store the first ``count`` chunks of a :class:`TierHarness` through a tier
    of their own, with all the time they need on a loaded machine (every
    harness draws the same keys)."""
    writer = TierHarness({**options, "deadline_s": 30}, small_layout(), num_slots=count)
    try:
        keys = writer.keys(count)
        writer.fill(range(count))
        assert writer.store(keys, list(range(count))).success
    finally:
        writer.close()


@pytest.fixture(params=["redis", "obj"])
def frozen_capable(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A server of the test's own and tier options whose per-call timeouts
    are far longer than any test: only the deadline can end a wait."""
    if request.param == "redis":
        redis_server: RedisServer = request.getfixturevalue("own_redis_server")
        yield (
            redis_server,
            {
                "type": "redis",
                "url": redis_server.url,
                "key_prefix": f"t{uuid.uuid4().hex[:8]}:",
                "socket_timeout_s": 120,
                "retries": 0,
            },
        )
    else:
        s3_server: S3Server = request.getfixturevalue("own_s3_server")
        bucket = s3_server.create_bucket("kv-frozen")
        yield (
            s3_server,
            {
                "type": "obj",
                **s3_server.tier_options(bucket),
                "read_timeout_s": 120,
                "retries": 0,
            },
        )


def test_a_frozen_backend_costs_one_deadline_then_nothing(frozen_capable: Backend) -> None:
    server, options = frozen_capable
    stored_by_another_engine(options, 32)
    kind = RedisTier if options["type"] == "redis" else ObjectStoreTier
    with outage_harness(  # no probe unless the test moves the clock
        {**options, "io_threads": 4, "deadline_s": 0.5}, kind, num_slots=64
    ) as (harness, tier, clock):
        stats = tier.stats
        keys = harness.keys(32)
        calls = backend_calls(tier)
        harness.buffer.array[32:64] = 7
        server.pause()
        try:
            # One request of 32 chunks over 4 workers: answered at its deadline,
            # while workers are still waiting on the frozen server (a redis
            # read into the slots gives up then, but connecting, outside the
            # slots, waits for its own timeout)...
            result = harness.load(keys, list(range(32, 64)))
            assert not result.success and result.succeeded == frozenset()
            assert calls.running >= 1
            # ...having sent one request per worker, not one per chunk.
            assert 1 <= calls.started <= 4
            assert tier.breaker.state is BreakerState.OPEN
            assert stats.deadline_misses == 1 and stats.backend_outages == 1
            assert {m.name: m.value for m in tier.metrics()} == {
                "backend_up": 0.0,
                "breaker_state": 2.0,
            }

            # Fail fast: the next 20 requests are answered inside the call, with
            # no backend call, and counted.
            sent = calls.started
            for _ in range(20):
                load = TransferJob(tuple(keys[:4]), (32, 33, 34, 35))
                tier.submit_load(load)
                store = TransferJob(tuple(keys[4:8]), (4, 5, 6, 7))
                tier.submit_store(store)
                finished = tier.get_finished_jobs()
                assert [(r.job_id, r.success) for r in finished] == [
                    (load.job_id, False),
                    (store.job_id, False),
                ]
                assert tier.lookup(keys[8], LookupContext()) is Lookup.MISS
            assert calls.started == sent
            assert stats.outage_failed_loads == 80
            assert stats.outage_dropped_stores == 80
            assert stats.outage_skipped_lookups == 20

            # After the backoff a probe goes out; it hangs too, and at its
            # deadline the breaker opens again, for longer.
            clock.advance(tier.breaker.max_backoff_s)
            assert tier.lookup(keys[8], LookupContext()) is Lookup.PENDING  # waits for the probe
            assert stats.breaker_probes == 1
            wait_until(lambda: tier.breaker.state is BreakerState.OPEN, what="open again")
            assert tier.breaker.retry_at - clock() > tier.breaker.backoff_s
            assert tier.lookup(keys[8], LookupContext()) is Lookup.MISS
            assert stats.backend_outages == 1
            sent = calls.started

            # close() does not wait for the workers stuck in the frozen server.
            tier.shutdown()
            assert calls.running >= 1
        finally:
            server.resume()
        assert calls.idle.wait(60)
        # The late replies never reached the slots, which were no longer the job's.
        assert (harness.buffer.array[32:64] == 7).all()
        # And once the backend was known down, no task sent another request.
        assert calls.started == sent


def test_existence_checks_that_fail_when_a_stall_ends_are_asked_again(
    own_s3_server: S3Server,
) -> None:
    server = own_s3_server
    bucket = server.create_bucket("kv-stall")
    stored_by_another_engine({"type": "obj", **server.tier_options(bucket)}, 8)
    with (
        FaultProxy(server.port) as proxy,
        outage_harness(
            {
                "type": "obj",
                **server.tier_options(bucket),
                "endpoint_url": proxy.url,
                "retries": 0,
                "read_timeout_s": 120,
                "deadline_s": 0.5,
            },
            ObjectStoreTier,
        ) as (harness, tier, clock),
    ):
        keys = harness.keys(8)
        calls = backend_calls(tier)
        proxy.set_mode("stall")
        ctx = LookupContext()
        assert [tier.lookup(k, ctx) for k in keys] == [Lookup.PENDING] * 8
        tier.on_step_end()
        wait_until(lambda: calls.started >= 1, what="a check sent")
        # The checks missed their deadline: the breaker opened, lookups miss.
        wait_until(lambda: tier.breaker.state is BreakerState.OPEN, what="open")
        assert [tier.lookup(k, ctx) for k in keys] == [Lookup.MISS] * 8
        assert calls.running >= 1
        proxy.set_mode("forward")  # the stall ends: the checks in flight fail
        assert calls.idle.wait(60)
        assert recover(tier, clock)
        # Failed checks were unknown, not "absent": every chunk is found.
        assert [harness.lookup(k) for k in keys] == [Lookup.HIT] * 8


#: An object store's existence check, by ``prefetch_bytes``: a read of the
#: whole value held for the load, or (past that bound) an existence check alone.
CHECK_REQUESTS = pytest.mark.parametrize(
    ("prefetch_bytes", "check"), [("1MiB", "get_many"), (0, "exists_many")]
)


@CHECK_REQUESTS
def test_a_failed_check_is_retried_then_taken_as_a_miss(
    s3_server: S3Server, s3_bucket: str, prefetch_bytes: str | int, check: str
) -> None:
    harness = TierHarness(
        {
            "type": "obj",
            **s3_server.tier_options(s3_bucket),
            "breaker_failures": 10,
            "prefetch_bytes": prefetch_bytes,
        },
        small_layout(),
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    try:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        real = getattr(tier.backend, check)
        failures = {"left": 1}

        def flaky(names: Any) -> Any:
            if failures["left"]:
                failures["left"] -= 1
                raise ConnectionError("injected")
            return real(names)

        setattr(tier.backend, check, flaky)
        assert harness.lookup(keys[0]) is Lookup.HIT  # asked again after the failure
        assert tier.stats.backend_errors == 1

        broken = BrokenBackend()
        calls = Calls().wrap(broken, "exists_many")
        setattr(tier.backend, check, broken.exists_many)
        # A key the backend keeps failing for: asked check_attempts times, then a miss.
        assert harness.lookup(keys[1]) is Lookup.MISS
        assert calls.started == tier.check_attempts
        assert tier.breaker.closed  # 1 + 3 failures, below breaker_failures
    finally:
        harness.close()


def test_a_deleted_bucket_is_an_outage_not_missing_chunks(
    s3_server: S3Server, s3_bucket: str
) -> None:
    harness = TierHarness(
        {"type": "obj", **s3_server.tier_options(s3_bucket), "breaker_failures": 2},
        small_layout(),
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    client = s3_server.client()
    try:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        for item in client.list_objects_v2(Bucket=s3_bucket)["Contents"]:
            client.delete_object(Bucket=s3_bucket, Key=item["Key"])
        client.delete_bucket(Bucket=s3_bucket)
        # Lookups alone (no store) find the outage: NoSuchBucket is not NoSuchKey.
        assert harness.lookup(keys[0]) is Lookup.MISS
        assert tier.backend_down
        assert tier.stats.backend_outages == 1
        assert tier.stats.backend_errors == 2
    finally:
        client.create_bucket(Bucket=s3_bucket)
        harness.close()


def test_consecutive_errors_open_the_breaker_and_stop_the_requests(
    s3_server: S3Server, s3_bucket: str
) -> None:
    with (
        FaultProxy(s3_server.port) as proxy,
        outage_harness(
            {
                "type": "obj",
                **s3_server.tier_options(s3_bucket),
                "endpoint_url": proxy.url,
                "retries": 0,
                "breaker_failures": 3,
            },
            ObjectStoreTier,
        ) as (harness, tier, clock),
    ):
        keys = harness.keys(1)
        harness.fill([0])
        proxy.set_mode("status")  # every request answers 503
        for expected in (BreakerState.CLOSED, BreakerState.CLOSED, BreakerState.OPEN):
            assert not harness.store(keys, [0]).success
            assert tier.breaker.state is expected
        connections = proxy.connections
        assert not harness.store(keys, [0]).success
        assert harness.lookup(keys[0]) is Lookup.MISS
        assert proxy.connections == connections  # nothing sent while open
        # A probe while the errors go on keeps it open, with a longer backoff.
        first_wait = tier.breaker.retry_at - clock()
        assert not recover(tier, clock)
        assert tier.breaker.retry_at - clock() > first_wait
        proxy.set_mode("forward")
        assert recover(tier, clock)
        assert harness.store(keys, [0]).success
        assert tier.stats.breaker_probes == 2
        assert tier.stats.backend_outages == 1


def test_cut_replies_fail_the_chunks_and_never_reach_a_slot(
    s3_server: S3Server, s3_bucket: str
) -> None:
    with FaultProxy(s3_server.port) as proxy:
        harness = TierHarness(
            {
                "type": "obj",
                **s3_server.tier_options(s3_bucket),
                "endpoint_url": proxy.url,
                "retries": 0,
                "deadline_s": 30,
            },
            small_layout(),
            tier_class=ObjectStoreTier,
        )
        try:
            keys = harness.keys(2)
            data = harness.fill([0, 1])
            assert harness.store(keys, [0, 1]).success
            harness.buffer.array[2:4] = 9
            proxy.cut_after = 2000  # headers and the start of the body
            proxy.set_mode("cut")
            assert harness.load(keys, [2, 3]).succeeded == frozenset()
            assert (harness.buffer.array[2:4] == 9).all()
            proxy.set_mode("forward")
            assert harness.load(keys, [2, 3]).success
            np.testing.assert_array_equal(harness.buffer.array[2:4], data)
            connections = proxy.connections
            harness.buffer.array[2:4] = 9
            proxy.delay_s = 0.01
            proxy.set_mode("delay")  # late, yet well within the deadline: served
            backend_of(harness.tier, ObjectStoreBackend).client.close()  # new connections
            assert harness.load(keys, [2, 3]).success
            assert proxy.connections > connections
            np.testing.assert_array_equal(harness.buffer.array[2:4], data)
        finally:
            harness.close()


@pytest.mark.parametrize("kind", ["redis", "obj"])
def test_start_up_is_bounded_against_an_endpoint_that_never_answers(kind: str) -> None:
    (need_redis_server if kind == "redis" else need_s3_server)()
    with FaultProxy(free_port(), mode="stall") as proxy:
        if kind == "redis":
            tier: dict[str, Any] = {
                "type": "redis",
                "url": f"redis://127.0.0.1:{proxy.port}/0",
                "socket_timeout_s": 120,
            }
        else:
            tier = {
                "type": "obj",
                "bucket": "kv-bucket",
                "endpoint_url": proxy.url,
                "access_key_id": S3Server.access_key_id,
                "secret_access_key": S3Server.secret_access_key,
                "region": S3Server.region,
                "read_timeout_s": 120,
            }
        layout = small_layout()
        config = {
            "chunk_tokens": layout.chunk_tokens,
            "cpu_bytes_to_use": 4 * layout.slot_bytes,
            "secondary_tiers": [{"type": "memory"}, {**tier, "startup_timeout_s": 0.3}],
        }
        with pytest.raises(BackendUnavailableError, match=r"startup_timeout_s=0\.3") as caught:
            KVCache(config, layout)
        assert caught.value.entry == "secondary_tiers[1]"
        assert str(caught.value).startswith("secondary_tiers[1]: ")
        assert proxy.connections >= 1  # it connected: the endpoint accepts, never answers


def test_a_missed_deadline_opens_the_breaker_only_when_nothing_answered(
    s3_server: S3Server, s3_bucket: str
) -> None:
    harness = TierHarness({"type": "obj", **s3_server.tier_options(s3_bucket)}, small_layout())
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    try:
        started = time.perf_counter()
        tier.guards.answered()  # a slow backend: some call came back while the job ran
        tier.guards.missed_deadline("load job", since=started)
        assert tier.breaker.closed and tier.stats.deadline_misses == 1
        tier.guards.missed_deadline("load job", since=time.perf_counter())  # nothing since: stalled
        assert tier.breaker.state is BreakerState.OPEN
        assert tier.stats.deadline_misses == 2
    finally:
        harness.close()


def test_lookups_wait_for_the_probe_so_the_first_request_after_recovery_hits(
    s3_server: S3Server, s3_bucket: str
) -> None:
    with outage_harness({"type": "obj", **s3_server.tier_options(s3_bucket)}, ObjectStoreTier) as (
        harness,
        tier,
        clock,
    ):
        try:
            keys = harness.keys(2)
            harness.fill([0, 1])
            assert harness.store(keys, [0, 1]).success
            tier.breaker.trip("injected outage")
            ctx = LookupContext()
            assert tier.lookup(keys[0], ctx) is Lookup.MISS  # open: no wait at all
            assert tier.lookup_run(keys, ctx) == [Lookup.MISS]  # a run ends at its miss
            real_ping, release = tier.backend.ping, threading.Event()

            def held_ping() -> None:
                release.wait(60)
                real_ping()

            tier.backend.ping = held_ping  # type: ignore[method-assign]
            clock.advance(tier.breaker.max_backoff_s)
            # Half-open while the probe runs: lookups wait instead of missing.
            assert [tier.lookup(k, ctx) for k in keys] == [Lookup.PENDING] * 2
            assert tier.lookup_run(keys, ctx) == [Lookup.PENDING] * 2
            assert tier.breaker.state is BreakerState.HALF_OPEN
            release.set()
            wait_until(lambda: tier.breaker.closed, what="closed")
            assert [harness.lookup(k) for k in keys] == [Lookup.HIT] * 2
            assert tier.stats.outage_skipped_lookups == 2
        finally:
            release.set()


def test_a_value_sent_in_place_after_its_deadline_from_a_reused_slot_is_never_served() -> None:
    """A tier that sends values straight from the slots can still be sending
    when its job was answered at the deadline and the slot given to another
    chunk: what reaches the store then no longer matches its checksum."""
    entry = {
        "type": "LateSendingTier",
        "module_path": "tests.tiers.remote.remote_doubles",
        "deadline_s": 0.2,
    }
    with outage_harness(entry, LateSendingTier, num_slots=4) as (harness, tier, clock):
        backend = backend_of(tier, LateSendingBackend)
        try:
            [key] = harness.keys(1)
            harness.buffer.array[0] = 1
            assert not harness.store([key], [0]).success  # answered at its deadline, send held
            harness.buffer.array[0] = 2  # the slot's next chunk
            backend.gate.set()
            wait_until(lambda: bool(backend.values), what="the late send")
            assert recover(tier, clock)
            assert harness.lookup(key) is Lookup.HIT
            harness.buffer.array[1] = 9
            assert not harness.load([key], [1]).success
            assert (harness.buffer.array[1] == 9).all()  # the slot never saw the bytes
            assert tier.stats.corrupt_chunks == 1
            assert not backend.values  # and the bad value is gone
        finally:
            backend.gate.set()


def test_an_object_store_refusing_writes_is_no_outage(s3_server: S3Server, s3_bucket: str) -> None:
    with FaultProxy(s3_server.port) as proxy:
        harness = TierHarness(
            {
                "type": "obj",
                **s3_server.tier_options(s3_bucket),
                "endpoint_url": proxy.url,
                "retries": 0,
                "breaker_failures": 2,
            },
            small_layout(),
        )
        tier = harness.tier
        assert isinstance(tier, RemoteTier)
        try:
            keys = harness.keys(2)
            stored = harness.fill([0, 1])
            assert harness.store(keys[:1], [0]).success
            proxy.status, proxy.error_code = 403, "AccessDenied"
            proxy.set_mode("status")  # a bucket policy that denies writes
            for _ in range(3):  # past breaker_failures: still no outage
                assert not harness.store(keys[1:], [1]).success
                assert tier.breaker.closed
            assert tier.stats.refused_stores == 3
            proxy.set_mode("forward")
            assert harness.lookup(keys[0]) is Lookup.HIT  # served at once, no probe needed
            assert harness.load(keys[:1], [2]).success
            np.testing.assert_array_equal(harness.buffer.array[2], stored[0])
            assert tier.stats.breaker_probes == 0
        finally:
            harness.close()


@CHECK_REQUESTS
@pytest.mark.parametrize("waiting", [1, 3])
def test_every_request_waiting_on_a_check_past_its_deadline_answers_miss(
    s3_server: S3Server, s3_bucket: str, waiting: int, prefetch_bytes: str | int, check: str
) -> None:
    """Past the deadline a request waits no longer (nor do the others waiting
    on the same check); the backend, slow but answering, stays in service and
    its late answer serves the next request."""
    stored_by_another_engine({"type": "obj", **s3_server.tier_options(s3_bucket)}, 1)
    harness = TierHarness(
        {
            "type": "obj",
            **s3_server.tier_options(s3_bucket),
            "deadline_s": 0.3,
            "prefetch_bytes": prefetch_bytes,
        },
        small_layout(),
    )
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    try:
        [key] = harness.keys(1)
        real = getattr(tier.backend, check)
        started, release = threading.Event(), threading.Event()

        def slow(names: Any) -> Any:
            started.set()
            tier.guards.answered()  # slow, not stalled: the breaker stays closed
            release.wait(60)
            return real(names)

        setattr(tier.backend, check, slow)
        # Requests (threads of one engine, or engine steps) ask for the same
        # chunk: one check goes out for them all.
        requests = [LookupContext(f"request-{i}") for i in range(waiting)]
        assert [tier.lookup(key, ctx) for ctx in requests] == [Lookup.PENDING] * waiting
        tier.on_step_end()
        assert started.wait(60)
        wait_until(lambda: tier.stats.deadline_misses == 1, what="past the deadline")
        # Every request waits no longer, not just the first to ask again.
        assert [tier.lookup(key, ctx) for ctx in requests] == [Lookup.MISS] * waiting
        assert tier.breaker.closed
        release.set()
        wait_until(lambda: not tier.checks.checking, what="the check done")
        assert tier.lookup(key, requests[-1]) is Lookup.HIT  # the late answer, for the next one
    finally:
        release.set()
        harness.close()


@pytest.mark.parametrize("asked_in", ["lookup", "lookup_run"])
def test_a_requests_checks_and_loads_share_one_deadline(
    s3_server: S3Server, s3_bucket: str, asked_in: str
) -> None:
    options = {"type": "obj", **s3_server.tier_options(s3_bucket)}
    stored_by_another_engine(options, 2)
    # Checks that only ask whether a value is there (past prefetch_bytes),
    # so that the loads read: with the values held, they take no backend time.
    harness = TierHarness({**options, "deadline_s": 30, "prefetch_bytes": 0}, small_layout())
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    now = [time.perf_counter()]
    tier.budgets.clock = lambda: now[0]  # the backend's time, as the test says it passes
    real_exists, real_get = tier.backend.exists_many, tier.backend.get_many
    check_gate, get_gate = threading.Event(), threading.Event()

    def held_check(names: Any) -> Any:
        check_gate.wait(60)
        return real_exists(names)

    def held_get(names: Any) -> Any:
        get_gate.wait(60)
        return real_get(names)

    tier.backend.exists_many = held_check  # type: ignore[method-assign]
    tier.backend.get_many = held_get  # type: ignore[method-assign]

    def lookup(key: Any, ctx: LookupContext) -> Lookup:
        """The tier's answer, asked alone or as a run of one key."""
        if asked_in == "lookup":
            return tier.lookup(key, ctx)
        [answer] = tier.lookup_run([key], ctx)
        return answer

    def request(name: str, key: Any, slot: int, check_takes: float, engine_away: float) -> Any:
        ctx = LookupContext(name)
        assert lookup(key, ctx) is Lookup.PENDING
        tier.on_step_end()
        now[0] += check_takes
        check_gate.set()
        wait_until(lambda: key not in tier.checks.checking, what="the check answered")
        check_gate.clear()
        now[0] += engine_away  # the engine's own time: not the backend's
        assert lookup(key, ctx) is Lookup.HIT
        job = TransferJob((key,), (slot,), request_id=name)
        tier.submit_load(job)
        results: list[Any] = []

        def finished() -> bool:
            results.extend(tier.get_finished_jobs())
            return bool(results)

        wait_until(finished, what="load")
        return results[0]

    try:
        keys = harness.keys(2)
        stored = harness.fill(range(2))  # what the other engine stored (same draws)
        harness.buffer.array[4:6] = 7
        # Checks that took the whole deadline leave nothing to the load: it is
        # answered at once (its GET still held), not deadline_s later.
        spent = request("request-1", keys[0], 4, check_takes=30, engine_away=0)
        assert spent.succeeded == frozenset() and not spent.success
        assert (harness.buffer.array[4] == 7).all()
        assert tier.stats.deadline_misses == 1
        assert tier.breaker.closed  # the check answered: slow, not stalled
        get_gate.set()
        # Checks that took a third leave two thirds, however long the engine
        # took to come back for the answer.
        left = request("request-2", keys[1], 5, check_takes=10, engine_away=100)
        assert left.success
        np.testing.assert_array_equal(harness.buffer.array[5], stored[1])
        assert tier.stats.deadline_misses == 1
    finally:
        check_gate.set()
        get_gate.set()
        harness.close()
