"""The cache policy contract, as tests any policy can inherit."""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy
from kvtier.policies.factory import policy_registry


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(32, "little"))


class PolicyContractTests:
    """Inherit and set :attr:`policy_name` (and :attr:`module_path` if out-of-tree)."""

    policy_name: ClassVar[str] = ""
    module_path: ClassVar[str | None] = None
    capacity: ClassVar[int] = 8

    def make_policy(self, capacity: int | None = None) -> CachePolicy:
        cls = policy_registry.resolve(self.policy_name, self.module_path)
        return cls(capacity or self.capacity)

    def test_tracks_inserted_keys(self) -> None:
        policy = self.make_policy()
        for i in range(5):
            policy.insert(key(i))
        assert len(policy) == 5
        assert all(key(i) in policy for i in range(5))
        assert policy.get(key(3)) and not policy.get(key(99))
        assert key(99) not in policy

    def test_evict_returns_distinct_unprotected_victims(self) -> None:
        policy = self.make_policy()
        for i in range(8):
            policy.insert(key(i))
        protected = {key(0), key(1), key(2)}
        victims = policy.evict(4, protected)
        assert victims is not None and len(victims) == 4 == len(set(victims))
        assert not set(victims) & protected
        assert all(v not in policy for v in victims)
        assert len(policy) == 4

    def test_evict_is_atomic_when_too_few_are_evictable(self) -> None:
        policy = self.make_policy()
        for i in range(6):
            policy.insert(key(i))
        protected = {key(i) for i in range(4)}
        assert policy.evict(3, protected) is None
        assert len(policy) == 6 and all(key(i) in policy for i in range(6))
        assert sorted(policy.evict(2, protected) or []) == sorted([key(4), key(5)])

    def test_evict_zero_is_empty(self) -> None:
        policy = self.make_policy()
        policy.insert(key(1))
        assert policy.evict(0, ()) == []
        assert key(1) in policy

    def test_remove_touch_and_clear(self) -> None:
        policy = self.make_policy()
        for i in range(4):
            policy.insert(key(i))
        policy.remove(key(2))
        policy.remove(key(42))  # absent: no error
        policy.touch([key(0), key(42)])
        assert key(2) not in policy and len(policy) == 3
        policy.clear()
        assert len(policy) == 0 and policy.evict(1, ()) is None

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["insert", "get", "touch", "remove", "evict"]),
                st.integers(0, 20),
                st.integers(0, 4),
            ),
            max_size=120,
        )
    )
    def test_matches_a_set_model(self, ops: list[tuple[str, int, int]]) -> None:
        policy = self.make_policy()
        model: set[ChunkKey] = set()
        for op, i, n in ops:
            k = key(i)
            if op == "insert":
                if k not in model:  # the primary tier never inserts a resident key
                    if len(model) >= self.capacity:
                        victims = policy.evict(1, ())
                        assert victims is not None and len(victims) == 1
                        model -= set(victims)
                    policy.insert(k)
                    model.add(k)
            elif op == "get":
                assert policy.get(k) == (k in model)
            elif op == "touch":
                policy.touch([k])
            elif op == "remove":
                policy.remove(k)
                model.discard(k)
            else:
                protected = {key(j) for j in range(i % 5)}
                victims = policy.evict(n, protected)
                if len(model - protected) < n:
                    assert victims is None
                else:
                    assert victims is not None and len(set(victims)) == n
                    assert set(victims) <= model - protected
                    model -= set(victims)
            assert len(policy) == len(model)
            assert all(m in policy for m in model)


__all__ = ["PolicyContractTests", "key"]

# pytest collects classes named Test*, never this base; ``pytest`` import kept
# so that a missing pytest fails here with a clear ImportError.
_ = pytest
