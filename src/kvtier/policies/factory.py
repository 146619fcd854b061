"""``CachePolicyFactory``: ``eviction_policy`` + ``cache_policy_module_path``."""

from __future__ import annotations

from typing import Any

from kvtier.plugins import PluginRegistry
from kvtier.policies.base import CachePolicy

policy_registry: PluginRegistry[CachePolicy] = PluginRegistry(
    kind="cache policy",
    base=CachePolicy,
    name_key="eviction_policy",
    module_key="cache_policy_module_path",
    entry_point_group="kvtier.policies",
)
policy_registry.register("lru", "kvtier.policies.lru", "LRUCachePolicy")
policy_registry.register("arc", "kvtier.policies.arc", "ARCCachePolicy")
policy_registry.register("s3fifo", "kvtier.policies.s3fifo", "S3FIFOCachePolicy")
policy_registry.register("leaf-lru", "kvtier.policies.leaf_lru", "LeafFirstLRUCachePolicy")


def register_policy(name: str, module_path: str, class_name: str) -> None:
    """Register an eviction policy under ``name`` (``ValueError`` if taken)."""
    policy_registry.register(name, module_path, class_name)


class CachePolicyFactory:
    """Resolves and builds cache policies named in configuration."""

    @classmethod
    def register_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name`` (``ValueError`` if taken);
        the same as the module-level :func:`register_policy`."""
        register_policy(name, module_path, class_name)

    @staticmethod
    def get_cache_policy_class(
        name: str, module_path: str | None = None, *, entry: str = "eviction_policy"
    ) -> type[CachePolicy]:
        return policy_registry.resolve(name, module_path, entry=entry)

    @staticmethod
    def create_cache_policy(
        name: str, capacity: int, module_path: str | None = None, **kwargs: Any
    ) -> CachePolicy:
        cls = CachePolicyFactory.get_cache_policy_class(name, module_path)
        return cls(capacity, **kwargs)
