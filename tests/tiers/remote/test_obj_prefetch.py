"""A cold prefix from ``obj`` in one request per chunk: checks that read whole objects.

A fresh ``KVCache`` checks each chunk with a GET of the whole object, holds
it, and its promotion takes it from memory. None of it may weaken what a
cold load guarantees: a missing object ends the prefix (a miss), a corrupt
or torn one is a miss (deleted, counted) and never served, a chunk the tier
deletes between its check and its load is a miss, a stalled store costs one
bounded wait, and held bytes stay within ``prefetch_bytes``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.integrity import HEADER_BYTES
from kvtier.testing import small_layout
from kvtier.testing.outages import FaultProxy, wait_until
from kvtier.tiers.backend import Exists
from kvtier.tiers.obj import ObjectStoreBackend, ObjectStoreTier
from kvtier.tiers.prefetch import UNCLAIMED_S, Prefetched
from kvtier.tiers.workers import Priority
from tests.support.cache_tiers import backend_of
from tests.support.servers import S3Server

LAYOUT = small_layout(chunk_tokens=4)
CHUNKS = 6
TOKENS = list(range(100, 100 + CHUNKS * 4))


def config(options: dict[str, Any], **tier: Any) -> dict[str, Any]:
    return {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 2 * CHUNKS * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "obj", **options, "io_threads": 4, **tier}],
    }


class Requests:
    """The GETs a tier's client sends, whole or ranged (a check that only asks)."""

    def __init__(self, tier: ObjectStoreTier) -> None:
        self.whole = 0
        self.ranged = 0
        self._lock = threading.Lock()
        client = backend_of(tier, ObjectStoreBackend).client
        real = client.get_object

        def counted(**kwargs: Any) -> Any:
            with self._lock:
                if "Range" in kwargs:
                    self.ranged += 1
                else:
                    self.whole += 1
            return real(**kwargs)

        client.get_object = counted


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (CHUNKS, LAYOUT.slot_bytes), dtype=np.uint8)


@pytest.fixture
def stored(s3_server: S3Server, s3_bucket: str, data: np.ndarray) -> dict[str, Any]:
    """Tier options of a bucket holding the prefix, left by a cache that is closed."""
    options = s3_server.tier_options(s3_bucket)
    with KVCache(config(options), LAYOUT) as writer:
        assert writer.store(TOKENS, data) == CHUNKS
        writer.drain()
    return options


def cold(options: dict[str, Any], **tier: Any) -> tuple[KVCache, ObjectStoreTier, Requests]:
    cache = KVCache(config(options, **tier), LAYOUT)
    obj = cache.manager.tiers[0]
    assert isinstance(obj, ObjectStoreTier)
    return cache, obj, Requests(obj)


def names(cache: KVCache, tier: ObjectStoreTier) -> list[str]:
    return [tier.store_name(key) for key in cache.keys(TOKENS)]


def loaded(cache: KVCache) -> tuple[int, np.ndarray]:
    """The cold prefix's tokens, and the rows it loads."""
    found = cache.cached_prefix(TOKENS)
    out = np.zeros((CHUNKS, LAYOUT.slot_bytes), dtype=np.uint8)
    assert cache.load(TOKENS, found, out) == found
    return found, out


def test_a_cold_prefix_costs_one_request_per_chunk(
    stored: dict[str, Any], data: np.ndarray
) -> None:
    cache, tier, requests = cold(stored)
    with cache:
        found, out = loaded(cache)
        assert found == len(TOKENS)
        np.testing.assert_array_equal(out, data)
        assert (requests.whole, requests.ranged) == (CHUNKS, 0)
        stats = tier.stats
        assert (stats.prefetched_chunks, stats.prefetch_served) == (CHUNKS, CHUNKS)
        assert stats.chunks_loaded == CHUNKS
        assert tier.prefetched is not None and tier.prefetched.held_bytes == 0


def test_a_missing_object_ends_the_prefix(
    stored: dict[str, Any], s3_server: S3Server, s3_bucket: str, data: np.ndarray
) -> None:
    cache, tier, requests = cold(stored)
    with cache:
        s3_server.client().delete_object(Bucket=s3_bucket, Key=names(cache, tier)[3])
        found, out = loaded(cache)
        assert found == 3 * LAYOUT.chunk_tokens
        np.testing.assert_array_equal(out[:3], data[:3])
        assert tier.stats.misses >= 1
        # Every chunk loaded came from its check's read, with no request of its own.
        assert tier.stats.prefetch_served == tier.stats.chunks_loaded >= 3
        assert requests.ranged == 0


@pytest.mark.parametrize(
    ("damage", "reads"),
    [
        # Held by its check, found corrupt when its load verifies it: no second read.
        (lambda value: value[:-1] + bytes([value[-1] ^ 0x80]), CHUNKS),
        # Not a chunk's size: not held, so its load reads it again and refuses it.
        (lambda value: value[:-4096], CHUNKS + 1),
    ],
    ids=["flipped", "torn"],
)
def test_a_damaged_object_is_a_miss_deleted_and_counted(
    stored: dict[str, Any],
    s3_server: S3Server,
    s3_bucket: str,
    data: np.ndarray,
    damage: Callable[[bytes], bytes],
    reads: int,
) -> None:
    client = s3_server.client()
    cache, tier, requests = cold(stored)
    with cache:
        name = names(cache, tier)[2]
        value = client.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
        client.put_object(Bucket=s3_bucket, Key=name, Body=damage(value))
        found, out = loaded(cache)
        assert found == 2 * LAYOUT.chunk_tokens
        np.testing.assert_array_equal(out[:2], data[:2])
        assert tier.stats.corrupt_chunks == 1
        listed = client.list_objects_v2(Bucket=s3_bucket)["Contents"]
        assert name not in {item["Key"] for item in listed}
        assert (requests.whole, requests.ranged) == (reads, 0)


def test_a_chunk_the_tier_deletes_between_check_and_load_is_a_miss(
    stored: dict[str, Any], data: np.ndarray
) -> None:
    cache, tier, requests = cold(stored)
    with cache:
        key = cache.keys(TOKENS)[1]
        real = tier.store._read_checked

        def then_deleted(held: Prefetched, names: list[str]) -> list[Exists]:
            found = real(held, names)
            if tier.store_name(key) in names:  # before the check answers
                tier.discard([key])  # its held value goes with the object
            return found

        tier.store._read_checked = then_deleted  # type: ignore[method-assign]
        found, out = loaded(cache)
        assert found == LAYOUT.chunk_tokens
        np.testing.assert_array_equal(out[:1], data[:1])
        assert tier.stats.corrupt_chunks == 0
        # Its load asked the store (which no longer holds it); the others did not.
        assert (requests.whole, requests.ranged) == (CHUNKS + 1, 0)


def test_a_stalled_store_costs_one_deadline(stored: dict[str, Any], s3_server: S3Server) -> None:
    with FaultProxy(s3_server.port) as proxy:
        cache, tier, requests = cold(
            stored,
            endpoint_url=proxy.url,
            retries=0,
            read_timeout_s=120,
            deadline_s=0.5,
        )
        with cache:
            proxy.set_mode("stall")
            # Answered while the checks still hang: the deadline ended the
            # wait, not the lookup's timeout nor the client's.
            assert cache.cached_prefix(TOKENS, timeout=60) == 0
            assert requests.whole >= 1 and requests.ranged == 0
            assert tier.stats.deadline_misses >= 1
            assert tier.breaker.state.name == "OPEN"
            proxy.set_mode("forward")  # the stalled checks fail; their room is given back
            wait_until(lambda: not tier.checks.checking, what="the checks ended")
            held = tier.prefetched
            assert held is not None and held.held_bytes == 0
            assert held.reserve(held.budget_bytes)  # the checks' room is all given back


def test_a_check_whose_reply_is_cut_holds_and_serves_nothing(
    stored: dict[str, Any], s3_server: S3Server, s3_bucket: str, data: np.ndarray
) -> None:
    """A GET that fails midway in a check (the reply cut after its headers
    and the start of a 4 KiB body) is a failed check: nothing held, nothing
    served, and the object, which is not corrupt, stays."""
    with FaultProxy(s3_server.port, mode="cut") as proxy:
        proxy.cut_after = 2000
        cache, tier, requests = cold(stored, endpoint_url=proxy.url, retries=0)
        with cache:
            assert cache.cached_prefix(TOKENS, timeout=60) == 0
            assert requests.whole >= 1 and tier.stats.backend_errors >= 1
            assert tier.stats.chunks_loaded == tier.stats.prefetched_chunks == 0
            assert tier.stats.corrupt_chunks == 0
            held = tier.prefetched
            assert held is not None and held.held_bytes == 0
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert len(listed) == CHUNKS
    cache, tier, _ = cold(stored)
    with cache:
        found, out = loaded(cache)
        assert found == len(TOKENS)
        np.testing.assert_array_equal(out, data)


def test_checks_past_prefetch_bytes_only_ask(stored: dict[str, Any], data: np.ndarray) -> None:
    """One worker takes the checks, four a task, before any load of what they
    did not hold: the first task's four values would pass the bound, so it
    sends ranged GETs (and their loads read those chunks); the next task's
    two fit, and are held."""
    value_bytes = HEADER_BYTES + LAYOUT.slot_bytes
    cache, tier, requests = cold(stored, io_threads=1, prefetch_bytes=2 * value_bytes)
    with cache:
        found, out = loaded(cache)
        assert found == len(TOKENS)
        np.testing.assert_array_equal(out, data)
        assert tier.stats.prefetched_chunks == tier.stats.prefetch_served == 2
        assert (requests.whole, requests.ranged) == (CHUNKS, 4)


@pytest.mark.parametrize(("prefetch_bytes", "queue"), [(None, Priority.HELD), (0, Priority.LOAD)])
def test_loads_of_held_values_go_before_checks(
    stored: dict[str, Any], data: np.ndarray, prefetch_bytes: int | None, queue: Priority
) -> None:
    """A promotion of values the checks hold is a copy that gives their memory
    back: it goes before the checks still queued; one that reads the store waits."""
    tier_options = {} if prefetch_bytes is None else {"prefetch_bytes": prefetch_bytes}
    cache, tier, _ = cold(stored, **tier_options)
    with cache:
        queued: list[Priority] = []
        real = tier.workers.submit

        def recorded(priority: Priority, task: Callable[[], None]) -> None:
            queued.append(priority)
            real(priority, task)

        tier.workers.submit = recorded  # type: ignore[method-assign]
        found, out = loaded(cache)
        assert found == len(TOKENS)
        np.testing.assert_array_equal(out, data)
        loads = [p for p in queued if p not in (Priority.CHECK, Priority.STORE)]
        assert loads and set(loads) == {queue}


@pytest.mark.parametrize(
    ("value_bytes", "chunks"), [(64 << 10, 4), (256 << 10, 4), (512 << 10, 2), (2 << 20, 1)]
)
def test_a_check_holds_about_a_mebibyte(value_bytes: int, chunks: int) -> None:
    """Held values wait for their whole check: large ones are checked one a
    task, so each is promoted, and its memory given back, as it arrives."""
    assert ObjectStoreTier.backend_class.check_chunks(value_bytes) == chunks


class TestPrefetched:
    def test_holds_within_the_budget(self) -> None:
        held = Prefetched(10)
        assert held.reserve(6)
        assert not held.reserve(6)  # 12 > 10, reserved or held alike
        held.keep(6, [("a", b"xxxx")])  # read less than reserved: the rest is given back
        assert held.held_bytes == 4
        assert held.reserve(6)
        held.keep(6, [])
        assert held.take("a") == b"xxxx"
        assert held.take("a") is None
        assert held.held_bytes == 0

    def test_unclaimed_values_give_their_room_once_old(self) -> None:
        now = [0.0]
        expired: list[int] = []
        held = Prefetched(8, on_expired=expired.append, clock=lambda: now[0])
        assert held.reserve(4)
        held.keep(4, [("old", b"1234")])
        now[0] = 1.0
        assert held.reserve(4)
        held.keep(4, [("new", b"5678")])
        assert not held.reserve(4)  # nothing old enough yet
        now[0] = UNCLAIMED_S + 0.5
        assert held.reserve(4)  # "old" dropped, "new" kept
        assert expired == [1]
        assert held.take("old") is None and held.take("new") == b"5678"

    def test_holds_answers_for_every_name(self) -> None:
        held = Prefetched(100)
        held.keep(0, [("a", b"1"), ("b", b"2")])
        assert held.holds(["a", "b"]) and held.holds([])
        assert not held.holds(["a", "c"])
        held.take("b")
        assert not held.holds(["a", "b"])

    def test_drop_and_clear(self) -> None:
        held = Prefetched(100)
        held.keep(0, [("a", b"1"), ("b", b"2"), ("a", b"3")])  # held again: replaced
        assert held.held_bytes == 2
        held.drop(["a", "missing"])
        assert held.take("a") is None and held.held_bytes == 1
        held.clear()
        assert held.take("b") is None and held.held_bytes == 0
