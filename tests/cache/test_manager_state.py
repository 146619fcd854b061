"""A hypothesis state machine drives the manager against a simple model.

Every chunk's bytes are a function of its key, so any mix-up of slots,
keys or tiers shows up as wrong bytes on load. Checked after every step:
no refcount below -1, no slot shared by two keys, no slot lost; after a
drain nothing is pinned or writing; an eviction that cannot be done in full
changes nothing.
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier import KVCache
from kvtier.keys import ChunkKey
from kvtier.primary.tier import WRITING
from kvtier.testing import FaultyTier, small_layout
from kvtier.tiers.memory import MemoryTier
from tests.support.cache_tiers import tier_at

LAYOUT = small_layout(chunk_tokens=2, head_dim=8)
PREFIXES = [[p * 100 + i for i in range(8)] for p in range(3)]


def pattern(key: bytes) -> np.ndarray:
    """The only bytes ever valid for ``key``."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), LAYOUT.slot_bytes)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCache(
            {
                "chunk_tokens": 2,
                "cpu_bytes_to_use": 6 * LAYOUT.slot_bytes,
                "secondary_tiers": [
                    {
                        "type": "FaultyTier",
                        "module_path": "kvtier.testing.faults",
                        "inner": {"type": "memory", "max_bytes": 40 * (LAYOUT.slot_bytes + 96)},
                        "seed": 3,
                    },
                    {"type": "memory", "io_threads": 1},
                ],
            },
            LAYOUT,
        )
        self.manager = self.cache.manager
        self.faulty = tier_at(self.cache, 0, FaultyTier)
        self.pinned: list[list[ChunkKey]] = []

    def tokens(self, prefix: int, suffix: int, length: int) -> list[int]:
        return (PREFIXES[prefix] + [9000 + suffix] * 8)[:length]

    @rule(
        prefix=st.integers(0, 2),
        suffix=st.integers(0, 3),
        length=st.integers(2, 16),
        succeed=st.booleans(),
    )
    def store(self, prefix: int, suffix: int, length: int, succeed: bool) -> None:
        keys = self.cache.keys(self.tokens(prefix, suffix, length))
        before = self.manager.primary.refcounts()
        reserved = self.manager.prepare_store(keys)
        if reserved is None:
            # Atomic: nothing reserved. (Short of room it collects finished
            # jobs first, which may unpin chunks or end writes: never add one.)
            after = self.manager.primary.refcounts()
            assert set(after) <= set(before)
            assert {k for k, n in after.items() if n == WRITING} <= {
                k for k, n in before.items() if n == WRITING
            }
            return
        for key, slot in reserved.items():
            self.manager.primary.buffer.slot(slot)[:] = pattern(key)
        self.manager.complete_store(list(reserved), success=succeed)

    @rule(prefix=st.integers(0, 2), suffix=st.integers(0, 3), length=st.integers(2, 16))
    def lookup_and_load(self, prefix: int, suffix: int, length: int) -> None:
        keys = self.cache.keys(self.tokens(prefix, suffix, length))
        hits = self.manager.lookup(keys, request_id=f"{prefix}-{suffix}").hit_chunks
        if hits:
            slots = self.manager.prepare_load(keys[:hits])
            for key, slot in zip(keys[:hits], slots, strict=True):
                np.testing.assert_array_equal(self.manager.primary.buffer.slot(slot), pattern(key))
            self.manager.complete_load(keys[:hits])

    @rule(prefix=st.integers(0, 2), length=st.integers(2, 8))
    def pin(self, prefix: int, length: int) -> None:
        keys = self.cache.keys(PREFIXES[prefix][:length])
        if keys and all(self.manager.primary.is_ready(k) for k in keys):
            self.manager.prepare_load(keys)
            self.pinned.append(keys)

    # No rule has a precondition on what the tiers' threads did: which rules
    # are enabled must not depend on timing, or hypothesis finds the same
    # choices leading to other rules and stops (FlakyStrategyDefinition).
    # A rule that does not apply does nothing instead.

    @rule()
    def unpin(self) -> None:
        if self.pinned:
            self.manager.complete_load(self.pinned.pop())

    @rule()
    def step(self) -> None:
        self.manager.step()

    @rule(broken=st.booleans(), fail_rate=st.sampled_from([0.0, 0.5, 1.0]))
    def set_faults(self, broken: bool, fail_rate: float) -> None:
        self.faulty.broken = broken
        self.faulty.fail_rate = fail_rate

    @rule(index=st.integers(0, 100))
    def corrupt_a_stored_chunk(self, index: int) -> None:
        inner = self.faulty.inner
        assert isinstance(inner, MemoryTier)
        with inner.backend._chunks_lock:
            keys = list(inner.backend._chunks)
        if keys:
            inner.backend.corrupt_for_tests(keys[index % len(keys)])

    @rule()
    def drain_then_nothing_is_busy(self) -> None:
        if self.pinned:
            return
        self.manager.drain()
        assert not self.manager.busy
        assert all(refs == 0 for refs in self.manager.primary.refcounts().values())

    @rule()
    def reset(self) -> None:
        if self.pinned:
            return
        self.manager.reset()
        assert len(self.manager.primary) == 0

    @invariant()
    def slots_are_consistent(self) -> None:
        primary = self.manager.primary
        assert all(refs >= -1 for refs in primary.refcounts().values())
        resident = primary.slots()
        slots, free = list(resident.values()), primary.free_slots()
        assert len(slots) == len(set(slots))
        assert len(slots) + len(free) == primary.num_slots
        assert set(slots).isdisjoint(free)
        assert set(resident) == set(primary.refcounts())
        idle = {k for k, r in primary.refcounts().items() if r >= 0}
        assert len(primary.policy) == len(idle)
        assert all(k in primary.policy for k in idle)

    def teardown(self) -> None:
        self.faulty.broken = False
        while self.pinned:
            self.manager.complete_load(self.pinned.pop())
        self.cache.close()


ManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestManagerStateMachine = ManagerMachine.TestCase
