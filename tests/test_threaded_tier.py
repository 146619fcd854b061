"""ThreadedTier leaves its subclasses their own names, and starts no thread in ``__init__``."""

from __future__ import annotations

import pytest

from kvtier import KVCache
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.threaded import ThreadedBatchTier, ThreadedTier
from tests.threaded_doubles import WORKERS_SEEN_IN_INIT, ObviousNamesTier, tier_threads

ENTRY = {"type": "ObviousNamesTier", "module_path": "tests.threaded_doubles", "io_threads": 3}


class TestSubclassWithObviousNames(TierContractTests):
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
    entry = {"type": "FailingSetUpTier", "module_path": "tests.threaded_doubles"}
    with pytest.raises(OSError, match="the backend is not there"):
        TierHarness(entry, small_layout())
    assert tier_threads("FailingSetUpTier") == []


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
        (tier,) = cache.manager.tiers
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
    assert issubclass(RemoteTier, ThreadedBatchTier)
    assert not issubclass(RemoteTier, ThreadedTier)


def test_a_batch_tier_without_transfer_is_refused_when_built() -> None:
    assert ThreadedBatchTier.__abstractmethods__ == {"_contains", "_transfer"}
    assert ThreadedTier.__abstractmethods__ == {"_contains", "_store_chunk", "_load_chunk"}
