"""The three configuration-driven factories and the resolver behind them."""

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
from pydantic import field_validator

from kvtier import (
    CachePolicyFactory,
    KVCache,
    OffloadingSpecFactory,
    PluginLoadError,
    SecondaryTierFactory,
    UnknownPluginError,
    UntrustedModuleError,
    load_config,
    register_policy,
    register_spec,
    register_tier,
)
from kvtier.policies import CachePolicy
from kvtier.primary import SlotBuffer
from kvtier.specs import OffloadingSpec
from kvtier.specs.tiering import TieringSpec
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers import SecondaryTier, TierOptions, tier_registry
from kvtier.tiers.memory import MemoryTier, MemoryTierOptions

pytestmark = pytest.mark.usefixtures("registries")

OOT = "kvtier_testplugin.tiers"


def build(entry: dict) -> SecondaryTier:
    layout = small_layout()
    buffer = SlotBuffer(4, layout.slot_bytes)
    spec = TieringSpec(load_config({"chunk_tokens": layout.chunk_tokens}), layout)
    return SecondaryTierFactory.create_secondary_tier(entry, buffer.view, spec)


# Resolution order ---------------------------------------------------------


def test_builtin_names_resolve_from_the_registry() -> None:
    assert SecondaryTierFactory.get_tier_class({"type": "memory"}) is MemoryTier
    assert CachePolicyFactory.get_cache_policy_class("lru").__name__ == "LRUCachePolicy"
    assert OffloadingSpecFactory.get_spec_class("tiering") is TieringSpec


def test_registry_wins_over_module_path() -> None:
    cls = SecondaryTierFactory.get_tier_class({"type": "memory", "module_path": OOT})
    assert cls is MemoryTier


def test_registry_holds_lazy_strings_so_nothing_is_imported_early() -> None:
    code = (
        "import sys, kvtier; "
        "print(any(m.startswith(('redis', 'boto3', 'zmq', 'torch')) for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_register_makes_a_name_resolve_and_duplicates_are_value_errors() -> None:
    register_tier("acme", OOT, "OutOfTreeTier")
    assert SecondaryTierFactory.get_tier_class({"type": "acme"}).__name__ == "OutOfTreeTier"
    with pytest.raises(ValueError, match="'acme' is already registered"):
        register_tier("acme", OOT, "OtherTier")
    with pytest.raises(ValueError, match="already registered"):
        register_tier("memory", OOT, "OutOfTreeTier")
    register_policy("acme-lru", "kvtier_testplugin.policies", "OutOfTreePolicy")
    with pytest.raises(ValueError):
        register_policy("lru", "kvtier_testplugin.policies", "OutOfTreePolicy")
    register_spec("acme-spec", "kvtier_testplugin.specs", "OutOfTreeSpec")
    with pytest.raises(ValueError):
        register_spec("tiering", "kvtier_testplugin.specs", "OutOfTreeSpec")


def test_installed_entry_points_resolve_for_all_three_factories() -> None:
    tier = SecondaryTierFactory.get_tier_class({"type": "entry-tier"})
    assert tier.__name__ == "EntryPointTier" and issubclass(tier, SecondaryTier)
    policy = CachePolicyFactory.get_cache_policy_class("entry-lru")
    assert policy.__name__ == "EntryPointPolicy" and issubclass(policy, CachePolicy)
    spec = OffloadingSpecFactory.get_spec_class("entry-spec")
    assert spec.__name__ == "EntryPointSpec" and issubclass(spec, OffloadingSpec)


def test_registry_wins_over_entry_points() -> None:
    register_tier("entry-tier", "kvtier.tiers.memory", "MemoryTier")
    assert SecondaryTierFactory.get_tier_class({"type": "entry-tier"}) is MemoryTier


def test_module_path_loads_an_out_of_tree_class() -> None:
    cls = SecondaryTierFactory.get_tier_class({"type": "OutOfTreeTier", "module_path": OOT})
    assert cls.__module__ == OOT


# Construction ---------------------------------------------------------------


def test_module_path_never_reaches_the_constructor_and_other_options_do() -> None:
    tier = build({"type": "OutOfTreeTier", "module_path": OOT, "label": "x", "weight": 3})
    try:
        from kvtier_testplugin.tiers import OutOfTreeTier

        assert isinstance(tier, OutOfTreeTier)
        received = tier.received
        assert "module_path" not in received
        assert received["tier_type"] == "OutOfTreeTier"
        assert received["label"] == "x" and received["weight"] == 3
        assert set(received) == {"spec", "primary_kv_view", "tier_type", "label", "weight"}
    finally:
        tier.shutdown()


def test_policy_and_spec_module_paths_are_loading_hints_only() -> None:
    config = load_config(
        {
            "eviction_policy": "OutOfTreePolicy",
            "cache_policy_module_path": "kvtier_testplugin.policies",
            "spec_name": "OutOfTreeSpec",
            "spec_module_path": "kvtier_testplugin.specs",
            "chunk_tokens": 16,
        }
    )
    spec = OffloadingSpecFactory.create_spec(config, small_layout())
    assert type(spec).__name__ == "OutOfTreeSpec"
    manager = spec.build_manager()
    try:
        assert type(manager.primary.policy).__name__ == "OutOfTreePolicy"
    finally:
        manager.shutdown()


# Errors ---------------------------------------------------------------------


def test_not_a_subclass_is_a_type_error_naming_both() -> None:
    with pytest.raises(TypeError) as info:
        SecondaryTierFactory.get_tier_class({"type": "NotATier", "module_path": OOT})
    assert "kvtier_testplugin.tiers.NotATier" in str(info.value)
    assert "kvtier.tiers.base.SecondaryTier" in str(info.value)
    with pytest.raises(TypeError, match="CachePolicy"):
        CachePolicyFactory.get_cache_policy_class("NotAPolicy", "kvtier_testplugin.policies")
    with pytest.raises(TypeError, match="NotATier"):
        SecondaryTierFactory.get_tier_class({"type": "not-a-tier"})  # via entry point


def test_not_a_subclass_is_a_type_error_under_python_O() -> None:
    code = textwrap.dedent(
        """
        assert False, "asserts must be stripped in this interpreter"
        """
    )
    stripped = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True)
    assert stripped.returncode == 0
    code = textwrap.dedent(
        f"""
        from kvtier import SecondaryTierFactory
        try:
            SecondaryTierFactory.get_tier_class({{"type": "NotATier", "module_path": "{OOT}"}})
        except TypeError as exc:
            print("TypeError:", exc)
        else:
            print("loaded")
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TypeError:") and "SecondaryTier" in out.stdout


def test_module_that_does_not_import_chains_the_error_and_names_the_entry() -> None:
    with pytest.raises(ImportError) as info:
        SecondaryTierFactory.get_tier_class(
            {"type": "Anything", "module_path": "kvtier_testplugin.broken"},
            entry="secondary_tiers[2]",
        )
    error = info.value
    assert isinstance(error, PluginLoadError)
    assert "secondary_tiers[2]" in str(error) and "kvtier_testplugin.broken" in str(error)
    assert isinstance(error.__cause__, ModuleNotFoundError)
    assert error.__cause__.name == "kvtier_testplugin_missing_dependency"


def test_missing_module_chains_module_not_found() -> None:
    with pytest.raises(PluginLoadError) as info:
        SecondaryTierFactory.get_tier_class({"type": "T", "module_path": "no.such.module"})
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_module_without_the_class_names_module_and_class() -> None:
    with pytest.raises(PluginLoadError) as info:
        SecondaryTierFactory.get_tier_class({"type": "NoSuchTier", "module_path": OOT})
    message = str(info.value)
    assert f"module {OOT!r} has no class 'NoSuchTier'" in message
    assert info.value.module == OOT and info.value.plugin == "NoSuchTier"


def test_unknown_name_lists_supported_names_and_ends_with_the_hint() -> None:
    with pytest.raises(UnknownPluginError) as info:
        SecondaryTierFactory.get_tier_class({"type": "nope"})
    message = str(info.value)
    assert "example" in message and "memory" in message and "entry-tier" in message
    assert message.endswith("For an out-of-tree secondary tier, also set 'module_path'.")
    with pytest.raises(UnknownPluginError) as info:
        CachePolicyFactory.get_cache_policy_class("nope")
    assert "lru" in str(info.value) and "arc" in str(info.value)
    assert str(info.value).endswith("also set 'cache_policy_module_path'.")
    with pytest.raises(UnknownPluginError) as info:
        OffloadingSpecFactory.get_spec_class("nope")
    assert str(info.value).endswith("also set 'spec_module_path'.")


def test_missing_type_is_an_error() -> None:
    with pytest.raises(ValueError, match="must include 'type'"):
        SecondaryTierFactory.get_tier_class({"module_path": OOT})


# Logging ----------------------------------------------------------------------


def test_one_fixed_warning_per_factory_and_one_info_line_per_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.plugins")
    SecondaryTierFactory.get_tier_class({"type": "OutOfTreeTier", "module_path": OOT})
    SecondaryTierFactory.get_tier_class({"type": "OtherTier", "module_path": OOT})
    CachePolicyFactory.get_cache_policy_class("OutOfTreePolicy", "kvtier_testplugin.policies")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert warnings == [
        "Loading an out-of-tree secondary tier. This interface is experimental and may "
        "change in future kvtier releases.",
        "Loading an out-of-tree cache policy. This interface is experimental and may "
        "change in future kvtier releases.",
    ]
    assert infos == [
        f"Loading out-of-tree secondary tier 'OutOfTreeTier' from module '{OOT}'",
        f"Loading out-of-tree secondary tier 'OtherTier' from module '{OOT}'",
        "Loading out-of-tree cache policy 'OutOfTreePolicy' from module "
        "'kvtier_testplugin.policies'",
    ]


def test_builtins_load_silently(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.plugins")
    SecondaryTierFactory.get_tier_class({"type": "memory"})
    assert caplog.records == []


# Restricting module paths ----------------------------------------------------


def test_allowed_modules_restricts_module_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_ALLOWED_MODULES", "kvtier_testplugin.policies, corp")
    with pytest.raises(UntrustedModuleError, match="not allowed by KVTIER_ALLOWED_MODULES"):
        SecondaryTierFactory.get_tier_class({"type": "OutOfTreeTier", "module_path": OOT})
    assert (
        CachePolicyFactory.get_cache_policy_class(
            "OutOfTreePolicy", "kvtier_testplugin.policies"
        ).__name__
        == "OutOfTreePolicy"
    )
    # Built-ins stay available whatever the list says.
    assert SecondaryTierFactory.get_tier_class({"type": "memory"}) is MemoryTier


def test_an_empty_allow_list_refuses_every_module_path_before_importing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTIER_ALLOWED_MODULES", "")
    with pytest.raises(UntrustedModuleError):
        SecondaryTierFactory.get_tier_class(
            {"type": "X", "module_path": "kvtier_testplugin.broken"}
        )
    assert "kvtier_testplugin.broken" not in sys.modules


def test_prefix_matching_is_by_whole_module_components(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_ALLOWED_MODULES", "kvtier_test")
    with pytest.raises(UntrustedModuleError):
        SecondaryTierFactory.get_tier_class({"type": "OutOfTreeTier", "module_path": OOT})


def test_tier_registry_names_include_entry_points() -> None:
    assert {"example", "memory", "entry-tier"} <= set(tier_registry.names())


def test_each_tier_class_is_resolved_once_per_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resolved: list[str] = []
    real_resolve = tier_registry.resolve

    def counting(name: str, *args: object, **kwargs: object) -> type[SecondaryTier]:
        resolved.append(name)
        return real_resolve(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tier_registry, "resolve", counting)
    layout = small_layout()
    config = load_config(
        {
            "chunk_tokens": layout.chunk_tokens,
            "cpu_bytes_to_use": 4 * layout.slot_bytes,
            "secondary_tiers": [
                {"type": "memory", "max_bytes": "1MiB"},
                {"type": "OutOfTreeTier", "module_path": "kvtier_testplugin.tiers", "label": "x"},
            ],
        }
    )
    assert resolved == ["memory", "OutOfTreeTier"]  # validating the configuration resolves
    manager = TieringSpec(config, layout).build_manager()
    try:
        assert [type(t).__name__ for t in manager.tiers] == ["MemoryTier", "OutOfTreeTier"]
        assert manager.tiers[1].options.label == "x"
        assert resolved == ["memory", "OutOfTreeTier"]  # building the tiers does not again
    finally:
        manager.shutdown()


def test_the_policy_and_spec_classes_are_resolved_once_per_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.policies.factory import policy_registry
    from kvtier.specs.factory import spec_registry

    resolved: list[str] = []
    for registry in (policy_registry, spec_registry):
        # Lookups the registry makes, past its memo of what it resolved already.
        registry.restore(registry.snapshot())  # that memo emptied
        real = registry._find

        def counting(name: str, *args: object, _real: Any = real, **kwargs: object) -> Any:
            resolved.append(name)
            return _real(name, *args, **kwargs)

        monkeypatch.setattr(registry, "_find", counting)
    layout = small_layout()
    config = load_config({"chunk_tokens": layout.chunk_tokens, "eviction_policy": "arc"})
    assert sorted(resolved) == ["arc", "tiering"]
    manager = OffloadingSpecFactory.create_spec(config, layout).build_manager()
    try:
        assert type(manager.primary.policy).__name__ == "ARCCachePolicy"
        assert sorted(resolved) == ["arc", "tiering"]  # building did not look them up again
    finally:
        manager.shutdown()


# Validation once per configuration ---------------------------------------

#: The ``label`` of each CountingTier entry, once per validation of its options.
VALIDATED: list[str] = []


class CountingTierOptions(MemoryTierOptions):
    label: str = ""

    @field_validator("label")
    @classmethod
    def _count(cls, label: str) -> str:
        VALIDATED.append(label)
        return label


class CountingTier(MemoryTier):
    """The memory tier, counting every validation of its options."""

    Options: ClassVar[type[TierOptions]] = CountingTierOptions


class RenamingTier(CountingTier):
    """Changes its arguments before the base sees them: they are validated anew."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["label"] = kwargs["label"] + "-renamed"
        super().__init__(**kwargs)


@pytest.fixture
def counted() -> list[str]:
    register_tier("counting", __name__, "CountingTier")
    register_tier("renaming", __name__, "RenamingTier")
    VALIDATED.clear()
    return VALIDATED


def test_each_tier_entry_is_validated_once_from_load_config_to_a_running_tier(
    counted: list[str],
) -> None:
    layout = small_layout()
    config = load_config(
        {
            "chunk_tokens": layout.chunk_tokens,
            "cpu_bytes_to_use": 4 * layout.slot_bytes,
            "secondary_tiers": [
                {"type": "counting", "label": "a", "max_bytes": "1MiB"},
                {"type": "counting", "label": "b"},
            ],
        }
    )
    assert counted == ["a", "b"]
    with KVCache(config, layout) as cache:
        tiers = cache.manager.tiers
        assert counted == ["a", "b"]
        # The very objects load_config validated, and the options they say.
        assert all(
            t.options is e.options for t, e in zip(tiers, config.secondary_tiers, strict=True)
        )
        assert isinstance(tiers[0], CountingTier) and tiers[0].backend.max_bytes == 1 << 20


def test_the_contract_harness_validates_once_too(counted: list[str]) -> None:
    harness = TierHarness({"type": "counting", "label": "h"}, small_layout())
    try:
        assert counted == ["h"]
        assert harness.tier.options.label == "h"
    finally:
        harness.close()


@contextmanager
def built_from_a_configuration(entry: dict[str, Any]) -> Iterator[SecondaryTier]:
    """The tier of ``entry``, built as a spec builds it from a validated configuration."""
    tier_config = load_config({"secondary_tiers": [entry]}).secondary_tiers[0]
    buffer = SlotBuffer(4, small_layout().slot_bytes)
    spec = TieringSpec(load_config({"chunk_tokens": 16}), small_layout())
    tier = SecondaryTierFactory.build_secondary_tier(
        tier_config.tier_class, tier_config.tier_type, tier_config.options, buffer.view, spec
    )
    try:
        yield tier
    finally:
        tier.shutdown()
        buffer.close()


def test_arguments_a_tier_changes_before_the_base_are_validated_again(
    counted: list[str],
) -> None:
    with built_from_a_configuration({"type": "renaming", "label": "r"}) as tier:
        assert counted == ["r", "r-renamed"]
        assert tier.options.label == "r-renamed"


def test_a_tier_built_from_a_plain_mapping_validates_its_options(counted: list[str]) -> None:
    tier = build({"type": "counting", "label": "m"})
    try:
        assert counted == ["m"]
        assert isinstance(tier.options, CountingTierOptions)
    finally:
        tier.shutdown()


def test_options_of_another_tier_class_are_refused(counted: list[str]) -> None:
    layout = small_layout()
    buffer = SlotBuffer(4, layout.slot_bytes)
    spec = TieringSpec(load_config({"chunk_tokens": layout.chunk_tokens}), layout)
    try:
        with pytest.raises(TypeError, match="CountingTier takes CountingTierOptions"):
            SecondaryTierFactory.build_secondary_tier(
                CountingTier, "counting", MemoryTierOptions(), buffer.view, spec
            )
    finally:
        buffer.close()


# One resolution, memoised in the registry ----------------------------------


def test_a_name_and_module_path_resolve_once_until_the_registrations_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[str] = []
    real = tier_registry._find

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(tier_registry, "_find", counting)
    entry = {"type": "OutOfTreeTier", "module_path": OOT}
    first = SecondaryTierFactory.get_tier_class(entry)
    assert SecondaryTierFactory.get_tier_class(entry) is first
    assert looked_up == ["OutOfTreeTier"]
    register_tier("another", OOT, "OutOfTreeTier")  # a registration forgets what was resolved
    assert SecondaryTierFactory.get_tier_class(entry) is first
    assert looked_up == ["OutOfTreeTier"] * 2
    # The allow-list holds for a module path resolved before it was set.
    monkeypatch.setenv("KVTIER_ALLOWED_MODULES", "acme_only")
    with pytest.raises(UntrustedModuleError):
        SecondaryTierFactory.get_tier_class(entry)


def test_a_new_kind_of_plugin_is_a_factory_over_a_registry_of_its_own() -> None:
    from kvtier.plugins import PluginFactory, PluginRegistry

    class Codec:
        pass

    class CodecFactory(PluginFactory[Codec]):
        registry = PluginRegistry(
            kind="codec",
            base=Codec,
            name_key="codec",
            module_key="codec_module_path",
            entry_point_group="kvtier.codecs",
        )

    CodecFactory.register("plain", "kvtier.tiers.memory", "MemoryTier")
    with pytest.raises(TypeError, match=r"not a subclass of .*Codec"):
        CodecFactory.resolve("plain")
    with pytest.raises(UnknownPluginError, match="'codec_module_path'") as error:
        CodecFactory.resolve("zstd")
    assert str(error.value).startswith("codec: unknown codec 'zstd'")


def test_built_ins_given_to_a_registry_are_registered_lazily_and_uniquely() -> None:
    from kvtier.plugins import PluginRegistry

    registry: PluginRegistry[SecondaryTier] = PluginRegistry(
        kind="secondary tier",
        base=SecondaryTier,
        entry_point_group="kvtier.tiers",
        builtins=[("mem", "kvtier.tiers.memory", "MemoryTier")],
    )
    assert registry.name_key == "type" and registry.module_key == "module_path"
    assert registry.registered_target("mem") == "kvtier.tiers.memory.MemoryTier"
    assert registry.resolve("mem") is MemoryTier
    with pytest.raises(ValueError, match="'mem' is already registered"):
        registry.register("mem", "kvtier.tiers.memory", "MemoryTier")
    with pytest.raises(ValueError, match="'twice' is already registered"):
        PluginRegistry(
            kind="secondary tier",
            base=SecondaryTier,
            entry_point_group="kvtier.tiers",
            builtins=[("twice", "a", "A"), ("twice", "b", "B")],
        )


class NamedOptionsTier(MemoryTier):
    """Names its options in its own signature (no ``**kwargs`` to pass on)."""

    Options: ClassVar[type[TierOptions]] = CountingTierOptions

    def __init__(self, *, spec: Any, primary_kv_view: Any, tier_type: str, label: str) -> None:
        super().__init__(
            spec=spec, primary_kv_view=primary_kv_view, tier_type=tier_type, label=label
        )


def test_a_tier_that_names_its_options_is_built_from_a_validated_configuration(
    counted: list[str],
) -> None:
    register_tier("named", __name__, "NamedOptionsTier")
    with built_from_a_configuration({"type": "named", "label": "n"}) as tier:
        # Nothing to pass the validated object on with: its arguments are validated again.
        assert counted == ["n", "n"] and tier.options.label == "n"
