"""Each built-in policy against its textbook model: the same calls, the same answers.

Random sequences of every call a policy takes (inserts of new, tracked and
repeated keys; touches of tracked and untracked keys; gets; removals;
clears; evictions with protected keys, at queue heads too, and evictions
that must fail), interleaved with the primary tier's own pattern (touch a
request's hits, evict for its new chunks, insert them). After every step
the model and the policy must have answered alike and track the same keys.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import pytest

from kvtier.keys import ChunkKey
from kvtier.policies import CachePolicy, CachePolicyFactory, arc, s3fifo
from kvtier.testing.policy_suite import key
from tests.policies.policy_models import MODELS, ModelPolicy

STEPS = 3_000
SEEDS = (0, 1, 2)
CAPACITIES = (1, 7, 24)


class Driver:
    """Draws calls at random and makes each on the model and the policy alike."""

    def __init__(self, name: str, capacity: int, seed: int) -> None:
        self.rng = random.Random(f"{name}/{capacity}/{seed}")
        self.policy: CachePolicy = CachePolicyFactory.create_cache_policy(name, capacity)
        self.model: ModelPolicy = MODELS[name](capacity)
        self.capacity = capacity
        # About three times as many keys as fit: ghosts get hit, keys come back.
        self.keys = [key(i) for i in range(3 * capacity + 3)]
        # Prefix chains a request walks from the root, as the primary tier does.
        self.chains = [[key(10_000 * (c + 1) + i) for i in range(capacity + 2)] for c in range(3)]
        self.every_key = self.keys + [k for chain in self.chains for k in chain]
        self.log: list[str] = []
        #: How often each case of interest came up (see :meth:`_count`).
        self.outcomes: Counter[str] = Counter()

    def tracked(self) -> list[ChunkKey]:
        return [k for k in self.every_key if k in self.model]

    def call(self, method: str, *args: Any) -> Any:
        self.log.append(f"{method}{_describe(args)}")
        self._count(method, args)
        expected = getattr(self.model, method)(*args)
        actual = getattr(self.policy, method)(*args)
        assert actual == expected, self._where(f"{method} answered {actual}, model {expected}")
        assert len(self.policy) == len(self.model), self._where("len differs")
        differ = [_name(k) for k in self.every_key if (k in self.policy) != (k in self.model)]
        assert not differ, self._where(f"'in' differs for {differ}")
        # ARC's learned target size of T1: a ghost handled differently shows
        # here, before it changes a choice.
        expected_p = getattr(self.model, "p", None)
        actual_p = getattr(self.policy, "p", None)
        assert actual_p == expected_p, self._where(f"p is {actual_p}, model {expected_p}")
        return expected

    def _count(self, method: str, args: tuple[Any, ...]) -> None:
        """Before the call: which case of interest it is."""
        if method == "evict" and args[0] > 0:
            n, protected = args
            evictable = [k for k in self.tracked() if k not in protected]
            if len(evictable) < n:
                self.outcomes["evict failed"] += 1
            elif any(k in protected for k in self.tracked()):
                self.outcomes["evicted around protected keys"] += 1
        elif method == "get":
            self.outcomes["get hit" if args[0] in self.model else "get missed"] += 1
        elif method == "insert_all" and any(k in self.model for k in args[0]):
            self.outcomes["insert_all of a tracked key"] += 1
        elif method == "touch" and any(k not in self.model for k in args[0]):
            self.outcomes["touch of an untracked key"] += 1

    def _where(self, what: str) -> str:
        return f"{what} after: {'; '.join(self.log[-12:])}"

    def some_key(self) -> ChunkKey:
        """A key, tracked or not about as often."""
        tracked = self.tracked()
        return self.rng.choice(tracked if tracked and self.rng.random() < 0.5 else self.keys)

    def some_keys(self, most: int) -> list[ChunkKey]:
        count = self.rng.randint(0, most)
        pool = self.keys if self.rng.random() < 0.7 else self.tracked() or self.keys
        return [self.rng.choice(pool) for _ in range(count)]

    def protected(self) -> Collection[ChunkKey]:
        tracked = self.tracked()
        rng = self.rng
        choice = rng.random()
        if choice < 0.3 or not tracked:
            chosen: list[ChunkKey] = []
        elif choice < 0.55:
            # The oldest keys the model knows of: at the heads of the queues.
            chosen = tracked[: rng.randint(1, len(tracked))]
        elif choice < 0.8:
            chosen = rng.sample(tracked, rng.randint(1, len(tracked)))
        else:
            # Untracked keys too: a protected collection may name any key.
            chosen = rng.sample(tracked, rng.randint(0, len(tracked))) + self.some_keys(4)
        # Every form a caller may pass: the primary tier's pins dict, a view,
        # a list with repeats (whose len overstates it).
        form: Callable[[list[ChunkKey]], Collection[ChunkKey]] = rng.choice(
            (set, frozenset, dict.fromkeys, lambda keys: dict.fromkeys(keys).keys(), _repeated)
        )
        return form(chosen)

    def step(self) -> None:
        rng = self.rng
        op = rng.random()
        if op < 0.3:
            self.request()
        elif op < 0.42:
            self.call("insert", self.some_key())
        elif op < 0.55:
            self.call("insert_all", self.some_keys(6))
        elif op < 0.68:
            self.call("touch", self.some_keys(6))
        elif op < 0.74:
            self.call("get", self.some_key())
        elif op < 0.8:
            self.call("remove", self.some_key())
        elif op < 0.995:
            self.call("evict", rng.randint(0, 4), self.protected())
        else:
            self.call("clear")

    def request(self) -> None:
        """The primary tier's calls for one request of a prefix chain."""
        rng = self.rng
        chain = rng.choice(self.chains)[: rng.randint(1, self.capacity + 2)]
        hits = 0
        while hits < len(chain) and chain[hits] in self.model:
            hits += 1
        if hits:
            self.call("touch", chain[:hits])
            if rng.random() < 0.3:  # a lookup, then the load of what it found
                self.call("touch", chain[:hits])
        new = chain[hits:]
        room = self.capacity - len(self.model)
        if len(new) > room:
            victims = self.call("evict", len(new) - room, frozenset(chain[:hits]))
            if victims is None:
                return
        self.call("insert_all", new)


def _repeated(keys: list[ChunkKey]) -> list[ChunkKey]:
    return keys + keys[: len(keys) // 2]


def _name(k: bytes) -> str:
    return str(int.from_bytes(k, "little"))


def _describe(args: tuple[Any, ...]) -> str:
    def one(arg: Any) -> str:
        if isinstance(arg, bytes):
            return _name(arg)
        if isinstance(arg, int):
            return str(arg)
        return "[" + ",".join(map(_name, arg)) + "]"

    return "(" + ", ".join(map(one, args)) + ")"


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_policy_decides_as_its_model(name: str, seed: int, capacity: int) -> None:
    driver = Driver(name, capacity, seed)
    for _ in range(STEPS):
        driver.step()


#: The policies whose per-key steps run compiled where kvtier was built with
#: a C compiler, else in Python: both are held to the model.
WITH_STEPS = {"arc": arc, "s3fifo": s3fifo}


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("name", "implementation"),
    [
        (name, each)
        for name, module in WITH_STEPS.items()
        for each in sorted(module.IMPLEMENTATIONS)
    ],
)
def test_each_implementation_of_a_policys_steps_decides_as_the_model(
    name: str, implementation: str, seed: int, capacity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = WITH_STEPS[name]
    monkeypatch.setattr(module, "active", module.IMPLEMENTATIONS[implementation])
    driver = Driver(name, capacity, seed)
    for _ in range(STEPS):
        driver.step()


@pytest.mark.parametrize("name", sorted(WITH_STEPS))
def test_the_compiled_policy_steps_are_built_and_run(name: str) -> None:
    module = WITH_STEPS[name]
    if "compiled" in module.IMPLEMENTATIONS:
        assert module.IMPLEMENTATION == "compiled"
        assert module.active is module.IMPLEMENTATIONS["compiled"]
    elif os.environ.get("CI"):
        pytest.fail(f"CI builds kvtier with a C compiler, but {name}'s compiled steps are missing")
    else:
        pytest.skip(f"kvtier was built without a C compiler: {name}'s steps run in Python")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_driver_reaches_every_case(name: str) -> None:
    """The random calls include those the comparison is for."""
    driver = Driver(name, 7, 0)
    for _ in range(STEPS):
        driver.step()
    seen = driver.outcomes
    for case in ("evict failed", "evicted around protected keys", "get hit", "get missed"):
        assert seen[case] > 20, f"{case}: {seen[case]} times"
    assert seen["insert_all of a tracked key"] > 20 and seen["touch of an untracked key"] > 20
