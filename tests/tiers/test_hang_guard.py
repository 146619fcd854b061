"""The contract suites' hang guard: a tier or policy call that never returns
fails the test, naming the class and the method, instead of hanging the run.

The doubles here block on events until the test releases them; the guard is
set tiny on the suite subclasses so the tests are quick. Nothing asserts how
long anything took.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, ClassVar, Literal

import pytest

from kvtier.keys import ChunkKey
from kvtier.policies import CachePolicy, register_policy
from kvtier.policies.lru import LRUCachePolicy
from kvtier.testing import PolicyContractTests, TierContractTests, TierHarness, small_layout
from kvtier.testing.hang_guard import DEFAULT_CALL_TIMEOUT_S, HangGuard
from kvtier.tiers import TierOptions, register_tier
from kvtier.tiers.base import JobResult, Lookup, LookupContext, TransferJob
from kvtier.tiers.deadlines import CallTimeout
from kvtier.tiers.example import ExampleTier

#: Small, so the tests are quick (a call that hangs outlasts any bound), yet
#: far above what the doubles' other calls need, even on a loaded machine.
TINY_GUARD_S = 1.0

#: Released at the end of each test: what the doubles' constructors and
#: policies wait on (a tier's other waits are released by its shutdown).
RELEASE = threading.Event()

Step = Literal["__init__", "submit_store", "get_finished_jobs", "lookup", "drain"]


class HangingTierOptions(TierOptions):
    hang_in: Step | None = None
    """The method that blocks until released."""


class HangingTier(ExampleTier):
    """The example tier, blocking in one method until its shutdown (or the test) releases it."""

    Options: ClassVar[type[TierOptions]] = HangingTierOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.released = threading.Event()
        self._hang_if("__init__", RELEASE)

    def _hang_if(self, step: Step, release: threading.Event | None = None) -> None:
        if self.options.hang_in == step:
            (release or self.released).wait()

    def submit_store(self, job: TransferJob) -> None:
        self._hang_if("submit_store")
        super().submit_store(job)

    def get_finished_jobs(self) -> list[JobResult]:
        self._hang_if("get_finished_jobs")
        return super().get_finished_jobs()

    def lookup(self, key: ChunkKey, ctx: LookupContext) -> Lookup:
        self._hang_if("lookup")
        return super().lookup(key, ctx)

    def drain(self) -> None:
        self._hang_if("drain")

    def shutdown(self) -> None:
        self.released.set()  # what a tier's close does to a stuck client call
        super().shutdown()


class HangingPolicy(LRUCachePolicy):
    """LRU whose ``evict`` never returns until the test releases it."""

    def evict(self, n: int, protected: Collection[ChunkKey] = ()) -> list[ChunkKey] | None:
        RELEASE.wait()
        return super().evict(n, protected)


# Not collected (no Test prefix): the tests below run their methods by hand.
class HangingTierSuite(TierContractTests):
    call_timeout_s = TINY_GUARD_S
    hang_in: Step | None = None

    def make_config(self) -> dict[str, Any]:
        return {"type": "hanging", "hang_in": self.hang_in}


class HangingPolicySuite(PolicyContractTests):
    policy_name = "hanging"
    call_timeout_s = TINY_GUARD_S


class ReleasedPolicySuite(HangingPolicySuite):
    call_timeout_s = DEFAULT_CALL_TIMEOUT_S


@pytest.fixture(autouse=True)
def hanging_plugins(registries: None) -> Iterator[None]:
    register_tier("hanging", __name__, "HangingTier")
    register_policy("hanging", __name__, "HangingPolicy")
    RELEASE.clear()
    yield
    RELEASE.set()


def guard_thread(name: str) -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == f"hang guard: {name}"]
    return thread


def ends_once_released(thread: threading.Thread) -> bool:
    thread.join(60)  # a bound against a hang of the test itself, not a speed check
    return not thread.is_alive()


def suite_for(step: Step | None) -> HangingTierSuite:
    suite = HangingTierSuite()
    suite.hang_in = step
    return suite


@pytest.mark.parametrize(
    ("step", "test"),
    [
        ("submit_store", TierContractTests.test_store_lookup_load_is_byte_exact),
        ("get_finished_jobs", TierContractTests.test_store_lookup_load_is_byte_exact),
        ("lookup", TierContractTests.test_unknown_key_is_a_miss),
        ("drain", TierContractTests.test_each_result_is_reported_once),
    ],
)
def test_a_tier_call_that_never_returns_fails_naming_the_tier_and_the_method(
    step: Step, test: Callable[[TierContractTests, Any], None]
) -> None:
    suite = suite_for(step)
    harness = suite.make_harness()
    assert harness.guard.timeout_s == TINY_GUARD_S
    with pytest.raises(pytest.fail.Exception) as failure:
        test(suite, harness)
    message = str(failure.value)
    assert f"HangingTier.{step} did not return within {TINY_GUARD_S:g}s" in message
    assert "raise call_timeout_s" in message
    stuck = guard_thread(f"HangingTier.{step}")
    assert stuck.daemon and stuck.is_alive()
    # The harness still shuts the tier down, and that releases the stuck call.
    harness.close()
    assert ends_once_released(stuck)


def test_a_constructor_that_never_returns_fails_naming_it() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"HangingTier\.__init__ did not return"):
        suite_for("__init__").make_harness()
    stuck = guard_thread("HangingTier.__init__")
    RELEASE.set()
    assert ends_once_released(stuck)


def test_a_tier_that_returns_passes_under_the_guard() -> None:
    harness = TierHarness({"type": "hanging"}, small_layout())
    try:
        HangingTierSuite().test_store_lookup_load_is_byte_exact(harness)
    finally:
        harness.close()


def test_a_policy_call_that_never_returns_fails_naming_the_policy_and_the_method() -> None:
    suite = HangingPolicySuite()
    with pytest.raises(pytest.fail.Exception) as failure:
        suite.test_evict_zero_is_empty()
    assert f"HangingPolicy.evict did not return within {TINY_GUARD_S:g}s" in str(failure.value)
    stuck = guard_thread("HangingPolicy.test_evict_zero_is_empty")
    assert stuck.daemon
    RELEASE.set()
    assert ends_once_released(stuck)


def test_a_policy_suite_test_that_returns_passes_under_the_guard() -> None:
    RELEASE.set()
    ReleasedPolicySuite().test_evict_zero_is_empty()


def test_a_hang_outside_the_plugin_names_what_the_call_was_doing() -> None:
    guard = HangGuard(LRUCachePolicy, TINY_GUARD_S, setting="the bound")
    with pytest.raises(pytest.fail.Exception) as failure:
        guard("waiting", RELEASE.wait)
    message = str(failure.value)
    assert "waiting (with LRUCachePolicy) did not return" in message
    assert "raise the bound" in message
    RELEASE.set()
    assert ends_once_released(guard_thread("LRUCachePolicy.waiting"))


def test_the_calls_own_timeout_is_not_taken_for_a_hang() -> None:
    def times_out() -> None:
        raise CallTimeout("the backend's own")

    guard = HangGuard(LRUCachePolicy, 60.0)
    with pytest.raises(CallTimeout, match="the backend's own"):
        guard("evict", times_out)
    assert guard("evict", lambda: 7) == 7


def test_a_guard_needs_a_positive_bound() -> None:
    with pytest.raises(ValueError, match="call_timeout_s must be positive"):
        HangGuard(LRUCachePolicy, 0)


class NamelessPolicySuite(PolicyContractTests):
    """Builds its policy itself, with no name to resolve."""

    call_timeout_s = TINY_GUARD_S

    def make_policy(self, capacity: int | None = None) -> CachePolicy:
        return HangingPolicy(capacity or self.capacity)


def test_a_suite_that_builds_its_own_policy_is_guarded_too() -> None:
    with pytest.raises(pytest.fail.Exception) as failure:
        NamelessPolicySuite().test_evict_zero_is_empty()
    assert "test_evict_zero_is_empty (with CachePolicy) did not return" in str(failure.value)
    stuck = guard_thread("CachePolicy.test_evict_zero_is_empty")
    RELEASE.set()
    assert ends_once_released(stuck)
