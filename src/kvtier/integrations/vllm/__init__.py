"""kvtier as a vLLM KV connector.

Point vLLM at it with::

    KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kvtier": {...kvtier configuration...}},
    )

Needs vLLM (``pip install 'kvtier[vllm]'`` or the recipe in docs/vllm.md).
"""

from kvtier.errors import MissingDependencyError

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("vllm", "vllm") from exc

from .connector import KVTierConnector

__all__ = ["KVTierConnector"]
