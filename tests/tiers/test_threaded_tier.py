"""ThreadedTier leaves its subclasses their own names, and starts no thread in ``__init__``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from kvtier import KVCache
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.tiers.base import Lookup, LookupContext
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.runtime import TierRuntime
from kvtier.tiers.threaded import ThreadedTier
from tests.support.cache_tiers import tiers_of
from tests.tiers.threaded_doubles import (
    WORKERS_SEEN_IN_INIT,
    ObviousNamesTier,
    PartNamingTier,
    RaisingMemoryTier,
    tier_threads,
)

ENTRY = {"type": "ObviousNamesTier", "module_path": "tests.tiers.threaded_doubles", "io_threads": 3}


class TestSubclassWithObviousNames(TierContractTests[ObviousNamesTier]):
    tier_config = ENTRY


def test_subclass_state_is_its_own_and_workers_start_after_init() -> None:
    harness = TierHarness(dict(ENTRY), small_layout())
    try:
        tier = harness.tier
        assert isinstance(tier, ObviousNamesTier)
        # No worker could run a hook before the subclass's state existed.
        assert WORKERS_SEEN_IN_INIT[tier.tier_type] == []
        assert tier_threads(tier.tier_type) == []
        keys = harness.keys(3)
        data = harness.fill([0, 1, 2])
        assert harness.store(keys, [0, 1, 2]).success
        assert tier._queue == keys  # the subclass's own list, in store order
        assert len(tier_threads(tier.tier_type)) == tier.io_threads == 3
        assert harness.load(keys, [5, 6, 7]).success
        assert (harness.buffer.array[[5, 6, 7]] == data).all()
        assert tier._workers >= 6 and tier._closed is False and not tier.shut_down
    finally:
        harness.close()
    assert tier.shut_down and tier._closed is True  # its own flag, set by its _close
    assert tier_threads(tier.tier_type) == []


def test_a_constructor_failing_after_super_init_leaves_no_thread() -> None:
    entry = {"type": "FailingSetUpTier", "module_path": "tests.tiers.threaded_doubles"}
    with pytest.raises(OSError, match="the backend is not there"):
        TierHarness(entry, small_layout())
    assert tier_threads("FailingSetUpTier") == []


@pytest.mark.parametrize("name", ["workers", "checks", "jobs", "guards", "coded", "store"])
def test_a_subclass_naming_its_state_like_a_runtime_part_is_refused_at_start(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Else its client replaced, say, the runtime's store, and every lookup
    # and transfer failed (as misses) with nothing said at start.
    monkeypatch.setattr(PartNamingTier, "own_name", name)
    entry = {"type": "PartNamingTier", "module_path": "tests.tiers.threaded_doubles"}
    with pytest.raises(AttributeError, match=rf"PartNamingTier\.{name}: .*say self\._{name}"):
        TierHarness(entry, small_layout())
    assert tier_threads("PartNamingTier") == []
    monkeypatch.setattr(PartNamingTier, "own_name", f"_my_{name}")
    harness = TierHarness(entry, small_layout())
    try:
        keys = harness.keys(1)
        assert harness.store(keys, [0]).success and harness.load(keys, [1]).success
    finally:
        harness.close()


def test_workers_start_when_the_manager_attaches_the_tier() -> None:
    layout = small_layout()
    config = {
        "chunk_tokens": layout.chunk_tokens,
        "cpu_bytes_to_use": 4 * layout.slot_bytes,
        "secondary_tiers": [dict(ENTRY)],
    }
    cache = KVCache(config, layout)
    try:
        # Started before the first request needs them, so that starting
        # threads does not sit on that request's time.
        (tier,) = tiers_of(cache, ObviousNamesTier)
        assert len(tier_threads(tier.tier_type)) == tier.io_threads == 3
    finally:
        cache.close()
    assert tier_threads(tier.tier_type) == []


@pytest.mark.parametrize(
    "hook", ["_store_chunk", "_load_chunk", "_store_batch", "_load_batch", "_attempt"]
)
def test_remote_tiers_move_batches_by_one_path_with_no_per_chunk_hooks(hook: str) -> None:
    # RemoteTier frames and guards whole batches in _transfer: per-chunk
    # hooks beside it would be a second path that nothing takes.
    assert hasattr(ThreadedTier, hook)
    assert not hasattr(RemoteTier, hook)
    assert issubclass(RemoteTier, TierRuntime)
    assert not issubclass(RemoteTier, ThreadedTier)


def test_a_tier_without_its_hooks_is_refused_when_built() -> None:
    assert TierRuntime.__abstractmethods__ == {"_open_store"}
    assert ThreadedTier.__abstractmethods__ == {"_contains", "_store_chunk", "_load_chunk"}


# A hook that raises anything fails its own batch; the workers go on ----------

RAISING = {
    "type": "RaisingMemoryTier",
    "module_path": "tests.tiers.threaded_doubles",
    "io_threads": 1,
}


class Interrupt(BaseException):
    """Like a KeyboardInterrupt (which pytest would take as the user's)."""


# Not Exceptions: an asyncio-based client's CancelledError, a library's sys.exit().
NOT_EXCEPTIONS = [asyncio.CancelledError, SystemExit, GeneratorExit, Interrupt]


@pytest.fixture
def raising() -> Iterator[TierHarness]:
    harness = TierHarness(dict(RAISING), small_layout(), call_timeout_s=60)
    yield harness
    harness.close()  # bounded by the harness: a tier that cannot drain fails the test


@pytest.mark.parametrize("error", NOT_EXCEPTIONS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("step", ["load", "store"])
def test_a_move_raising_a_base_exception_fails_its_job_and_the_worker_goes_on(
    raising: TierHarness, step: str, error: type[BaseException]
) -> None:
    tier = raising.tier
    assert isinstance(tier, RaisingMemoryTier)
    keys = raising.keys(2)
    data = raising.fill([0, 1])
    if step == "load":
        assert raising.store(keys, [0, 1]).success
    tier.raise_in, tier.error = step, error
    # Before: the only worker died with the job unreported, its slots never
    # came back and drain() waited for ever.
    failed = raising.load(keys, [2, 3]) if step == "load" else raising.store(keys, [0, 1])
    assert not failed.success and failed.succeeded == frozenset()
    tier.error = None
    assert raising.store(keys, [0, 1]).success  # the same single worker, still alive
    assert raising.load(keys, [4, 5]).success
    assert (raising.buffer.array[[4, 5]] == data).all()
    raising.drain()


def test_a_batch_answer_of_the_wrong_length_fails_the_batch(raising: TierHarness) -> None:
    tier = raising.tier
    assert isinstance(tier, RaisingMemoryTier)
    keys = raising.keys(2)
    assert raising.store(keys, [0, 1]).success
    tier.extra_answers = 1  # one answer too many: zip(strict=True) raised under the lock
    result = raising.load(keys, [2, 3])
    assert not result.success and result.succeeded == frozenset()
    tier.extra_answers = 0
    assert raising.load(keys, [2, 3]).success
    raising.drain()


@pytest.mark.parametrize("error", [*NOT_EXCEPTIONS, RuntimeError], ids=lambda e: e.__name__)
def test_an_existence_check_raising_anything_is_an_unknown_answer_not_a_stuck_key(
    raising: TierHarness, error: type[BaseException]
) -> None:
    tier = raising.tier
    assert isinstance(tier, RaisingMemoryTier)
    (key,) = raising.keys(1)
    tier.raise_in, tier.error = "_contains", error
    assert tier.lookup(key, LookupContext()) is Lookup.PENDING
    for _ in range(tier.check_attempts):
        # The check the lookup queued, run here on this thread: it must not raise...
        assert tier.checks.take_queued() == [key]
        tier.check([key])
        # ...and the key is no longer "being checked" (else PENDING for ever).
        answer = tier.lookup(key, LookupContext())
    assert answer is Lookup.MISS  # the backend kept failing: a miss, asked again later
    tier.error = None
    assert raising.lookup(key) is Lookup.MISS


def test_a_hook_failure_is_settled_once(caplog: pytest.LogCaptureFixture) -> None:
    # The hook's error is logged (or its chunk discarded, or noted gone)
    # where it met it; the runtime then only fails the key, not logging a
    # second, vaguer error for it.
    harness = TierHarness(dict(ENTRY), small_layout(), call_timeout_s=60)
    try:
        keys = harness.keys(2)  # never stored: the hook raises KeyError
        with caplog.at_level(logging.DEBUG, logger="kvtier.tiers.runtime"):
            result = harness.load(keys, [0, 1])
        assert not result.success and result.succeeded == frozenset()
        failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert len(failures) == 2 and all("KeyError" in message for message in failures)
    finally:
        harness.close()
