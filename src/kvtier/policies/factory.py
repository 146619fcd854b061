"""``CachePolicyFactory``: ``eviction_policy`` + ``cache_policy_module_path``."""

from __future__ import annotations

from typing import Any

from kvtier.plugins import PluginFactory, PluginRegistry
from kvtier.policies.base import CachePolicy

policy_registry: PluginRegistry[CachePolicy] = PluginRegistry(
    kind="cache policy",
    base=CachePolicy,
    name_key="eviction_policy",
    module_key="cache_policy_module_path",
    entry_point_group="kvtier.policies",
    builtins=[
        ("lru", "kvtier.policies.lru", "LRUCachePolicy"),
        ("arc", "kvtier.policies.arc", "ARCCachePolicy"),
        ("s3fifo", "kvtier.policies.s3fifo", "S3FIFOCachePolicy"),
        ("leaf-lru", "kvtier.policies.leaf_lru", "LeafFirstLRUCachePolicy"),
    ],
)


class CachePolicyFactory(PluginFactory[CachePolicy]):
    """Resolves and builds cache policies named in configuration."""

    registry = policy_registry

    @classmethod
    def register_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register an eviction policy under ``name`` (``ValueError`` if taken)."""
        cls.register(name, module_path, class_name)

    @classmethod
    def get_cache_policy_class(
        cls, name: str, module_path: str | None = None, *, entry: str = ""
    ) -> type[CachePolicy]:
        return cls.resolve(name, module_path, entry=entry)

    @classmethod
    def create_cache_policy(
        cls, name: str, capacity: int, module_path: str | None = None, **kwargs: Any
    ) -> CachePolicy:
        return cls.resolve(name, module_path)(capacity, **kwargs)


register_policy = CachePolicyFactory.register_policy
