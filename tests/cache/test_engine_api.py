"""The engine API for engines whose workers copy the bytes, and that the
integrations use it alone (``docs/engine-api.md``)."""

from __future__ import annotations

import ast
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import ChunkKey, KVCache
from kvtier.errors import ClosedError
from kvtier.shared_slots import map_slots
from kvtier.testing import small_layout

LAYOUT = small_layout(chunk_tokens=4, head_dim=16)
TOKENS = list(range(40, 56))  # four chunks


@pytest.fixture
def cache() -> Iterator[KVCache]:
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 4 * LAYOUT.slot_bytes,
        "shared_memory_name": f"kvtier-test-{uuid.uuid4().hex[:12]}",
        "secondary_tiers": [{"type": "memory"}],
    }
    with KVCache(config, LAYOUT) as cache:
        yield cache


def test_a_worker_writes_and_reads_the_slots_the_scheduler_named(cache: KVCache) -> None:
    changes: list[tuple[str, int, bool]] = []
    cache.watch_residency(lambda tier, keys, stored: changes.append((tier, len(keys), stored)))
    name = cache.shared_memory_name
    assert name is not None
    primary = cache.status.primary
    with pytest.raises(TypeError, match=r"num_slots must be an int, got '4' \(str\)"):
        map_slots(name, str(primary.num_slots), primary.slot_bytes)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"holds \d+ bytes, expected \d+ slots"):
        map_slots(name, primary.num_slots + 1, primary.slot_bytes)
    worker = map_slots(name, primary.num_slots, primary.slot_bytes)
    cache.unlink_shared_memory()  # the worker's mapping outlives the name
    assert not (Path("/dev/shm") / name).exists()
    data = np.random.default_rng(1).integers(0, 256, (4, LAYOUT.slot_bytes), dtype=np.uint8)
    keys = list(cache.keyed(TOKENS).keys)
    try:
        reserved = cache.reserve(keys)
        assert reserved is not None and list(reserved) == keys
        assert set(cache.status.slot_states().values()) == {-1}  # being written
        for index, key in enumerate(keys):
            worker.slot(reserved[key])[:] = data[index]
        cache.commit(keys)
        cache.drain()  # cascaded to the memory tier
        assert ("cpu", 4, True) in changes and ("memory", 4, True) in changes
        cache.reset()  # the primary tier forgets; the memory tier keeps them
        found = cache.probe(keys, request_id="r")
        assert (found.hit_chunks, found.pending) == (0, True)  # promotions started
        cache.step()
        cache.drain()
        found = cache.probe(keys, request_id="r")
        assert (found.hit_chunks, found.pending) == (4, False)
        slots = cache.pin(keys)
        assert set(cache.status.slot_states().values()) == {1}
        copied = [worker.slot(slot) for slot in slots]
        assert all(np.array_equal(got, row) for got, row in zip(copied, data, strict=True))
        cache.unpin(keys)
        cache.end_request("r")
        assert set(cache.status.slot_states().values()) == {0}
    finally:
        worker.close()


def test_pin_refuses_a_chunk_not_ready_and_pins_nothing(cache: KVCache) -> None:
    keys = list(cache.keyed(TOKENS).keys)
    reserved = cache.reserve(keys[:2])
    assert reserved is not None
    cache.commit(keys[:2])
    cache.drain()  # the cascades' pins end
    with pytest.raises(KeyError):
        cache.pin(keys[:3])
    assert set(cache.status.slot_states().values()) == {0}


def test_pin_and_unpin_name_a_key_that_is_not_a_key(cache: KVCache) -> None:
    keys = list(cache.keyed(TOKENS).keys)
    reserved = cache.reserve(keys[:2])
    assert reserved is not None
    cache.commit(keys[:2])
    cache.drain()
    with pytest.raises(TypeError, match=r"keys\[2\]: expected a chunk key of 32 bytes .* got str"):
        cache.pin([*keys[:2], "k" * 32])  # type: ignore[list-item]
    assert set(cache.status.slot_states().values()) == {0}  # nothing pinned
    cache.pin(keys[:2])
    with pytest.raises(TypeError, match=r"keys\[1\]: .* got NoneType"):
        cache.unpin([keys[0], None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"keys: expected a sequence of chunk keys .* got int"):
        cache.unpin(5)  # type: ignore[arg-type]
    cache.unpin(keys[:2])  # the refused unpins released nothing
    assert set(cache.status.slot_states().values()) == {0}
    with pytest.raises(TypeError, match=r"keys: expected a sequence of chunk keys .* got str"):
        cache.pin("k" * 32)  # type: ignore[arg-type]


def test_a_failed_write_frees_its_slots_and_no_room_reserves_nothing(cache: KVCache) -> None:
    keys = list(cache.keyed(list(range(100, 120))).keys)  # five chunks, four slots
    assert cache.reserve(keys) is None
    reserved = cache.reserve(keys[:4])
    assert reserved is not None and len(reserved) == 4
    assert cache.reserve(keys[4:]) is None  # every slot is being written
    cache.commit(keys[:4], success=False)
    assert cache.status.slot_states() == {} and cache.status.primary.free == 4
    assert cache.probe(keys).hit_chunks == 0


SPLIT_CALLS: dict[str, Callable[[KVCache, Sequence[ChunkKey]], object]] = {
    "probe": lambda c, keys: c.probe(keys),
    "collect": lambda c, keys: c.collect(),
    "pin": lambda c, keys: c.pin(keys),
    "unpin": lambda c, keys: c.unpin(keys),
    "reserve": lambda c, keys: c.reserve(keys),
    "commit": lambda c, keys: c.commit(keys),
}


@pytest.mark.parametrize("call", sorted(SPLIT_CALLS))
def test_the_split_calls_after_close_raise_closed_error(call: str) -> None:
    cache = KVCache({"chunk_tokens": 4, "cpu_bytes_to_use": 4 * LAYOUT.slot_bytes}, LAYOUT)
    keys = cache.keys(TOKENS)
    cache.close()
    with pytest.raises(ClosedError, match="KVCache is closed"):
        SPLIT_CALLS[call](cache, keys)


def internals_reached(source: str) -> list[str]:
    """``.manager`` anywhere, and ``.primary`` but on a status view (``status.primary``)."""
    reached: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        on_status = (isinstance(value, ast.Attribute) and value.attr == "status") or (
            isinstance(value, ast.Name) and value.id == "status"
        )
        if node.attr == "manager" or (node.attr == "primary" and not on_status):
            reached.append((node.lineno, f"line {node.lineno}: .{node.attr}"))
    return [where for _, where in sorted(reached)]


def test_the_finder_of_internals_finds_them() -> None:
    source = "kv.manager.step()\nkv.status.primary.hits\nx = cache.primary.buffer\nstatus.primary\n"
    assert internals_reached(source) == ["line 1: .manager", "line 3: .primary"]


def test_no_integration_reaches_the_manager_or_the_primary_tier() -> None:
    """What the import contract cannot see: attributes of a KVCache in hand."""
    integrations = Path(kvtier.__file__).resolve().parent / "integrations"
    reached = {
        str(path.relative_to(integrations)): found
        for path in sorted(integrations.rglob("*.py"))
        if (found := internals_reached(path.read_text()))
    }
    assert reached == {}


def test_the_exported_tier_names_are_those_residency_listeners_hear() -> None:
    types = ["memory", "example", "memory"]
    config = {"chunk_tokens": 4, "secondary_tiers": [{"type": t} for t in types]}
    names = [kvtier.PRIMARY_TIER_NAME, *kvtier.tier_names(types)]
    assert names == ["cpu", "memory:1", "example", "memory:2"]
    heard: set[str] = set()
    with KVCache(config, LAYOUT) as cache:
        cache.watch_residency(lambda tier, keys, stored: heard.add(tier))
        rows = np.zeros((len(TOKENS) // 4, LAYOUT.slot_bytes), dtype=np.uint8)
        assert cache.store(TOKENS, rows) == 4
        cache.drain()  # the cascades to every tier
    assert heard == set(names)
