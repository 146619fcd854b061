"""The :class:`~kvtier.layout.KVLayout` of a Hugging Face causal LM.

The layout's namespace must change whenever the KV bytes would: so besides
the shape and dtype it carries a digest of the model config and a
fingerprint of the weights. Two models built from the same config with
different seeds, or a checkpoint and its fine-tune, never share chunks.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash
from transformers import PretrainedConfig, PreTrainedModel

from kvtier import identity
from kvtier.errors import LayoutMismatchError
from kvtier.layout import KVLayout

_TORCH_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

#: Rope types whose frequencies transformers picks by the length of the
#: sequence in each forward pass (``dynamic_rope_update``): a prefix computed
#: alone and the same prefix computed as part of a longer prompt get other
#: keys, so its KV cannot be reused.
SEQUENCE_LENGTH_ROPE_TYPES = frozenset({"dynamic", "longrope"})

#: Elements of each weight tensor hashed into the fingerprint (from each end).
FINGERPRINT_ELEMENTS = 4096


def decoder_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text decoder's config (multimodal configs nest it)."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if get_text_config else config


def config_digest(config: PretrainedConfig) -> str:
    """A short digest of every entry of the text decoder's config that can change the KV bytes."""
    return identity.config_digest(decoder_config(config).to_dict())


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's weights: names, shapes, dtypes and sampled values.

    Hashes the first and last :data:`FINGERPRINT_ELEMENTS` elements of every
    tensor of the model's state (parameters and persistent buffers: quantised
    layers such as GPTQ's and AWQ's keep their packed weights and scales in
    buffers), which any re-initialisation, fine-tune or conversion changes,
    at a cost independent of model size beyond the tensor count.
    """
    digest = xxhash.xxh3_128()
    state = model.state_dict(keep_vars=True)
    tensors = ((name, value) for name, value in state.items() if isinstance(value, torch.Tensor))
    for name, param in sorted(tensors, key=lambda item: item[0]):
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        if param.device.type == "meta":
            continue
        flat = param.detach().reshape(-1)
        for part in (flat[:FINGERPRINT_ELEMENTS], flat[-FINGERPRINT_ELEMENTS:]):
            digest.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The layout's name for a torch dtype of KV tensors."""
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise LayoutMismatchError(
            f"KV dtype {dtype} is not supported; use one of {sorted(_TORCH_DTYPES.values())}"
        ) from None


def layout_from_config(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str,
    chunk_tokens: int,
    model_id: str | None = None,
    weights: str | None = None,
) -> KVLayout:
    """Derive the KV layout of a causal LM from its config.

    ``model_id`` defaults to the config's name or path (or its model type);
    ``weights`` is a :func:`weights_fingerprint`, mixed into the namespace.
    Models whose layers keep only a sliding window of KV are refused: their
    cache does not hold every token of a prefix.
    """
    text = decoder_config(config)
    layer_types = getattr(text, "layer_types", None) or ()
    windowed = sorted({kind for kind in layer_types if kind != "full_attention"})
    if windowed:
        raise LayoutMismatchError(
            f"{text.model_type}: layers of type {windowed} keep a window of the KV cache, "
            "not the whole prefix; kvtier serves full-attention models only"
        )
    if (
        getattr(text, "use_bidirectional_attention", False)
        or getattr(text, "is_causal", True) is False
    ):
        raise LayoutMismatchError(
            f"{text.model_type}: attention runs both ways, so a prefix's KV depends on the "
            "tokens after it; kvtier serves causal models only"
        )
    length_dependent = sorted(_rope_types(text) & SEQUENCE_LENGTH_ROPE_TYPES)
    if length_dependent:
        raise LayoutMismatchError(
            f"{text.model_type}: rope type {length_dependent} rescales every position by the "
            "length of the sequence being computed, so a prefix's KV depends on what follows "
            "it; kvtier serves models whose rope depends on positions only"
        )
    num_layers = _int_attr(text, "num_hidden_layers")
    num_heads = _int_attr(text, "num_attention_heads")
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or _int_attr(text, "hidden_size") // num_heads
    config_id = config_digest(config)
    extra = (
        (("config", config_id),)
        if weights is None
        else identity.ModelIdentity(config_id, weights).layout_extra
    )
    name = model_id or getattr(config, "name_or_path", "") or str(text.model_type)
    return KVLayout(
        model_id=name,
        num_layers=num_layers,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        dtype=dtype if isinstance(dtype, str) else torch_dtype_name(dtype),
        chunk_tokens=chunk_tokens,
        extra=extra,
    )


def layout_for_model(
    model: PreTrainedModel, *, chunk_tokens: int, model_id: str | None = None
) -> KVLayout:
    """The KV layout of ``model``: its config, its weights' dtype and fingerprint."""
    return layout_from_config(
        model.config,
        dtype=model.dtype,
        chunk_tokens=chunk_tokens,
        model_id=model_id,
        weights=weights_fingerprint(model),
    )


def _rope_types(config: Any) -> set[str]:
    """Rope types of the config (one, or one per layer type)."""
    found: set[str] = set()
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if not isinstance(value, dict):
            continue
        nested = [item for item in value.values() if isinstance(item, dict)]
        for parameters in (value, *nested):
            kind = parameters.get("rope_type", parameters.get("type"))
            if isinstance(kind, str):
                found.add(kind)
    return found


def _int_attr(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise LayoutMismatchError(
            f"{getattr(config, 'model_type', type(config).__name__)} config: "
            f"{name}={value!r} is not a positive int; is this a decoder-only causal LM?"
        )
    return value
