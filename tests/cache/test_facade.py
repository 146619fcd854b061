"""``KVCache``'s API under misuse: every bad input is refused before anything changes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import ChunkKey, KVCache, KVTierError
from kvtier.errors import ClosedError
from kvtier.testing import small_layout
from tests.support.servers import RedisServer

LAYOUT = small_layout(chunk_tokens=4, head_dim=16)  # float16
TOKENS = list(range(40, 56))  # four chunks


@pytest.fixture
def cache() -> Iterator[KVCache]:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "memory"}],
    }
    with KVCache(config, LAYOUT) as cache:
        yield cache


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, (4, LAYOUT.slot_bytes), dtype=np.uint8)


def untouched(cache: KVCache) -> bool:
    """Nothing was stored, nothing cascaded."""
    tier = cache.manager.tiers[0]
    cache.drain()
    return len(cache.manager.primary) == 0 and tier.stats.chunks_stored == 0


# store: src is checked against the layout ------------------------------------


@pytest.mark.parametrize(
    "src",
    [
        np.zeros((4, LAYOUT.slot_bytes // 2), np.uint8),  # rows too short: broadcast before
        np.zeros((4, 1), np.uint8),
        np.zeros((2, LAYOUT.slot_bytes), np.uint8),  # fewer rows than chunks
        np.zeros(LAYOUT.slot_bytes, np.uint8),  # one flat row
        np.uint8(7),
        np.zeros((4, LAYOUT.slot_bytes // 4), np.float32),  # right size, wrong dtype
        np.zeros((4, *LAYOUT.chunk_shape), np.float32),
    ],
    ids=["short-rows", "one-byte-rows", "too-few-rows", "flat", "scalar", "float32", "f32-shape"],
)
def test_store_refuses_a_src_of_the_wrong_shape_or_dtype(cache: KVCache, src: Any) -> None:
    with pytest.raises(ValueError, match=rf"expected \(4, {LAYOUT.slot_bytes}\) uint8"):
        cache.store(TOKENS, src)
    assert untouched(cache)


def test_store_refuses_a_src_that_is_not_contiguous(cache: KVCache) -> None:
    strided = np.zeros((4, 2 * LAYOUT.slot_bytes), np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        cache.store(TOKENS, strided)
    with pytest.raises(TypeError, match="numpy array or a chunk copier"):
        cache.store(TOKENS, "bytes")  # type: ignore[arg-type]
    assert untouched(cache)


def test_store_takes_rows_of_bytes_or_of_the_layout_shape_and_dtype(
    cache: KVCache, data: np.ndarray
) -> None:
    typed = data.view(np.float16).reshape(4, *LAYOUT.chunk_shape)
    assert cache.store(TOKENS, typed) == 4
    out = np.zeros((4, *LAYOUT.chunk_shape), np.float16)
    assert cache.load(TOKENS, 16, out) == 16
    np.testing.assert_array_equal(out.view(np.uint8).reshape(4, -1), data)


# store and load: each chunk's bytes in its own slot and row -----------------


@pytest.mark.parametrize(
    "resident",
    [[], [0], [0, 1, 2], [0, 2], [1, 3]],
    ids=["none", "a-run-after", "one-after", "holes", "holes-from-the-start"],
)
@pytest.mark.parametrize("kind", ["array", "copier"])
def test_a_store_puts_each_new_chunk_in_its_own_slot_around_resident_ones(
    cache: KVCache, data: np.ndarray, resident: list[int], kind: str
) -> None:
    keys = cache.keys(TOKENS)
    if resident:  # those chunks alone, by their keys
        stored = cache.store(cache.chunks([keys[i] for i in resident]), data[resident])
        assert stored == len(resident)

    def copier(index: int, slot: np.ndarray) -> None:
        slot[:] = data[index]

    assert cache.store(TOKENS, data if kind == "array" else copier) == 4 - len(resident)
    out = np.zeros_like(data)
    assert cache.load(TOKENS, 16, out) == 16
    np.testing.assert_array_equal(out, data)
    for index in (3, 1):  # one chunk a load: each row from its own slot
        one = np.zeros((1, LAYOUT.slot_bytes), np.uint8)
        assert cache.load(cache.chunks([keys[index]]), 4, one) == 4
        np.testing.assert_array_equal(one[0], data[index])


@pytest.mark.parametrize(
    ("layout", "registry", "problem"),
    [
        (None, None, r"layout: expected a KVLayout, got NoneType"),
        ({"chunk_tokens": 4}, None, r"layout: expected a KVLayout, got dict"),
        (LAYOUT, "registry", r"metrics_registry: expected a prometheus_client .* got str"),
    ],
    ids=["no-layout", "dict-layout", "str-registry"],
)
def test_the_cache_refuses_a_layout_or_registry_of_another_type(
    layout: Any, registry: Any, problem: str
) -> None:
    config = {"chunk_tokens": 4, "cpu_bytes_to_use": 8 * LAYOUT.slot_bytes}
    with pytest.raises(TypeError, match=problem):
        KVCache(config, layout, metrics_registry=registry)


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ("abcd", r"keys: expected a sequence of chunk keys \(32-byte digests\), got str"),
        (b"k" * 32, r"keys: expected a sequence .* got bytes"),
        (5, r"keys: expected a sequence .* got int"),
        ([b"k" * 32, b"short"], r"keys\[1\]: expected a chunk key of 32 bytes .* got 5 bytes"),
        ([b"k" * 32, 7], r"keys\[1\]: .* got int"),
        ([None], r"keys\[0\]: .* got NoneType"),
        (["k" * 32], r"keys\[0\]: .* got str"),
    ],
    ids=["str", "one-key", "int", "short-key", "int-key", "none-key", "str-key"],
)
def test_engine_made_keys_that_are_not_keys_are_refused_before_they_enter(
    cache: KVCache, data: np.ndarray, keys: Any, problem: str
) -> None:
    # Taken in, they would have failed every batch of the secondary tiers they rode in.
    with pytest.raises(TypeError, match=problem):
        cache.store(cache.chunks(keys), data[:2])
    with pytest.raises(TypeError, match=problem):
        cache.reserve(keys)
    with pytest.raises(TypeError, match=problem):
        cache.commit(keys)
    with pytest.raises(TypeError, match=problem):
        cache.record_request(keys, 8)
    assert untouched(cache)


REQUEST_ID_CALLS: dict[str, Callable[[KVCache, Any], object]] = {
    "lookup": lambda c, rid: c.lookup(TOKENS, request_id=rid, timeout=0),
    "cached_prefix": lambda c, rid: c.cached_prefix(TOKENS, request_id=rid, timeout=0),
    "load_prefix": lambda c, rid: c.load_prefix(
        TOKENS, np.zeros((4, LAYOUT.slot_bytes), np.uint8), request_id=rid, timeout=0
    ),
    "probe": lambda c, rid: c.probe(c.keys(TOKENS), request_id=rid),
    "wait_for_promotions": lambda c, rid: c.wait_for_promotions(
        c.keys(TOKENS), request_id=rid, timeout=0
    ),
    "end_request": lambda c, rid: c.end_request(rid),
}


@pytest.mark.parametrize("call", list(REQUEST_ID_CALLS))
@pytest.mark.parametrize(
    ("request_id", "got"),
    [(7, "int"), (["r"], "list"), (b"r", "bytes")],
    ids=["int", "list", "bytes"],
)
def test_a_request_id_that_is_not_a_string_is_refused_naming_it(
    cache: KVCache, data: np.ndarray, call: str, request_id: Any, got: str
) -> None:
    # 7 and "7" would be two requests; a list failed deep in the tiers' bookkeeping.
    cache.store(TOKENS, data)
    cache.drain()
    with pytest.raises(TypeError, match=rf"request_id: expected a str, got {got}"):
        REQUEST_ID_CALLS[call](cache, request_id)
    assert set(cache.status.slot_states().values()) == {0}  # nothing left pinned
    REQUEST_ID_CALLS[call](cache, "r-1")  # a string is taken
    if call != "end_request":
        with pytest.raises(TypeError, match="request_id: expected a str, got NoneType"):
            cache.end_request(None)  # type: ignore[arg-type]


def test_commit_and_record_request_refuse_a_bad_flag_or_count(cache: KVCache) -> None:
    keys = cache.keys(TOKENS)
    assert cache.reserve(keys[:2]) is not None
    with pytest.raises(TypeError, match="success: expected a bool, got str"):
        cache.commit(keys[:2], success="no")  # type: ignore[arg-type]
    assert cache.status.primary.writing == 2  # the refused commit ended nothing
    cache.commit(keys[:2], success=np.bool_(False))  # numpy's bool is a bool
    assert cache.status.primary.writing == 0 and cache.status.primary.free == 8
    with pytest.raises(TypeError, match="num_tokens must be an int, got '8'"):
        cache.record_request(keys, "8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        cache.record_request(keys, -1)


def test_keys_past_the_ready_prefix_are_checked_before_the_tiers_are_asked(
    cache: KVCache, data: np.ndarray
) -> None:
    keys = cache.keys(TOKENS)
    cache.store(TOKENS[:8], data[:2])
    bad: list[ChunkKey] = [*keys[:2], "k" * 32]  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"keys\[2\]: .* got str"):
        cache.probe(bad)
    with pytest.raises(TypeError, match=r"keys\[2\]: .* got str"):
        cache.wait_for_promotions(bad, timeout=1.0)
    with pytest.raises(TypeError, match=r"keys\[0\]: .* got NoneType"):
        cache.probe([None])  # type: ignore[list-item]
    # Nothing was pinned or promoted by the calls refused.
    assert cache.probe(keys).hit_chunks == 2
    assert cache.load(TOKENS, 8, np.zeros((2, LAYOUT.slot_bytes), np.uint8)) == 8


def test_a_callers_bad_keys_never_open_a_healthy_remote_tiers_breaker(
    redis_server: RedisServer, data: np.ndarray
) -> None:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "redis", "url": redis_server.url, "key_prefix": "badkeys:"}],
    }
    with KVCache(config, LAYOUT) as cache:
        for _ in range(10):
            with pytest.raises(TypeError):
                cache.wait_for_promotions(["k" * 32], timeout=0.2)  # type: ignore[list-item]
        (tier,) = cache.manager.tiers
        assert tier.describe()["breaker"] == "closed"
        assert cache.store(TOKENS, data) == 4
        cache.drain()
        cache.reset()
        assert cache.cached_prefix(TOKENS, timeout=5.0) == 16  # promoted from redis


@pytest.mark.parametrize("kind", ["array", "copier"])
def test_a_key_given_twice_is_stored_once_from_its_first_row(
    cache: KVCache, data: np.ndarray, kind: str
) -> None:
    keys = cache.keys(TOKENS)
    twice = cache.chunks([keys[0], keys[1], keys[0]])

    def copier(index: int, slot: np.ndarray) -> None:
        slot[:] = data[index]

    assert cache.store(twice, data[:3] if kind == "array" else copier) == 2
    out = np.zeros((3, LAYOUT.slot_bytes), np.uint8)
    assert cache.load(twice, 12, out) == 12
    np.testing.assert_array_equal(out, data[[0, 1, 0]])
    cache.drain()
    assert cache.manager.tiers[0].stats.chunks_stored == 2


def test_load_prefix_copies_later_chunks_into_their_own_rows(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS, data)
    cache.drain()  # every chunk in the memory tier too
    cache.reset()
    cache.store(TOKENS[:8], data[:2])  # the first two in the CPU tier, the others promoted
    out = np.zeros_like(data)
    assert cache.load_prefix(TOKENS, out) == 16
    np.testing.assert_array_equal(out, data)
    assert cache.manager.primary.busy_counts()["pinned"] == 0


# load: never more than was there, never past the tokens given ----------------


def test_load_past_the_cached_prefix_returns_what_it_loaded(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS[:8], data[:2])
    out = np.zeros_like(data)
    assert cache.load(TOKENS, 16, out) == 8
    np.testing.assert_array_equal(out[:2], data[:2])
    assert not out[2:].any()
    fresh = np.zeros_like(data)
    assert cache.load(list(range(500, 516)), 16, fresh) == 0  # never cached at all
    assert not fresh.any()


@pytest.mark.parametrize(
    ("num_tokens", "error", "message"),
    [
        (20, ValueError, "exceeds the 16 tokens"),
        (6, ValueError, "not a multiple of chunk_tokens=4"),
        (-4, ValueError, ">= 0"),
        (8.0, TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
    ],
)
def test_load_refuses_a_bad_num_tokens(
    cache: KVCache, data: np.ndarray, num_tokens: Any, error: type[Exception], message: str
) -> None:
    cache.store(TOKENS, data)
    with pytest.raises(error, match=message):
        cache.load(TOKENS, num_tokens, np.zeros_like(data))
    with pytest.raises(ValueError, match="exceeds the 16 tokens"):
        cache.load([*TOKENS, 1, 2, 3], 20, np.zeros((5, LAYOUT.slot_bytes), np.uint8))


def test_load_refuses_an_out_it_could_not_fill(cache: KVCache, data: np.ndarray) -> None:
    cache.store(TOKENS, data)
    read_only = np.zeros_like(data)
    read_only.flags.writeable = False
    refused: list[tuple[np.ndarray, str]] = [
        (np.zeros((3, LAYOUT.slot_bytes), np.uint8), "expected"),
        (np.zeros((4, LAYOUT.slot_bytes // 2), np.float32), "expected"),
        (np.zeros((4, 2 * LAYOUT.slot_bytes), np.uint8)[:, ::2], "not C-contiguous"),
        (read_only, "read-only"),
    ]
    for out, message in refused:
        with pytest.raises(ValueError, match=message):
            cache.load(TOKENS, 16, out)
    cache.drain()
    assert cache.manager.primary.busy_counts()["pinned"] == 0


def test_a_held_lookup_loads_at_most_what_it_holds(cache: KVCache, data: np.ndarray) -> None:
    cache.store(TOKENS[:8], data[:2])
    with cache.lookup(TOKENS) as found:
        assert (found.num_tokens, found.num_chunks, found.pending) == (8, 2, False)
        with pytest.raises(ValueError, match="exceeds the 8 tokens"):
            found.load(np.zeros_like(data), 16)
        out = np.zeros_like(data)
        assert found.load(out, 4) == 4
        np.testing.assert_array_equal(out[0], data[0])
        assert not out[1:].any()
    assert found.released
    with pytest.raises(ClosedError, match="released"):
        found.load(out)


# close: every later call raises one clear error ------------------------------

CALLS: dict[str, Callable[[KVCache], object]] = {
    "lookup": lambda c: c.lookup(TOKENS),
    "cached_prefix": lambda c: c.cached_prefix(TOKENS),
    "load": lambda c: c.load(TOKENS, 16, np.zeros((4, LAYOUT.slot_bytes), np.uint8)),
    "store": lambda c: c.store(TOKENS, np.zeros((4, LAYOUT.slot_bytes), np.uint8)),
    "keys": lambda c: c.keys(TOKENS),
    "step": lambda c: c.step(),
    "drain": lambda c: c.drain(),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_call_after_close_raises_closed_error(call: str, data: np.ndarray) -> None:
    cache = KVCache({"chunk_tokens": 4, "cpu_bytes_to_use": 8 * LAYOUT.slot_bytes}, LAYOUT)
    cache.store(TOKENS, data)
    held = cache.lookup(TOKENS)
    cache.close()
    with pytest.raises(ClosedError, match="KVCache is closed") as raised:
        CALLS[call](cache)
    assert isinstance(raised.value, KVTierError)
    with pytest.raises(ClosedError, match="KVCache is closed"):
        held.load(np.zeros_like(data))
    held.release()  # the chunks went with the cache: nothing to do, no error
    cache.close()  # idempotent


# token ids and counts are validated, never truncated -------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [1.2] * 16,
        [1.0] * 16,
        [*range(15), 2.5],
        np.full(16, 1.2),
        [True] * 16,
        [*range(15), True],
        np.ones(16, dtype=bool),
        [[1] * 16],
        "abcdefghijklmnop",
        [None] * 16,
    ],
    ids=[
        "floats",
        "integral-floats",
        "one-float",
        "float-array",
        "bools",
        "one-bool",
        "bool-array",
        "2-d",
        "str",
        "none",
    ],
)
def test_token_ids_that_are_not_integers_are_refused(
    cache: KVCache, data: np.ndarray, tokens: Any
) -> None:
    for call in (
        lambda: cache.store(tokens, data),
        lambda: cache.keys(tokens),
        lambda: cache.keyed(tokens),
        lambda: cache.cached_prefix(tokens),
        lambda: cache.load(tokens, 16, np.zeros_like(data)),
    ):
        with pytest.raises((TypeError, ValueError), match=r"tokens|1-D"):
            call()
    assert untouched(cache)


def test_integer_arrays_of_any_width_give_the_keys_of_the_same_list(cache: KVCache) -> None:
    torch = pytest.importorskip("torch")
    expected = cache.keys(TOKENS)
    for tokens in (
        np.array(TOKENS, dtype=np.int32),
        np.array(TOKENS, dtype=np.uint16),
        [np.int64(t) for t in TOKENS],
        tuple(TOKENS),
        torch.tensor(TOKENS),
        torch.tensor(TOKENS, dtype=torch.int32),
    ):
        assert cache.keys(tokens) == expected  # type: ignore[arg-type]  # numpy ints too
    assert cache.keys([1] * 16) != cache.keys([2] * 16)


@pytest.mark.parametrize(
    ("num_chunks", "error", "message"),
    [
        (-1, ValueError, ">= 0"),
        (5, ValueError, "exceeds the 4 full chunks"),
        (True, TypeError, "must be an int"),
        (2.0, TypeError, "must be an int"),
    ],
)
def test_store_refuses_a_bad_num_chunks(
    cache: KVCache, data: np.ndarray, num_chunks: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        cache.store(TOKENS, data, num_chunks=num_chunks)
    assert untouched(cache)


def test_store_num_chunks_stores_exactly_the_leading_chunks(
    cache: KVCache, data: np.ndarray
) -> None:
    assert cache.store(TOKENS, data, num_chunks=0) == 0
    assert cache.store(TOKENS, data[:2], num_chunks=2) == 2
    assert cache.cached_prefix(TOKENS) == 8


def test_close_from_inside_a_copy_is_refused_instead_of_waiting_for_itself(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS, data)

    def closing_copier(index: int, chunk: np.ndarray) -> None:
        cache.close()

    with pytest.raises(KVTierError, match="from inside one of its own calls"):
        cache.load(TOKENS, 4, closing_copier)
    assert not cache.closed
    assert cache.cached_prefix(TOKENS) == 16  # nothing was left pinned or half-closed
    cache.drain()
    assert cache.manager.primary.busy_counts()["pinned"] == 0


# Zero chunks: an empty out or src, as sized from a zero-token hit -----------


def test_loading_or_storing_zero_chunks_takes_arrays_of_zero_rows(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS, data)
    short = TOKENS[:3]  # shorter than one chunk
    hit = cache.cached_prefix(short)
    assert hit == 0
    # Sized from the hit, as an engine would: before, a bare numpy reshape error.
    for empty in (
        np.empty((hit // 4, LAYOUT.slot_bytes), np.uint8),
        np.empty((0, *LAYOUT.chunk_shape), np.float16),
    ):
        assert cache.load(short, hit, empty) == 0
        assert cache.load(TOKENS, 0, empty) == 0
        assert cache.store(short, empty) == 0
        assert cache.store(TOKENS, empty, num_chunks=0) == 0
        with cache.lookup(short) as found:
            assert found.load(empty) == 0
    cache.drain()
    assert cache.manager.primary.busy_counts()["pinned"] == 0


# close: checked before the arguments -----------------------------------------

BAD_CALLS: dict[str, Callable[[KVCache], object]] = {
    "store-bad-src": lambda c: c.store(TOKENS, "not an array"),  # type: ignore[arg-type]
    "store-bad-num_chunks": lambda c: c.store(TOKENS, np.zeros((4, 1)), num_chunks=-1),
    "load-bad-num_tokens": lambda c: c.load(TOKENS, 3, np.zeros((4, 1))),
    "load-bad-out": lambda c: c.load(TOKENS, 16, "not an array"),  # type: ignore[arg-type]
    "lookup-bad-timeout": lambda c: c.lookup(TOKENS, timeout=-1),
    "cached_prefix-float-tokens": lambda c: c.cached_prefix([1.5] * 16),  # type: ignore[list-item]
    "keys-bool-tokens": lambda c: c.keys([True] * 16),
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
def test_a_call_after_close_says_closed_whatever_its_arguments(call: str) -> None:
    cache = KVCache({"chunk_tokens": 4, "cpu_bytes_to_use": 8 * LAYOUT.slot_bytes}, LAYOUT)
    cache.store(TOKENS, np.zeros((4, LAYOUT.slot_bytes), np.uint8))
    held = cache.lookup(TOKENS)
    cache.close()
    with pytest.raises(ClosedError, match="KVCache is closed"):
        BAD_CALLS[call](cache)
    with pytest.raises(ClosedError, match="KVCache is closed"):
        held.load("not an array", -1)  # type: ignore[arg-type]


# waits: a timeout that never runs out is refused -----------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("timeout", float("nan")),  # never past the deadline: waited for ever
        ("timeout", -1),
        ("timeout", True),
        ("timeout", "1"),
        ("poll_s", -0.001),
        ("poll_s", float("nan")),
        ("poll_s", None),
    ],
)
def test_lookup_refuses_a_wait_that_is_not_a_duration(
    cache: KVCache, data: np.ndarray, option: str, value: Any
) -> None:
    cache.store(TOKENS, data)
    for call in (cache.lookup, cache.cached_prefix):
        with pytest.raises(ValueError, match=rf"{option} must be a number of seconds >= 0"):
            call(TOKENS, **{option: value})
    cache.drain()  # the write-through's pins come back
    assert cache.manager.primary.busy_counts()["pinned"] == 0
    assert cache.cached_prefix(TOKENS, timeout=float("inf")) == 16  # for ever is a wait


# more inputs that are not token ids or chunk rows ----------------------------


def test_sets_mappings_and_float_tensors_are_refused_naming_what_was_wrong(
    cache: KVCache, data: np.ndarray
) -> None:
    torch = pytest.importorskip("torch")
    for tokens in (set(TOKENS), dict.fromkeys(TOKENS)):
        with pytest.raises(TypeError, match="tokens: expected a sequence of int token ids"):
            cache.keys(tokens)  # type: ignore[arg-type]
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(TypeError, match=f"tokens: .*got dtype {dtype}"):
            cache.store(torch.tensor(TOKENS, dtype=dtype), data)
    src = torch.zeros(4, LAYOUT.slot_bytes // 2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="src: cannot be read as a numpy array"):
        cache.store(TOKENS, src)
    assert untouched(cache)


# a copier may release its own holder ------------------------------------------


def test_a_copier_releasing_its_own_holder_ends_the_load_then_unpins(
    cache: KVCache, data: np.ndarray
) -> None:
    cache.store(TOKENS, data)
    copied: list[np.ndarray] = []
    with cache.lookup(TOKENS) as found:

        def releasing_copier(index: int, chunk: np.ndarray) -> None:
            found.release()  # before: waited for the holder's own lock, for ever
            copied.append(chunk.copy())  # still pinned: the load is not over

        loader = threading.Thread(target=found.load, args=(releasing_copier,), daemon=True)
        loader.start()
        loader.join(timeout=120)  # a guard against the old deadlock, not a timing assertion
        assert not loader.is_alive(), "the load deadlocked on its own release"
        assert found.released
    np.testing.assert_array_equal(np.stack(copied), data)
    cache.drain()  # the write-through's pins come back
    assert cache.manager.primary.busy_counts()["pinned"] == 0  # unpinned once, at the end
    with pytest.raises(ClosedError, match="released"):
        found.load(np.zeros_like(data))


def test_the_status_view_reports_slots_and_tiers_without_the_internals(tmp_path: Any) -> None:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * LAYOUT.slot_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
    }
    rows = np.ones((3, LAYOUT.slot_bytes), np.uint8)
    with KVCache(config, LAYOUT) as cache:
        tokens = list(range(12))
        assert cache.store(tokens, rows) == 3
        cache.drain()
        held = cache.lookup(tokens)
        primary = cache.status.primary
        assert (primary.num_slots, primary.slot_bytes) == (8, LAYOUT.slot_bytes)
        assert (primary.free, primary.idle, primary.pinned, primary.writing) == (5, 0, 3, 0)
        assert primary.chunks == 3 and primary.held_bytes == 3 * LAYOUT.slot_bytes
        assert set(cache.status.slot_states().values()) == {1}  # pinned once each, by held
        held.release()
        assert set(cache.status.slot_states().values()) == {0}
        (tier,) = cache.status.tiers
        assert (tier.index, tier.tier_type, tier.chunk_count) == (0, "fs", 3)
        assert tier.stats["chunks_stored"] == 3 and tier.held_bytes and tier.held_bytes > 0
        assert tier.facts["root_dir"] == str(tmp_path)
        assert cache.status.tier_types == ["fs"] and not cache.status.busy
        ((tier_type, checks),) = cache.status.health()
        assert tier_type == "fs" and checks and all(check.ok for check in checks)
        keys = cache.keys(tokens)
        assert cache.status.holds([*keys, ChunkKey(b"\0" * len(keys[0]))]) == [True] * 3 + [False]
        cache.reset()  # the primary tier forgets, the fs tier keeps
        assert cache.status.primary.chunks == 0 and cache.status.tiers[0].chunk_count == 3
        assert cache.cached_prefix(cache.chunks(keys)) == 12  # promoted back, by keys alone
        cache.end_request("never-named")  # nothing kept for it: a no-op, not an error
