"""The primary tier's per-chunk loops: the compiled ones do exactly what the
Python ones do, on random states, with repeats, missing keys and errors."""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.primary import loops, rows
from kvtier.testing.policy_suite import key

compiled = loops.IMPLEMENTATIONS.get("compiled")
needs_compiled = pytest.mark.skipif(
    compiled is None, reason="kvtier was built without a C compiler: no compiled loops"
)
python = loops.IMPLEMENTATIONS["python"]
KEYS = [key(i) for i in range(12)]


def test_the_compiled_loops_are_built_and_run() -> None:
    if compiled is not None:
        assert loops.IMPLEMENTATION == "compiled" and loops.active is compiled
        # The row copy is in the same module.
        assert (
            rows.IMPLEMENTATION == "compiled" and rows.copy_rows is rows.IMPLEMENTATIONS["compiled"]
        )
    elif os.environ.get("CI"):
        pytest.fail("CI builds kvtier with a C compiler, but the compiled loops are missing")
    else:
        pytest.skip("kvtier was built without a C compiler: the primary tier loops in Python")


def random_state(rng: random.Random) -> dict[str, Any]:
    """Disjoint ready and writing keys, readers of some ready ones, free slots."""
    shuffled = rng.sample(KEYS, len(KEYS))
    ready = {k: rng.randrange(64) for k in shuffled[: rng.randrange(8)]}
    writing = {k: rng.randrange(64) for k in shuffled[8 : 8 + rng.randrange(4)]}
    pins = {k: rng.randrange(1, 4) for k in ready if rng.random() < 0.4}
    free = [rng.randrange(64) for _ in range(rng.randrange(6))]
    return {"ready": ready, "writing": writing, "pins": pins, "free": free}


def outcome(
    implementation: loops.SlotLoops, name: str, state: dict[str, Any], keys: Any
) -> tuple[Any, ...]:
    """What a call returned or raised (a dict with its order), and every
    container after it (the tier's dicts by content: their order means nothing)."""
    try:
        result: Any = ("returned", CALLS[name](implementation, state, keys))
    except Exception as exc:  # the error is part of the contract
        result = ("raised", type(exc), str(exc))
    if isinstance(result[1], dict):
        result = (result[0], list(result[1].items()))
    return (result, *state.values())


CALLS: dict[str, Callable[[loops.SlotLoops, dict[str, Any], Any], Any]] = {
    "ready_count": lambda f, s, keys: f.ready_count(s["ready"], keys),
    "pin_prefix": lambda f, s, keys: f.pin_prefix(s["ready"], s["pins"], keys),
    "unpin": lambda f, s, keys: f.unpin(s["pins"], keys),
    "new_keys": lambda f, s, keys: f.new_keys(s["ready"], s["writing"], keys),
    "idle_resident": lambda f, s, keys: f.idle_resident(s["ready"], s["pins"], keys),
    "take_slots": lambda f, s, keys: f.take_slots({k: -1 for k in keys}, s["free"], s["writing"]),
    "free_victims": lambda f, s, keys: f.free_victims(s["ready"], s["free"], keys),
    "finish_writes": lambda f, s, keys: f.finish_writes(s["writing"], keys),
}


@needs_compiled
@pytest.mark.parametrize("name", sorted(CALLS))
def test_compiled_and_python_loops_agree_on_random_states(name: str) -> None:
    assert compiled is not None
    rng = random.Random(name)
    outcomes = set()
    for _ in range(2000):
        state = random_state(rng)
        keys = [rng.choice(KEYS) for _ in range(rng.randrange(8))]  # repeats included
        as_tuple = rng.random() < 0.3
        args = tuple(keys) if as_tuple else keys
        expected = outcome(python, name, copy.deepcopy(state), list(args))
        got = outcome(compiled, name, copy.deepcopy(state), args)
        assert got == expected, (name, state, keys)
        outcomes.add(expected[0][0])
    if name in ("take_slots", "free_victims"):  # both ends of the contract were met
        assert outcomes == {"returned", "raised"}


@needs_compiled
def test_unpin_gives_back_what_it_took_before_a_key_without_readers() -> None:
    assert compiled is not None
    a, b, c = KEYS[:3]
    pins = {a: 1, b: 2}
    assert compiled.unpin(pins, [b, a, c, a]) == 2
    assert pins == {a: 1, b: 2}
    assert compiled.unpin(pins, [b, a]) == -1
    assert pins == {b: 1}


@needs_compiled
def test_bad_arguments_are_type_errors_not_crashes() -> None:
    assert compiled is not None
    with pytest.raises(TypeError):
        compiled.pin_prefix([], {}, KEYS)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compiled.ready_count({}, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # an unhashable key, as dicts say
        compiled.new_keys({}, {}, [[1]])  # type: ignore[list-item]
    with pytest.raises(TypeError):  # a count that is not an int
        compiled.pin_prefix({KEYS[0]: 0}, {KEYS[0]: "x"}, [KEYS[0]])  # type: ignore[dict-item]
