"""The kvtier layout of a row of vLLM's CPU primary tier: what its bytes are
(float KV where vLLM certifies it, else opaque bytes) and every fact that
changes them, so that chunks of another model or geometry never match."""

from __future__ import annotations

import logging
from typing import Any

from kvtier.errors import ConfigError
from kvtier.identity import declared_weights, identify_weights
from kvtier.layout import KVLayout

logger = logging.getLogger(__name__)

#: The float KV dtypes a row may be read as, and their widths in bytes.
_FLOAT_KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def tiering_layout(config: Any, row_bytes: int, model_id: str | None = None) -> KVLayout:
    """The kvtier layout of a row of vLLM's primary tier, from vLLM's
    ``OffloadingConfig``: every fact that changes a row's bytes feeds the
    namespace, so another model, dtype, block geometry, page format or
    parallel layout never finds these chunks.

    A row is described by its elements where :func:`row_elements` can tell
    them (float KV, so the lossy codecs group consecutive elements), else as
    one opaque ``uint8`` record of ``row_bytes``.
    """
    if row_bytes <= 0 or row_bytes % 2:
        raise ConfigError(
            [("cpu_bytes_to_use", f"vLLM's primary rows are {row_bytes} bytes: not a chunk")]
        )
    parallel = config.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    facts: dict[str, object] = {
        "engine": "vllm-tiering",
        "vllm": _vllm_version(),
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        # A row holds every worker's part (one, if they are all alike).
        "kv_bytes_per_block": int(config.worker_kv_bytes_per_block)
        * (1 if config.replicated_layout else int(parallel.world_size)),
        "groups": [
            {"tokens_per_block": int(g.tokens_per_block), "layers": list(g.layer_names)}
            for g in config.groups
        ],
        "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
        "canonical_layout": bool(getattr(config, "canonical_layout", False)),
        "replicated_layout": bool(config.replicated_layout),
        "parallel": "agnostic"
        if agnostic
        else {
            "tp": int(parallel.tp_size),
            "pp": int(parallel.pp_size),
            "pcp": int(parallel.pcp_size),
            "dcp": int(parallel.dcp_size),
        },
        "weights": _weights(str(config.model.name), model_id),
    }
    dtype, _ = row_elements(config)
    element_bytes = _FLOAT_KV_BYTES.get(dtype, 1)
    if row_bytes % (2 * element_bytes):
        raise ConfigError(
            [("cpu_bytes_to_use", f"vLLM's primary rows are {row_bytes} bytes: not {dtype} KV")]
        )
    return KVLayout(
        model_id=str(config.model.name),
        num_layers=1,
        num_kv_heads=1,
        head_dim=row_bytes // (2 * element_bytes),
        dtype=dtype,
        chunk_tokens=1,
        kv_order=f"vllm-offload-row[{row_bytes}]",
        extra=tuple(sorted((k, _text(v)) for k, v in facts.items())),
    )


def row_elements(config: Any) -> tuple[str, str | None]:
    """The element type of vLLM's offload rows and ``None``, or ``uint8`` and
    why kvtier cannot read them as float KV.

    A row is every worker's pages of a chunk, in the KV cache's dtype, then
    zeros up to a memory page. Only where vLLM itself certifies the direct
    layout parallelism-agnostic is it one plain full-attention group (not
    MLA, no scales per token and head); other groups may hold latents, Mamba
    state, scales or other layers' bytes, which kvtier cannot tell apart.
    """
    dtype = str(config.model.dtype)
    if dtype not in _FLOAT_KV_BYTES:
        return "uint8", f"vLLM's offload rows of a {dtype} KV cache are not float KV"
    parallel = config.parallel
    if config.canonical_layout or config.replicated_layout or not parallel.is_parallelism_agnostic:
        return "uint8", (
            "vLLM's offload rows hold elements whose type kvtier cannot tell (they are "
            "plain float KV only where vLLM finds one full-attention group without "
            "scales, its bytes parallelism-agnostic, in the direct layout)"
        )
    return dtype, None


def _text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _vllm_version() -> str:
    import vllm

    return ".".join(str(vllm.__version__).split(".")[:2])


def _weights(model: str, model_id: str | None) -> str:
    """The weights' identity: declared, read from a local directory or the
    Hugging Face cache, or (neither) the name alone, said once in the log."""
    if model_id is not None:
        return declared_weights(model_id)
    weights = identify_weights(model)
    if weights is not None:
        return weights.token
    logger.warning(
        "kvtier: the weights of %r are neither a local directory nor in the Hugging Face "
        "cache; chunks are told apart by the model's name only (set model_id to declare "
        "the weights' identity)",
        model,
    )
    return f"name:{model}"


def byte_rows(view: memoryview) -> tuple[memoryview, int]:
    """vLLM's primary view as 2-D bytes: one row per chunk, whatever its item format."""
    if view.ndim != 2 or view.strides is None or not view.c_contiguous:
        raise ValueError(
            f"vLLM's primary view must be a C-contiguous 2-D memoryview, got shape {view.shape}"
        )
    rows, row_bytes = int(view.shape[0]) if view.shape else 0, int(view.strides[0])
    return view.cast("B").cast("B", (rows, row_bytes)), row_bytes
