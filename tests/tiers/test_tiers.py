"""The shared contract suite, run against the built-in and an out-of-tree tier."""

from kvtier_testplugin.tiers import OutOfTreeTier

from kvtier.testing import FaultyTier, TierContractTests
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
