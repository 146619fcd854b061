"""The shared contract suite, run against the built-in and an out-of-tree tier."""

import pytest
from kvtier_testplugin.tiers import OutOfTreeTier

from kvtier import integrity
from kvtier.codecs import CodecStage, codec_config
from kvtier.testing import FaultyTier, TierContractTests, TierHarness, small_layout
from kvtier.tiers.base import Lookup
from kvtier.tiers.example import ExampleTier
from kvtier.tiers.memory import MemoryTier


class TestExampleTier(TierContractTests[ExampleTier]):
    tier_config = {"type": "example"}


class TestMemoryTier(TierContractTests[MemoryTier]):
    tier_config = {"type": "memory", "max_bytes": "4MiB", "io_threads": 2}


class TestOutOfTreeTierByModulePath(TierContractTests[OutOfTreeTier]):
    tier_config = {"type": "OutOfTreeTier", "module_path": "kvtier_testplugin.tiers"}


class TestFaultyTierWithoutFaults(TierContractTests[FaultyTier]):
    tier_config = {
        "type": "FaultyTier",
        "module_path": "kvtier.testing.faults",
        "inner": {"type": "memory"},
    }


@pytest.mark.parametrize("codec", ["none", "lossless"])
def test_memory_tier_that_cannot_hold_one_chunk_is_refused_at_start(codec: str) -> None:
    # Before, every store failed at run time, counted, and the tier held nothing.
    layout = small_layout()
    largest = (
        integrity.HEADER_BYTES + CodecStage(codec_config(codec).build(layout), layout).stored_bytes
    )
    entry = {"type": "memory", "codec": codec}
    with pytest.raises(
        ValueError,
        match=rf"memory: max_bytes={largest - 1} cannot hold one framed chunk of {largest} bytes",
    ):
        TierHarness({**entry, "max_bytes": largest - 1}, layout)
    # One framed chunk's worth holds one chunk: the next store evicts it.
    harness = TierHarness({**entry, "max_bytes": largest}, layout, num_slots=4)
    try:
        keys = harness.keys(2)
        harness.fill(range(2))
        for key, slot in zip(keys, range(2), strict=True):
            assert harness.store([key], [slot]).succeeded == {key}
        assert [harness.lookup(key) for key in keys] == [Lookup.MISS, Lookup.HIT]
    finally:
        harness.close()
