"""kvtier as an SGLang HiCache storage backend.

Point SGLang at it with::

    --enable-hierarchical-cache
    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1, "kvtier": {...kvtier configuration...}}'

Needs SGLang (see docs/sglang.md for the environment).
"""

try:
    import sglang  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvtier.integrations.sglang needs SGLang: install it beside kvtier "
        "(see docs/sglang.md, or scripts/test-sglang.sh for a CPU environment)",
        name="sglang",
    ) from exc

from .storage import KVTierHiCacheStorage

__all__ = ["KVTierHiCacheStorage"]
