"""The cache policy contract, as tests any policy can inherit."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy, Clock
from kvtier.policies.factory import policy_registry
from kvtier.testing.hang_guard import DEFAULT_CALL_TIMEOUT_S, HangGuard


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(32, "little"))


def guarded(test: Callable[..., None]) -> Callable[..., None]:
    """Run the test's body under the suite's hang guard (its calls into the
    policy are too many and too quick to bound one by one)."""

    @functools.wraps(test)
    def run(self: PolicyContractTests, *args: Any, **kwargs: Any) -> None:
        # A suite that builds its policy in make_policy, without a name, still
        # gets the guard; its failures then name the test, not the method.
        plugin = self.policy_class() if self.policy_name else CachePolicy
        guard = HangGuard(plugin, self.call_timeout_s)
        guard(test.__name__, lambda: test(self, *args, **kwargs))

    return run


def ticking_clock() -> Clock:
    """A clock that reads 0.0, 1.0, 2.0...: one second more at each reading."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


class PolicyContractTests:
    """Inherit and set :attr:`policy_name` (and :attr:`module_path` if out-of-tree)."""

    policy_name: ClassVar[str] = ""
    module_path: ClassVar[str | None] = None
    capacity: ClassVar[int] = 8
    #: Two policies fed the same calls pick the same victims. Twin tests use
    #: this to show that a failed ``evict`` or ``in`` changes nothing. Each
    #: policy gets ``rng=random.Random(0)`` and a clock that advances one
    #: second per reading, so a policy that draws only on ``self.rng`` and
    #: ``self.clock`` is deterministic. Set it to ``False`` only for a policy
    #: whose choices depend on anything else (threads, ``id()``, the wall
    #: clock): the twin tests are then skipped, the others still run.
    deterministic: ClassVar[bool] = True
    #: Seconds each test may run before it fails as hung, naming the policy
    #: method it is stuck in. A hang guard, not a speed check: raise it for a
    #: policy that is that slow.
    call_timeout_s: ClassVar[float] = DEFAULT_CALL_TIMEOUT_S

    def policy_class(self) -> type[CachePolicy]:
        """The class under test."""
        return policy_registry.resolve(self.policy_name, self.module_path)

    def make_policy(self, capacity: int | None = None) -> CachePolicy:
        cls = self.policy_class()
        return cls(capacity or self.capacity, rng=random.Random(0), clock=ticking_clock())

    def make_twins(self, capacity: int | None = None) -> tuple[CachePolicy, CachePolicy]:
        if not self.deterministic:
            pytest.skip(f"{self.policy_name} is not deterministic")
        return self.make_policy(capacity), self.make_policy(capacity)

    @guarded
    def test_tracks_inserted_keys(self) -> None:
        policy = self.make_policy()
        for i in range(5):
            policy.insert(key(i))
        assert len(policy) == 5
        assert all(key(i) in policy for i in range(5))
        assert policy.get(key(3)) and not policy.get(key(99))
        assert key(99) not in policy

    @guarded
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

    @guarded
    def test_evict_is_atomic_when_too_few_are_evictable(self) -> None:
        policy = self.make_policy()
        for i in range(6):
            policy.insert(key(i))
        protected = {key(i) for i in range(4)}
        assert policy.evict(3, protected) is None
        assert len(policy) == 6 and all(key(i) in policy for i in range(6))
        assert sorted(policy.evict(2, protected) or []) == sorted([key(4), key(5)])

    @guarded
    def test_evict_zero_is_empty(self) -> None:
        policy = self.make_policy()
        policy.insert(key(1))
        assert policy.evict(0, ()) == []
        assert key(1) in policy

    @guarded
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

    @guarded
    def test_evict_more_than_tracked_is_none(self) -> None:
        policy = self.make_policy()
        for i in range(3):
            policy.insert(key(i))
        assert policy.evict(4, ()) is None
        assert len(policy) == 3 and all(key(i) in policy for i in range(3))

    @guarded
    def test_protected_may_be_any_collection(self) -> None:
        policy = self.make_policy()
        for i in range(4):
            policy.insert(key(i))
        # Duplicates and untracked keys must not count as protected residents.
        protected = [key(0), key(0), key(1), key(1), key(99)]
        assert sorted(policy.evict(2, protected) or []) == [key(2), key(3)]
        assert policy.evict(1, protected) is None
        assert len(policy) == 2

    @guarded
    def test_evict_ends_when_nearly_everything_is_protected(self) -> None:
        capacity = 64
        policy = self.make_policy(capacity)
        for i in range(capacity):
            policy.insert(key(i))
        for _ in range(4):  # saturate any frequency counters
            policy.touch(key(i) for i in range(capacity))
        everything = {key(i) for i in range(capacity)}
        assert policy.evict(1, everything) is None
        assert policy.evict(1, everything - {key(0)}) == [key(0)]
        assert policy.evict(1, everything - {key(capacity - 1)}) == [key(capacity - 1)]
        assert policy.evict(2, everything - {key(5)}) is None
        assert len(policy) == capacity - 2 and key(5) in policy

    @guarded
    def test_insert_all_is_insert_of_each_key_in_order(self) -> None:
        """A batch (how the primary tier inserts) may be faster, never different."""
        batched, single = self.make_twins()
        for policy in (batched, single):
            for i in range(self.capacity):
                policy.insert(key(i))
            policy.touch([key(1), key(2)])
            assert policy.evict(3, {key(1)}) is not None  # leaves ghosts, where kept
        # New keys, a repeat, evicted keys (ghosts) and a resident one, in one batch.
        batch = [key(100), key(0), key(101), key(100), *(key(i) for i in range(3, 6)), key(2)]
        batched.insert_all(batch)
        for k in batch:
            single.insert(k)
        assert len(batched) == len(single)
        assert all((k in batched) == (k in single) for k in map(key, range(200)))
        assert batched.evict(len(batched), ()) == single.evict(len(single), ())

    @guarded
    def test_evict_looks_at_each_protected_key_a_bounded_number_of_times(self) -> None:
        """Cost, not correctness: an eviction of n keys with p protected ones in
        its way tests about n + p keys, never n × p (a promotion evicts once
        per chunk while protecting the whole chain)."""
        capacity = 64
        policy = self.make_policy(capacity)
        for i in range(capacity):
            policy.insert(key(i))
        protected = _CountingKeys(key(i) for i in range(32))  # the oldest half
        victims = policy.evict(16, protected)
        assert victims is not None and not set(victims) & protected.keys
        assert protected.looked_at <= 2 * (32 + 16), protected.looked_at

    @guarded
    def test_failed_evict_changes_nothing(self) -> None:
        """No victim, no ghost, no counter, no adaptive target may move on a failure."""
        failed, twin = self.make_twins()
        for policy in (failed, twin):
            _warm_up(policy, self.capacity)
        survivors = [k for k in map(key, range(3 * self.capacity)) if k in failed]
        assert survivors == [k for k in map(key, range(3 * self.capacity)) if k in twin]
        # Room for one victim short: a partial eviction would have started.
        protected = set(survivors[len(survivors) // 2 + 1 :])
        assert failed.evict(len(survivors) - len(protected) + 1, protected) is None
        assert len(failed) == len(survivors) and all(k in failed for k in survivors)
        for policy in (failed, twin):
            _warm_up(policy, self.capacity, start=self.capacity)
        assert _drain(failed) == _drain(twin)

    @guarded
    def test_contains_is_not_an_access(self) -> None:
        probed, twin = self.make_twins()
        for policy in (probed, twin):
            _warm_up(policy, self.capacity)
        for i in range(3 * self.capacity):
            _ = key(i) in probed
        assert _drain(probed) == _drain(twin)

    @guarded
    def test_clear_forgets_history(self) -> None:
        cleared, fresh = self.make_twins()
        _warm_up(cleared, self.capacity)
        cleared.clear()
        assert len(cleared) == 0 and key(0) not in cleared
        # Re-inserting the old keys must not find ghosts or counters of theirs.
        # The rng's and the clock's progress are not history: both restart.
        for policy in (cleared, fresh):
            policy.rng = random.Random(1)
            policy.clock = ticking_clock()
            _warm_up(policy, self.capacity)
        assert _drain(cleared) == _drain(fresh)

    @guarded
    def test_matches_a_set_model(self) -> None:
        """Random calls against a set; a twin that skips the failed evicts must agree."""

        # Given inside the test, so each subclass runs its own hypothesis test
        # rather than sharing one method across executors.
        @settings(max_examples=60, deadline=None)
        @given(
            st.lists(
                st.tuples(st.sampled_from(_OPS), st.integers(0, 20), st.integers(0, 4)),
                max_size=120,
            )
        )
        def check(ops: list[tuple[str, int, int]]) -> None:
            self.check_against_set_model(ops)

        check()

    def check_against_set_model(self, ops: list[tuple[str, int, int]]) -> None:
        policy = self.make_policy()
        # The twin never sees the evicts that fail, which must leave no trace.
        policies = [policy, self.make_policy()] if self.deterministic else [policy]
        model: set[ChunkKey] = set()

        def call(method: str, *args: Any) -> Any:
            results = [getattr(p, method)(*args) for p in policies]
            assert all(r == results[0] for r in results), f"twins disagree on {method}{args}"
            return results[0]

        for op, i, n in ops:
            k = key(i)
            if op == "insert":
                if k not in model:  # the primary tier never inserts a resident key
                    if len(model) >= self.capacity:
                        victims = call("evict", 1, ())
                        assert victims is not None and len(victims) == 1
                        model -= set(victims)
                    call("insert", k)
                    model.add(k)
            elif op == "get":
                assert call("get", k) == (k in model)
            elif op == "touch":
                call("touch", [k])
            elif op == "remove":
                call("remove", k)
                model.discard(k)
            else:
                protected = {key(j) for j in range(i % 5)}
                if len(model - protected) < n:
                    assert policy.evict(n, protected) is None
                else:
                    victims = call("evict", n, protected)
                    assert victims is not None and len(set(victims)) == n
                    assert set(victims) <= model - protected
                    model -= set(victims)
            assert len(policy) == len(model)
            assert all(m in policy for m in model)
        assert len({tuple(_drain(p)) for p in policies}) == 1


_OPS = ["insert", "get", "touch", "remove", "evict"]


def _warm_up(policy: CachePolicy, capacity: int, start: int = 0) -> None:
    """Fill past capacity with a mix of reused and one-time keys, leaving history."""
    for i in range(start, start + 2 * capacity):
        if len(policy) >= capacity:
            assert policy.evict(1, ()) is not None
        policy.insert(key(i))
        if i % 3 == 0:
            policy.get(key(i))
            policy.touch([key(i // 2), key(i)])
    # Bring back a few evicted keys: ghost hits for policies that keep ghosts.
    for i in range(start, start + capacity // 2):
        if key(i) not in policy:
            if len(policy) >= capacity:
                assert policy.evict(1, ()) is not None
            policy.insert(key(i))


def _drain(policy: CachePolicy) -> list[ChunkKey]:
    """Evict one key at a time until empty: the policy's full eviction order."""
    order = []
    while len(policy):
        victims = policy.evict(1, ())
        assert victims is not None and len(victims) == 1
        order.extend(victims)
    return order


__all__ = ["PolicyContractTests", "key"]


class _CountingKeys(Collection[ChunkKey]):
    """A protected collection that counts every key a policy looks at."""

    def __init__(self, keys: Iterable[ChunkKey]) -> None:
        self.keys = frozenset(keys)
        self.looked_at = 0

    def __contains__(self, item: object) -> bool:
        self.looked_at += 1
        return item in self.keys

    def __iter__(self) -> Iterator[ChunkKey]:
        for item in self.keys:
            self.looked_at += 1
            yield item

    def __len__(self) -> int:
        return len(self.keys)
