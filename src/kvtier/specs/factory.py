"""``OffloadingSpecFactory``: ``spec_name`` + ``spec_module_path``."""

from __future__ import annotations

from kvtier.config_model import KVTierConfig
from kvtier.layout import KVLayout
from kvtier.plugins import PluginRegistry
from kvtier.specs.base import OffloadingSpec

spec_registry: PluginRegistry[OffloadingSpec] = PluginRegistry(
    kind="offloading spec",
    base=OffloadingSpec,
    name_key="spec_name",
    module_key="spec_module_path",
    entry_point_group="kvtier.specs",
)
spec_registry.register("tiering", "kvtier.specs.tiering", "TieringSpec")


def register_spec(name: str, module_path: str, class_name: str) -> None:
    """Register an offloading spec under ``name`` (``ValueError`` if taken)."""
    spec_registry.register(name, module_path, class_name)


class OffloadingSpecFactory:
    """Resolves and builds the offloading spec named in configuration."""

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name`` (``ValueError`` if taken);
        the same as the module-level :func:`register_spec`."""
        register_spec(name, module_path, class_name)

    @staticmethod
    def get_spec_class(name: str, module_path: str | None = None) -> type[OffloadingSpec]:
        return spec_registry.resolve(name, module_path, entry="spec_name")

    @staticmethod
    def create_spec(config: KVTierConfig, layout: KVLayout) -> OffloadingSpec:
        resolved = config.resolved_spec_class()  # by load_config: not looked up again
        if resolved is not None and issubclass(resolved, OffloadingSpec):
            cls: type[OffloadingSpec] = resolved
        else:
            cls = OffloadingSpecFactory.get_spec_class(config.spec_name, config.spec_module_path)
        return cls(config, layout)
