"""The resolver's guards for plugin authors: real inheritance, the factories'
class methods, and warnings for configuration that would be silently ignored."""

from __future__ import annotations

import logging
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import kvtier.plugins
from kvtier import CachePolicyFactory, OffloadingSpecFactory, SecondaryTierFactory
from kvtier.errors import KVTierError, PluginTypeError
from kvtier.policies import policy_registry
from kvtier.specs import spec_registry
from kvtier.tiers import tier_registry
from kvtier.tiers.memory import MemoryTier

pytestmark = pytest.mark.usefixtures("registries")


@pytest.fixture
def virtual_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module whose classes are only *registered* with kvtier's bases."""
    (tmp_path / "virtual_plugins.py").write_text(
        textwrap.dedent(
            """
            from kvtier.policies import CachePolicy
            from kvtier.tiers import SecondaryTier

            class VirtualTier:
                pass

            class VirtualPolicy:
                pass

            SecondaryTier.register(VirtualTier)
            CachePolicy.register(VirtualPolicy)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "virtual_plugins"


def test_a_virtual_subclass_is_refused_with_kvtiers_own_type_error(virtual_plugins: str) -> None:
    with pytest.raises(PluginTypeError, match="virtual subclass only") as info:
        SecondaryTierFactory.get_tier_class(
            {"type": "VirtualTier", "module_path": virtual_plugins}, entry="secondary_tiers[1]"
        )
    assert isinstance(info.value, TypeError) and isinstance(info.value, KVTierError)
    assert str(info.value).startswith("secondary_tiers[1]: virtual_plugins.VirtualTier")
    with pytest.raises(TypeError, match="virtual subclass only"):
        CachePolicyFactory.get_cache_policy_class("VirtualPolicy", virtual_plugins)


def test_each_factory_registers_through_a_class_method() -> None:
    SecondaryTierFactory.register_tier("mem2", "kvtier.tiers.memory", "MemoryTier")
    CachePolicyFactory.register_policy("lru2", "kvtier.policies.lru", "LRUCachePolicy")
    OffloadingSpecFactory.register_spec("tiering2", "kvtier.specs.tiering", "TieringSpec")
    assert SecondaryTierFactory.get_tier_class({"type": "mem2"}) is MemoryTier
    assert CachePolicyFactory.get_cache_policy_class("lru2").__name__ == "LRUCachePolicy"
    assert OffloadingSpecFactory.get_spec_class("tiering2").__name__ == "TieringSpec"
    with pytest.raises(ValueError, match="already registered"):
        SecondaryTierFactory.register_tier("mem2", "kvtier.tiers.memory", "MemoryTier")


def test_a_module_path_ignored_for_a_registered_name_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.plugins")
    for _ in range(3):
        cls = SecondaryTierFactory.get_tier_class({"type": "memory", "module_path": "acme.kv"})
        assert cls is MemoryTier
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # once, not once per tier or per request
    assert "'memory' is already registered" in warnings[0] and "'acme.kv' is ignored" in warnings[0]
    caplog.clear()
    SecondaryTierFactory.get_tier_class({"type": "memory", "module_path": "kvtier.tiers.memory"})
    assert caplog.records == []  # naming the module it resolves to is no conflict


def test_two_packages_declaring_one_entry_point_name_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    declared = [
        EntryPoint("twin", "kvtier.tiers.memory:MemoryTier", "kvtier.tiers"),
        EntryPoint("twin", "kvtier.tiers.example:ExampleTier", "kvtier.tiers"),
        EntryPoint("twin", "kvtier.tiers.memory:MemoryTier", "kvtier.tiers"),  # seen twice
    ]

    def fake_entry_points(*, group: str, name: str | None = None) -> list[EntryPoint]:
        return [ep for ep in declared if ep.group == group and name in (None, ep.name)]

    monkeypatch.setattr(kvtier.plugins, "entry_points", fake_entry_points)
    caplog.set_level(logging.WARNING, logger="kvtier.plugins")
    assert SecondaryTierFactory.get_tier_class({"type": "twin"}) is MemoryTier
    duplicates = [r.getMessage() for r in caplog.records if "entry points" in r.getMessage()]
    assert len(duplicates) == 1
    assert "declared by 2 installed entry points" in duplicates[0]
    assert "kvtier.tiers.example:ExampleTier" in duplicates[0]


def test_a_snapshot_restores_registrations_and_warnings() -> None:
    for registry in (tier_registry, policy_registry, spec_registry):
        saved = registry.snapshot()
        registry.register("transient", "kvtier.tiers.memory", "MemoryTier")
        assert "transient" in registry.registered_names()
        registry.restore(saved)
        assert "transient" not in registry.registered_names()
        assert registry.snapshot() == saved
