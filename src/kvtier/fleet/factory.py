"""The registry of cluster index backends: ``type`` + ``module_path``, like tiers.

Resolution is the tiers' (:mod:`kvtier.plugins`): registered names, then
entry points of the group ``kvtier.indexes``, then ``module_path``.
"""

from __future__ import annotations

from kvtier.fleet.base import ClusterIndex, IndexOptions
from kvtier.plugins import PluginRegistry

index_registry: PluginRegistry[ClusterIndex] = PluginRegistry(
    kind="cluster index",
    base=ClusterIndex,
    entry_point_group="kvtier.indexes",
    builtins=[
        ("redis", "kvtier.fleet.redis", "RedisIndex"),
    ],
)


def register_index(index_type: str, module_path: str, class_name: str) -> None:
    """Register a cluster index backend under ``index_type`` (``ValueError`` if taken)."""
    index_registry.register(index_type, module_path, class_name)


def build_index(index_class: type[ClusterIndex], options: IndexOptions) -> ClusterIndex:
    """Construct ``index_class`` with options validated against its ``Options``."""
    if type(options) is not index_class.Options:
        raise TypeError(
            f"{index_class.__qualname__} takes {index_class.Options.__qualname__}, "
            f"not {type(options).__qualname__}"
        )
    return index_class(options)
