"""The built-in cache policies: the shared contract, then what sets each apart."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import KVCache, load_config
from kvtier.errors import PluginLoadError
from kvtier.keys import ChunkKey
from kvtier.policies import CachePolicy, CachePolicyFactory
from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.s3fifo import S3FIFOCachePolicy
from kvtier.primary import PrimaryTier, SlotBuffer
from kvtier.sim.replay import PrimaryReplay
from kvtier.sim.synthetic import ChatShape, chat_trace
from kvtier.sim.trace import parse_records
from kvtier.testing import PolicyContractTests, small_layout
from kvtier.testing.policy_suite import key
from tests.policies.policy_doubles import RandomOldPolicy

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


@pytest.fixture(scope="module", autouse=True)
def plugins_importable() -> Iterator[None]:
    """Out-of-tree policies in tests/plugins/ import by their module name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGINS))
        yield


class TestLRUContract(PolicyContractTests):
    policy_name = "lru"


class TestARCContract(PolicyContractTests):
    policy_name = "arc"


class TestS3FIFOContract(PolicyContractTests):
    policy_name = "s3fifo"


class TestOutOfTreeFIFOContract(PolicyContractTests):
    policy_name = "FIFOCachePolicy"
    module_path = "fifo_policy"


def make(name: str, capacity: int) -> CachePolicy:
    return CachePolicyFactory.create_cache_policy(name, capacity)


def admit(policy: CachePolicy, k: ChunkKey) -> None:
    """Insert as the primary tier does: make room first when full."""
    if len(policy) >= policy.capacity:
        assert policy.evict(1, ()) is not None
    policy.insert(k)


def working_set_after_scan(name: str) -> set[ChunkKey]:
    """Keys of a twice-accessed working set still resident after a long one-time scan."""
    policy = make(name, 100)
    working_set = [key(i) for i in range(40)]
    for k in working_set:
        admit(policy, k)
    for _ in range(2):
        assert all(policy.get(k) for k in working_set)
    for i in range(1000, 1500):  # five capacities of keys never seen again
        admit(policy, key(i))
    return {k for k in working_set if k in policy}


def test_lru_evicts_least_recently_accessed() -> None:
    policy = make("lru", 8)
    for i in range(5):
        policy.insert(key(i))
    assert policy.get(key(0))
    policy.touch([key(1), key(42)])
    assert key(2) in policy  # a membership test is not an access
    assert policy.evict(3, ()) == [key(2), key(3), key(4)]
    assert policy.evict(1, {key(0)}) == [key(1)]


def test_lru_loses_the_working_set_to_a_scan() -> None:
    assert working_set_after_scan("lru") == set()


def test_arc_keeps_frequent_keys_over_a_one_time_scan() -> None:
    assert len(working_set_after_scan("arc")) == 40


def test_s3fifo_keeps_the_working_set_over_a_one_time_scan() -> None:
    assert len(working_set_after_scan("s3fifo")) == 40


def test_arc_adapts_its_target_on_ghost_hits() -> None:
    policy = make("arc", 4)
    assert isinstance(policy, ARCCachePolicy)
    for i in range(4):
        policy.insert(key(i))
    assert policy.p == 0
    assert policy.evict(2, ()) == [key(0), key(1)]  # seen once: T1, ghosts in B1
    policy.insert(key(0))  # a B1 ghost: recency deserved more room
    assert policy.p == 1
    assert policy.get(key(2))  # T2 now holds key 0 then key 2; T1 holds key 3
    # T1 is at its target, so ARC gives up T2's oldest rather than T1's only key.
    assert policy.evict(1, ()) == [key(0)]
    policy.insert(key(0))  # a B2 ghost: frequency deserved more room
    assert policy.p == 0
    assert policy.evict(1, ()) == [key(3)]


def test_arc_ghost_lists_stay_bounded() -> None:
    policy = make("arc", 8)
    assert isinstance(policy, ARCCachePolicy)
    for i in range(1000):
        admit(policy, key(i))
        if i % 2:
            policy.get(key(i))
    ghosts = [k for k in map(key, range(1000)) if k not in policy]
    # Ghost hits adapt p; a long-forgotten key is a plain miss and leaves p alone.
    p = policy.p
    policy.evict(1, ())
    policy.insert(ghosts[0])
    assert policy.p == p
    assert len(policy._b1) + len(policy._b2) <= 2 * policy.capacity


def test_s3fifo_ghost_hit_enters_main_and_outlives_a_scan() -> None:
    policy = make("s3fifo", 10)
    admit(policy, key(0))
    for i in range(100, 115):  # key 0 leaves the small queue unaccessed: a ghost
        admit(policy, key(i))
    assert key(0) not in policy
    admit(policy, key(0))
    for i in range(200, 300):
        admit(policy, key(i))
    assert key(0) in policy
    lru = make("lru", 10)
    for i in [0, *range(100, 115), 0, *range(200, 300)]:
        if key(i) not in lru:
            admit(lru, key(i))
    assert key(0) not in lru


def test_s3fifo_main_queue_spends_frequency_before_evicting() -> None:
    policy = make("s3fifo", 10)
    for i in range(10):
        admit(policy, key(i))
    policy.touch([key(0), key(1), key(1)])
    # Keys 0 and 1 move to main on the way; key 2 is the first unaccessed one.
    assert policy.evict(1, ()) == [key(2)]
    # Drain: main keeps keys 0 and 1 until their frequency is spent.
    order = [v for _ in range(9) for v in policy.evict(1, ()) or []]
    assert order[-2:] == [key(0), key(1)]


def test_s3fifo_evicts_keys_its_small_queue_promotes_into_an_emptied_main() -> None:
    policy = make("s3fifo", 20)  # small queue's share: 2
    assert isinstance(policy, S3FIFOCachePolicy)
    for i in range(4):
        policy.insert(key(i))
    # Key 0 stays in small, accessed; keys 1-3 go to main by way of the ghost.
    for i in (1, 2, 3):
        policy.remove(key(i))
    policy._small.clear()
    policy._small.append(key(0))
    for i in (1, 2, 3):
        policy._ghost[key(i)] = None
        policy.insert(key(i))
    policy.touch([key(0), key(0), key(3), key(3)])
    # Main runs dry after keys 1-3; the small queue's turn only promotes key 0
    # into main, whose turn then evicts it once its frequency is spent.
    assert policy.evict(4, ()) == [key(1), key(2), key(3), key(0)]
    assert len(policy) == 0


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo"])
def test_primary_tier_never_evicts_busy_chunks(name: str) -> None:
    buffer = SlotBuffer(4, 64)
    primary = PrimaryTier(buffer, make(name, 4))
    try:
        first = [key(i) for i in range(4)]
        assert primary.prepare_store(first) is not None
        primary.complete_store(first)
        primary.prepare_load(first[:3])  # pinned by a reader
        assert primary.prepare_store([key(10), key(11)]) is None
        assert all(primary.is_ready(k) for k in first)
        assert primary.prepare_store([key(10)]) is not None
        assert not primary.is_ready(first[3]) and primary.evictions == 1
        primary.complete_store([key(10)])
        primary.prepare_load([first[0]])  # a second reader of key 0
        primary.complete_load(first[:3])
        # Unpinned chunks are evictable again; key 0 keeps its second reader.
        assert primary.prepare_store([key(11), key(12), key(13), key(14)]) is None
        assert primary.prepare_store([key(11), key(12), key(13)]) is not None
        assert primary.is_ready(first[0]) and primary.evictions == 4
        primary.complete_load([first[0]])
    finally:
        buffer.close()


def test_policy_loaded_by_module_path_from_config(registries: None) -> None:
    config = load_config(
        {"eviction_policy": "FIFOCachePolicy", "cache_policy_module_path": "fifo_policy"}
    )
    policy = CachePolicyFactory.create_cache_policy(
        config.eviction_policy, 3, config.cache_policy_module_path
    )
    assert type(policy).__module__ == "fifo_policy"
    for i in range(3):
        policy.insert(key(i))
    assert policy.get(key(0))
    assert policy.evict(1, ()) == [key(0)]  # first in, first out: accesses do not count


def test_config_names_a_module_without_the_policy_class(registries: None) -> None:
    with pytest.raises(PluginLoadError, match=r"fifo_policy.*NoSuchPolicy"):
        CachePolicyFactory.get_cache_policy_class("NoSuchPolicy", "fifo_policy")


class TestLeafFirstLRUContract(PolicyContractTests):
    policy_name = "leaf-lru"


def test_leaf_lru_gives_up_a_requests_deepest_chunks_first() -> None:
    policy = make("leaf-lru", 8)
    k = [key(i) for i in range(7)]
    for chunk in k[:4]:  # the tier filling: no request boundaries to read, so LRU order
        policy.insert(chunk)
    # A request hits k0 k1 (the lookup's touch, then the load's) and stores k4 k5.
    policy.touch(k[:2])
    policy.touch(k[:2])
    assert policy.evict(2, set(k[:2] + k[4:6])) == [k[2], k[3]]
    policy.insert(k[4])
    policy.insert(k[5])
    # A request that hits nothing stores k6: the older request goes, leaves first.
    assert policy.evict(1, {k[6]}) == [k[5]]
    policy.insert(k[6])
    assert policy.evict(3, ()) == [k[4], k[1], k[0]]
    assert policy.evict(1, ()) == [k[6]]


@pytest.mark.parametrize("seed", range(6))
def test_leaf_lru_touch_of_a_groups_leading_keys_decides_as_touching_key_by_key(
    seed: int,
) -> None:
    """A request's hits are mostly the keys that lead the previous request's
    group; leaf-lru then takes that group over instead of moving its keys.
    A twin whose touches carry one untracked key more (which forbids that)
    must make the very same choices."""
    rng = random.Random(seed)
    capacity = 24
    adopting, moving = make("leaf-lru", capacity), make("leaf-lru", capacity)
    untracked = key(10**6)
    prefixes = [[key(1000 * p + i) for i in range(rng.randint(3, 12))] for p in range(4)]
    for request in range(300):
        chain = rng.choice(prefixes) + [key(10**5 + 10 * request + i) for i in range(3)]
        chain = chain[:capacity]
        hits = 0
        while hits < len(chain) and chain[hits] in adopting:
            hits += 1
        assert all((k in adopting) == (k in moving) for k in chain)
        if hits:
            adopting.touch(chain[:hits])
            moving.touch([*chain[:hits], untracked])
        new = chain[hits:]
        shortfall = len(adopting) + len(new) - capacity
        if shortfall > 0:
            victims = adopting.evict(shortfall, set(chain))
            assert victims == moving.evict(shortfall, set(chain))
            assert victims is not None
        adopting.insert_all(new)
        moving.insert_all(new)
    assert _drain(adopting) == _drain(moving)


class _CountedKey(bytes):
    """A key that counts the equality tests made on it: a search of a list
    makes one per key it passes, a dict lookup of the same object none."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedKey.compared += 1
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


def test_leaf_lru_touch_gathering_long_groups_is_linear_in_them() -> None:
    """A touch that is not led by one group moves each key out of its group:
    searching the group for each key would be quadratic in a long chain."""
    length = 400
    policy = make("leaf-lru", 4 * length)
    chains = [[ChunkKey(_CountedKey(key(1000 * c + i))) for i in range(length)] for c in range(2)]
    for chain in chains:
        policy.insert_all(chain)  # unannounced: one group, oldest first
    _CountedKey.compared = 0
    # Every other key of both chains, interleaved: led by no group.
    policy.touch([k for pair in zip(chains[0][::2], chains[1][::2], strict=True) for k in pair])
    assert _CountedKey.compared <= 4 * length
    # The keys left behind keep their order, oldest first (unannounced groups).
    assert policy.evict(4, ()) == [chains[0][1], chains[0][3], chains[0][5], chains[0][7]]


def _drain(policy: CachePolicy) -> list[ChunkKey]:
    order = []
    while len(policy):
        victims = policy.evict(1, ())
        assert victims is not None
        order += victims
    return order


def replay_hits(name: str, capacity: int, requests: list[tuple[int, ...]]) -> int:
    primary = PrimaryReplay(make(name, capacity))
    return sum(primary.request(blocks) for blocks in requests)


def test_leaf_lru_keeps_the_prefix_lru_strands() -> None:
    # Three slots. The second request re-reads 1 2 3; the third needs one slot.
    # LRU gives up 1, the root, so the last request hits nothing; leaf-lru gives up 3.
    requests = [(1, 2, 3), (1, 2, 3), (4,), (1, 2, 3)]
    assert replay_hits("lru", 3, requests) == 3
    assert replay_hits("leaf-lru", 3, requests) == 3 + 2


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_leaf_lru_never_hits_less_than_lru_on_chat_traces(seed: int) -> None:
    shape = ChatShape(conversations=150, system_prompts=4, think_s=15.0)
    records = enumerate(chat_trace(seed, shape), 1)
    requests = [r.blocks for r in parse_records(records, "chat", block_size=shape.block_size)]
    distinct = len({b for blocks in requests for b in blocks})
    gained = 0
    for share in (0.05, 0.1, 0.2):
        capacity = int(share * distinct)
        lru, leaf = (
            replay_hits("lru", capacity, requests),
            replay_hits("leaf-lru", capacity, requests),
        )
        assert leaf >= lru
        gained += leaf - lru
    assert gained > 0


class TestPolicyUsingClockAndRng(PolicyContractTests):
    policy_name = "RandomOldPolicy"
    module_path = "tests.policies.policy_doubles"


def test_clock_and_rng_have_working_defaults() -> None:
    policy = RandomOldPolicy(4)
    assert isinstance(policy.rng, random.Random)
    first = policy.clock()
    assert isinstance(first, float) and policy.clock() >= first
    assert 0.0 <= policy.rng.random() < 1.0


def test_a_policy_using_clock_and_rng_runs_in_kvcache(registries: None) -> None:
    layout = small_layout(chunk_tokens=4, head_dim=16)
    config = {
        "chunk_tokens": layout.chunk_tokens,
        "cpu_bytes_to_use": 4 * layout.slot_bytes,
        "eviction_policy": "RandomOldPolicy",
        "cache_policy_module_path": "tests.policies.policy_doubles",
    }
    rows = np.random.default_rng(5).integers(0, 256, (4, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        for start in range(0, 48, 16):  # three times four chunks into four slots
            tokens = list(range(start, start + 16))
            assert cache.store(tokens, rows) == 4
            cache.drain()
        last = list(range(32, 48))
        out = np.zeros_like(rows)
        assert cache.load(last, 16, out) == 16  # evictions kept the newest chunks usable
        assert (out == rows).all()
