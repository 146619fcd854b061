"""The shared contract suite, run against the built-in and an out-of-tree tier."""

from kvtier.testing import TierContractTests


class TestExampleTier(TierContractTests):
    tier_config = {"type": "example"}


class TestMemoryTier(TierContractTests):
    tier_config = {"type": "memory", "max_bytes": "4MiB", "io_threads": 2}


class TestOutOfTreeTierByModulePath(TierContractTests):
    tier_config = {"type": "OutOfTreeTier", "module_path": "kvtier_testplugin.tiers"}


class TestFaultyTierWithoutFaults(TierContractTests):
    tier_config = {
        "type": "FaultyTier",
        "module_path": "kvtier.testing.faults",
        "inner": {"type": "memory"},
    }
