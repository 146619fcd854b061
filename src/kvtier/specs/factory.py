"""``OffloadingSpecFactory``: ``spec_name`` + ``spec_module_path``."""

from __future__ import annotations

from kvtier.config.model import KVTierConfig
from kvtier.layout import KVLayout
from kvtier.plugins import PluginFactory, PluginRegistry
from kvtier.specs.base import OffloadingSpec

spec_registry: PluginRegistry[OffloadingSpec] = PluginRegistry(
    kind="offloading spec",
    base=OffloadingSpec,
    name_key="spec_name",
    module_key="spec_module_path",
    entry_point_group="kvtier.specs",
    builtins=[
        ("tiering", "kvtier.specs.tiering", "TieringSpec"),
    ],
)


class OffloadingSpecFactory(PluginFactory[OffloadingSpec]):
    """Resolves and builds the offloading spec named in configuration."""

    registry = spec_registry

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register an offloading spec under ``name`` (``ValueError`` if taken)."""
        cls.register(name, module_path, class_name)

    @classmethod
    def get_spec_class(cls, name: str, module_path: str | None = None) -> type[OffloadingSpec]:
        return cls.resolve(name, module_path)

    @classmethod
    def create_spec(cls, config: KVTierConfig, layout: KVLayout) -> OffloadingSpec:
        # Resolved by load_config already: the registry answers from its memo.
        return cls.resolve(config.spec_name, config.spec_module_path)(config, layout)


register_spec = OffloadingSpecFactory.register_spec
