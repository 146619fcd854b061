"""The primary tier: page-aligned slots, reference counts, atomic stores."""

import ctypes
import mmap
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from kvtier import ChunkKey, ConfigError, KVCache, load_config
from kvtier.policies.lru import LRUCachePolicy
from kvtier.primary import WRITING, PrimaryTier, SlotBuffer, loops
from kvtier.primary.buffer import populate_now
from kvtier.testing import small_layout
from kvtier.testing.policy_suite import key


@pytest.fixture(autouse=True, params=sorted(loops.IMPLEMENTATIONS))
def slot_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test once per implementation of the per-chunk loops (compiled
    where kvtier was built with a C compiler, and Python)."""
    monkeypatch.setattr(loops, "active", loops.IMPLEMENTATIONS[request.param])
    return str(request.param)


@pytest.fixture
def primary() -> PrimaryTier:
    return PrimaryTier(SlotBuffer(4, 4096), LRUCachePolicy(4))


def stored(primary: PrimaryTier, *ids: int) -> list[ChunkKey]:
    keys = [key(i) for i in ids]
    assert primary.prepare_store(keys) is not None
    primary.complete_store(keys, True)
    return keys


def test_buffer_is_page_aligned_and_shaped() -> None:
    buffer = SlotBuffer(3, 8192)
    assert buffer.view.shape == (3, 8192) and buffer.view.readonly is False
    address = buffer.array.ctypes.data
    assert address % mmap.PAGESIZE == 0
    assert buffer.slot(1).ctypes.data - address == 8192
    buffer.close()


def resident_bytes(region: mmap.mmap) -> int:
    """Bytes of the memory area holding ``region`` that are mapped in (``/proc/self/smaps``)."""
    view = ctypes.c_char.from_buffer(region)
    start = ctypes.addressof(view)
    del view
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(part, 16) for part in first.split("-"))
                inside = low <= start < high
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="mapped pages read from /proc/self/smaps"
)
def test_populate_now_maps_every_page_ahead_of_first_use() -> None:
    region = mmap.mmap(-1, 8 << 20)
    try:
        before = resident_bytes(region)
        if not populate_now(region):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
        assert resident_bytes(region) - before >= 8 << 20
        assert region[:16] == bytes(16)  # contents kept (zeros, as mapped)
    finally:
        region.close()


def test_refcounts_follow_the_contract(primary: PrimaryTier) -> None:
    keys = [key(1), key(2)]
    slots = primary.prepare_store(keys)
    assert slots is not None and sorted(slots.values()) == [0, 1]
    assert primary.refcount(keys[0]) == WRITING and not primary.is_ready(keys[0])
    primary.complete_store(keys, True)
    assert primary.refcount(keys[0]) == 0 and primary.is_ready(keys[0])
    assert primary.prepare_load(keys) == [slots[keys[0]], slots[keys[1]]]
    primary.prepare_load(keys[:1])
    assert primary.refcount(keys[0]) == 2
    primary.complete_load(keys)
    primary.complete_load(keys[:1])
    assert primary.refcount(keys[0]) == 0
    with pytest.raises(ValueError, match="not pinned"):
        primary.complete_load(keys[:1])


def test_failed_store_frees_the_slot(primary: PrimaryTier) -> None:
    slots = primary.prepare_store([key(1)])
    primary.complete_store([key(1)], False)
    assert primary.refcount(key(1)) is None and len(primary) == 0
    assert primary.busy_counts()["free"] == 4
    assert slots is not None
    assert primary.prepare_store([key(2)]) == {key(2): slots[key(1)]}  # the slot is reused


def test_prepare_store_skips_resident_keys(primary: PrimaryTier) -> None:
    stored(primary, 1)
    assert list(primary.prepare_store([key(1), key(2)]) or {}) == [key(2)]


def test_prepare_store_evicts_idle_chunks_in_policy_order(primary: PrimaryTier) -> None:
    stored(primary, 1, 2, 3, 4)
    primary.touch([key(1)])
    reserved = primary.prepare_store([key(5)])
    assert reserved is not None and key(2) not in primary.slots()
    assert primary.evictions == 1


def test_prepare_store_is_atomic_when_pinned_chunks_block_it(primary: PrimaryTier) -> None:
    stored(primary, 1, 2, 3, 4)
    primary.prepare_load([key(1), key(2), key(3)])
    before = primary.refcounts()
    assert primary.prepare_store([key(5), key(6)]) is None
    assert primary.refcounts() == before and primary.evictions == 0
    assert list(primary.prepare_store([key(5)]) or {}) == [key(5)]
    assert not primary.is_ready(key(4))


def test_chunks_of_the_same_request_are_never_evicted_for_it(primary: PrimaryTier) -> None:
    stored(primary, 1, 2, 3, 4)
    # key(1) is idle and least recent, but it belongs to the request storing key(5).
    reserved = primary.prepare_store([key(1), key(5)])
    assert reserved is not None and primary.is_ready(key(1)) and not primary.is_ready(key(2))


def test_writing_chunks_are_never_evicted(primary: PrimaryTier) -> None:
    assert primary.prepare_store([key(1), key(2), key(3), key(4)]) is not None
    assert primary.prepare_store([key(5)]) is None


def test_prepare_load_is_atomic(primary: PrimaryTier) -> None:
    stored(primary, 1)
    with pytest.raises(KeyError):
        primary.prepare_load([key(1), key(9)])
    assert primary.refcount(key(1)) == 0


def test_clear_refuses_while_busy(primary: PrimaryTier) -> None:
    stored(primary, 1)
    primary.prepare_load([key(1)])
    with pytest.raises(RuntimeError, match="busy"):
        primary.clear()
    primary.complete_load([key(1)])
    primary.clear()
    assert len(primary) == 0 and len(primary.policy) == 0


def test_named_shared_memory_is_visible_to_another_process() -> None:
    name = f"kvtier-test-{uuid.uuid4().hex}"
    buffer = SlotBuffer(2, 4096, shared_name=name)
    try:
        buffer.slot(1)[:] = 7
        code = (
            "from kvtier.primary import SlotBuffer\n"
            f"b = SlotBuffer.attach({name!r}, 2, 4096)\n"
            "assert (b.slot(1) == 7).all()\n"
            "b.slot(0)[:] = 9\n"
            "b.close()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert (buffer.slot(0) == 9).all()
        with pytest.raises(ValueError, match="expected 3 slots"):
            SlotBuffer.attach(name, 3, 4096)
        with pytest.raises(FileExistsError):
            SlotBuffer(2, 4096, shared_name=name)
    finally:
        buffer.close()
    with pytest.raises(FileNotFoundError):
        SlotBuffer.attach(name, 2, 4096)


def test_a_buffer_keeps_its_file_open_only_to_map_it_ahead() -> None:
    """The creator maps a named buffer ahead (its file's pages allocated
    first) and keeps its file open for that; a process that attaches never
    maps it ahead, and keeps one descriptor fewer (Python's mmap holds one
    of its own in both)."""
    name = f"kvtier-test-{uuid.uuid4().hex}"

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_files()
    buffer = SlotBuffer(2, 4096, shared_name=name)
    try:
        created = open_files() - before
        attached = SlotBuffer.attach(name, 2, 4096)
        assert open_files() - before - created == created - 1
        attached.close()
    finally:
        buffer.close()
    assert open_files() == before


@pytest.mark.parametrize("name", ["../etc/passwd", "", "a/b", ".hidden"])
def test_shared_memory_names_cannot_be_paths(name: str) -> None:
    with pytest.raises(ValueError, match="shared memory name"):
        SlotBuffer(1, 4096, shared_name=name)
    # Nor in a configuration, which says so when it loads, before any memory.
    with pytest.raises(ConfigError) as info:
        load_config({"shared_memory_name": name})
    assert [where for where, _ in info.value.problems] == ["shared_memory_name"]


def test_a_shared_memory_name_in_use_fails_at_start_naming_the_option() -> None:
    layout = small_layout()
    config = {"chunk_tokens": layout.chunk_tokens, "cpu_bytes_to_use": "1MiB"}
    name = f"kvtier-test-taken-{os.getpid()}"
    with KVCache({**config, "shared_memory_name": name}, layout):
        with pytest.raises(ConfigError) as info:
            KVCache({**config, "shared_memory_name": name}, layout)
        ((where, problem),) = info.value.problems
        assert where == "shared_memory_name"
        assert problem.startswith(f"/dev/shm/{name} exists: another engine's primary tier")
        assert os.path.exists(f"/dev/shm/{name}")  # the first cache's slots are left alone


def test_slots_are_writable_views_not_copies() -> None:
    buffer = SlotBuffer(2, 4096)
    flat = buffer.view.cast("B")
    buffer.slot(1)[:4] = np.frombuffer(b"abcd", dtype=np.uint8)
    assert bytes(flat[4096:4100]) == b"abcd"
    buffer.close()


def test_protected_keys_are_never_victims(primary: PrimaryTier) -> None:
    stored(primary, 1, 2, 3, 4)
    assert primary.prepare_store([key(5)], protect=[key(1), key(2), key(3), key(4)]) is None
    assert list(primary.prepare_store([key(5)], protect=[key(1)]) or {}) == [key(5)]
    assert primary.is_ready(key(1)) and not primary.is_ready(key(2))


def test_complete_load_is_atomic(primary: PrimaryTier) -> None:
    stored(primary, 1, 2)
    primary.prepare_load([key(1)])
    with pytest.raises(ValueError, match="not pinned"):
        primary.complete_load([key(1), key(2)])
    assert primary.refcount(key(1)) == 1
    with pytest.raises(ValueError, match="not pinned"):
        primary.complete_load([key(1), key(1)])
    primary.complete_load([key(1)])
    assert primary.refcount(key(1)) == 0


def _smaps_bytes(address: int, field: str) -> int:
    """A field (``Rss``, ``AnonHugePages``...) of the mapping holding ``address``."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                mapping = start <= address < end
            elif mapping and head == f"{field}:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_private_buffer_is_backed_by_huge_pages() -> None:
    policy = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(policy) as handle:
            if "[never]" in handle.read():
                pytest.skip("transparent huge pages are disabled on this kernel ([never])")
    except FileNotFoundError:
        pytest.skip(f"no transparent huge pages on this platform ({policy} is missing)")
    buffer = SlotBuffer(8, 2 << 20)
    try:
        buffer.array[:] = 1  # huge pages are allocated on first touch
        assert _smaps_bytes(buffer.array.ctypes.data, "AnonHugePages") >= 8 << 20
    finally:
        buffer.close()


def test_closing_an_unlinked_buffer_leaves_a_new_one_of_its_name_alone() -> None:
    name = f"kvtier-test-{uuid.uuid4().hex}"
    first = SlotBuffer(1, 4096, shared_name=name)
    first.unlink()
    second = SlotBuffer(1, 4096, shared_name=name)  # the name is free again
    try:
        first.close()
        SlotBuffer.attach(name, 1, 4096).close()  # still there
    finally:
        second.close()


def test_complete_store_can_hand_chunks_over_already_pinned(primary: PrimaryTier) -> None:
    keys = [key(1), key(2)]
    slots = primary.prepare_store(keys)
    assert slots is not None
    assert primary.complete_store([*keys, key(9)], True, pins=2) == slots  # key 9: not written
    assert [primary.refcount(k) for k in keys] == [2, 2]
    # Ready and pinned in one step: no eviction can take them before their readers do.
    assert primary.prepare_store([key(3), key(4), key(5)]) is None
    primary.complete_load(keys)
    primary.complete_load(keys)
    assert primary.prepare_store([key(3), key(4), key(5)]) is not None
    with pytest.raises(ValueError, match="pins must be >= 0"):
        primary.complete_store(keys, True, pins=-1)


def test_lookup_pinned_finds_touches_and_pins_the_leading_ready_chunks(
    primary: PrimaryTier,
) -> None:
    first, second, third = stored(primary, 1, 2, 3)
    chain = [first, second, key(9), third]
    assert primary.lookup_pinned(chain) == [primary.slot_of(first), primary.slot_of(second)]
    assert [primary.refcount(k) for k in chain] == [1, 1, None, 0]
    assert primary.hits == 2
    assert primary.lookup_pinned([first], count_hits=False) == [primary.slot_of(first)]
    assert primary.hits == 2 and primary.refcount(first) == 2
    # Touched: the idle third chunk is now the least recently used.
    assert primary.policy.evict(1, {}) == [third]
    assert primary.lookup_pinned([key(8), first]) == []


def test_lookup_pinned_pins_nothing_when_the_policy_raises(
    primary: PrimaryTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = stored(primary, 1, 2)

    def broken(keys: object) -> None:
        raise RuntimeError("policy bug")

    monkeypatch.setattr(primary.policy, "touch", broken)
    with pytest.raises(RuntimeError, match="policy bug"):
        primary.lookup_pinned([first, second])
    assert primary.busy_counts()["pinned"] == 0 and primary.hits == 0


def test_pin_prefix_pins_the_leading_ready_chunks_and_never_raises(primary: PrimaryTier) -> None:
    first, second = stored(primary, 1, 2)
    writing = key(3)
    assert primary.prepare_store([writing]) is not None
    chain = [first, second, writing, key(4)]
    assert primary.pin_prefix(chain) == [primary.slot_of(first), primary.slot_of(second)]
    assert [primary.refcount(k) for k in chain] == [1, 1, WRITING, None]
    assert primary.pin_prefix([key(7), first]) == []  # a missing first chunk: nothing
    assert primary.refcount(first) == 1
    primary.complete_load([first, second])
    assert primary.busy_counts()["pinned"] == 0


def test_a_policy_that_raises_on_insert_loses_the_chunk_never_the_slot(
    primary: PrimaryTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_insert(chunk: ChunkKey) -> None:
        raise RuntimeError("policy bug")

    def broken_insert_all(chunks: list[ChunkKey]) -> None:
        raise RuntimeError("policy bug")

    monkeypatch.setattr(primary.policy, "insert", broken_insert)
    monkeypatch.setattr(primary.policy, "insert_all", broken_insert_all)
    keys = [key(1), key(2)]
    assert primary.prepare_store(keys) is not None
    assert primary.complete_store(keys, True) == {}
    assert len(primary) == 0 and primary.busy_counts()["free"] == 4


def test_a_policy_that_refuses_one_key_of_a_batch_loses_only_that_chunk(
    primary: PrimaryTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = primary.policy
    real_insert = policy.insert

    def picky_insert(chunk: ChunkKey) -> None:
        if chunk == key(2):
            raise RuntimeError("policy bug")
        real_insert(chunk)

    def picky_insert_all(chunks: list[ChunkKey]) -> None:
        for chunk in chunks:
            picky_insert(chunk)

    monkeypatch.setattr(policy, "insert", picky_insert)
    monkeypatch.setattr(policy, "insert_all", picky_insert_all)
    keys = [key(1), key(2), key(3)]
    reserved = primary.prepare_store(keys)
    assert reserved is not None
    ready = primary.complete_store(keys, True)
    assert ready == {key(1): reserved[key(1)], key(3): reserved[key(3)]}
    assert key(2) not in policy and key(3) in policy
    assert len(primary) == 2 and primary.busy_counts()["free"] == 2


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "leaf-lru"])
def test_evictions_sparing_a_long_chain_never_build_its_union(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion stores a chain chunk by chunk, protecting the whole chain:
    a policy that took the protected view's exact length would copy the
    chain once per chunk (quadratic in the chain). Counted, not timed."""
    from kvtier.policies import CachePolicyFactory
    from kvtier.primary import tier as tier_module

    unions = []
    build = tier_module._Protected._union

    def counted_union(view: tier_module._Protected) -> set[ChunkKey]:
        unions.append(1)
        return build(view)

    monkeypatch.setattr(tier_module._Protected, "_union", counted_union)
    slots = 80
    primary = PrimaryTier(
        SlotBuffer(slots, 64), CachePolicyFactory.create_cache_policy(name, slots)
    )
    stored(primary, *range(slots))
    chain = [key(100 + i) for i in range(64)]
    protect = set(chain)
    for chunk in chain:
        reserved = primary.prepare_store([chunk], protect=protect)
        assert reserved is not None
        primary.complete_store(list(reserved))
    assert primary.evictions == 64 and unions == []
    # The view still answers len exactly, for any other reader.
    view = tier_module._Protected(primary._pins.keys(), {key(1)}, {key(1), key(2)})
    assert len(view) == 2 and view.size_bound() >= 2
