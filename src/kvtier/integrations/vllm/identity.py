"""The identity of the model a vLLM engine serves, for the chunk namespace.

Its configuration digest covers vLLM's resolved :class:`ModelConfig`: the
Hugging Face config after ``--hf-overrides`` (rope settings included), the
dtype, quantization, revisions, remote code and model implementation, and
every field vLLM adds later unless it is listed below as unable to change
the KV bytes. Its weights identity comes from the files vLLM loaded (see
:mod:`kvtier.identity.weights`), found at the model's path or in the
Hugging Face cache, unless the user declares one with ``kvtier_model_id``.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kvtier.errors import ConfigError
from kvtier.identity import (
    IGNORED_CONFIG_KEYS,
    ModelIdentity,
    config_digest,
    declared_weights,
    identify_weights,
)

#: ``ModelConfig`` fields that cannot change the KV bytes of a token sequence:
#: where the model lives (the weights identity covers what is there),
#: tokenisation (keys are token ids), sampling and output settings, limits,
#: multimodal front-ends (multimodal prompts are never offloaded), memory
#: management, and ``hf_overrides`` (applied to ``hf_config``, which counts).
#: ``max_model_len`` is not one of them: Phi-3's LongRoPE uses its long
#: factors at every position once it exceeds the original context, and other
#: models size their rotary embedding or attention scaling by it.
IGNORED_MODEL_FIELDS = frozenset(
    {
        "model",
        "model_weights",
        "served_model_name",
        "tokenizer",
        "tokenizer_mode",
        "tokenizer_revision",
        "skip_tokenizer_init",
        "hf_config_path",
        "hf_token",
        "hf_overrides",
        "hf_text_config",
        "config_format",
        "seed",
        "spec_target_max_model_len",
        "max_logprobs",
        "logprobs_mode",
        "return_sampling_mask",
        "use_fp64_gumbel",
        "enable_trace_replay",
        "enforce_eager",
        "disable_cascade_attn",
        "generation_config",
        "override_generation_config",
        "logits_processors",
        "io_processor_plugin",
        "pooler_config",
        "multimodal_config",
        "allowed_local_media_path",
        "allowed_media_domains",
        "enable_prompt_embeds",
        "enable_sleep_mode",
        "sleep_preserve_parameter_names",
        "sleep_mode_backend",
        "sleep_mode_offload_cudagraph",
        "enable_nccl_comm_suspend",
        "enable_cumem_allocator",
        "renderer_num_workers",
    }
)

#: Load formats that read the weights from the model's directory (or its
#: Hugging Face snapshot); others get them from elsewhere and need
#: ``kvtier_model_id``.
FILE_LOAD_FORMATS = frozenset(
    {
        "auto",
        "hf",
        "safetensors",
        "pt",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "sharded_state",
        "runai_streamer",
        "runai_streamer_sharded",
    }
)


def model_config_entries(model_config: Any, load_config: Any) -> dict[str, Any]:
    """Every ``ModelConfig`` field that can change the KV bytes, and how weights load.

    The Hugging Face config (after overrides) leaves out the bookkeeping that
    :data:`~kvtier.identity.IGNORED_CONFIG_KEYS` names; the dtype vLLM
    computes in is the resolved ``ModelConfig.dtype``.
    """
    entries = {
        field.name: getattr(model_config, field.name, None)
        for field in dataclasses.fields(model_config)
        if field.name not in IGNORED_MODEL_FIELDS
    }
    if getattr(model_config, "original_max_model_len", None) == -1:
        # Fitted to memory after the model was built with the context its
        # config gives (which the config digest covers): the fitted length
        # changed nothing the model computes, only the engine's memory.
        entries["max_model_len"] = "auto-fit"
    hf_config = model_config.hf_config.to_dict()
    entries["hf_config"] = {
        key: value for key, value in hf_config.items() if key not in IGNORED_CONFIG_KEYS
    }
    entries["load_format"] = str(getattr(load_config, "load_format", "auto"))
    entries["model_loader_extra_config"] = getattr(load_config, "model_loader_extra_config", None)
    # Which of the directory's weight files vLLM loads (two variants of a
    # checkpoint side by side, say); every file counts in the weights identity.
    entries["ignore_patterns"] = getattr(load_config, "ignore_patterns", None)
    return entries


def model_identity(
    vllm_config: Any, *, model_id: str | None = None, full_read: bool = False
) -> ModelIdentity:
    """The identity of the model ``vllm_config`` serves, and of its draft model.

    ``model_id`` (``kvtier_model_id``) declares the weights' identity instead
    of reading their files; ``full_read`` reads every byte of them. A draft
    model of speculative decoding (EAGLE heads, a smaller model) keeps the KV
    of its own attention layers in the same pages as the target's, so its
    configuration and weights count too (a declared ``model_id`` stands for
    its weights as well).
    """
    target = _identity(vllm_config.model_config, vllm_config.load_config, model_id, full_read)
    speculative = getattr(vllm_config, "speculative_config", None)
    draft_config = getattr(speculative, "draft_model_config", None)
    if draft_config is None or draft_config is vllm_config.model_config:
        return target  # no draft layers (n-gram, suffix): vLLM names the target's config
    draft_loads = getattr(speculative, "draft_load_config", None) or vllm_config.load_config
    draft = _identity(draft_config, draft_loads, model_id, full_read)
    method = str(getattr(speculative, "method", None))
    config = config_digest({"target": target.config, "method": method, "draft": draft.config})
    return ModelIdentity(config, f"{target.weights}+draft:{draft.weights}")


def _identity(
    model_config: Any, load_config: Any, model_id: str | None, full_read: bool
) -> ModelIdentity:
    config = config_digest(model_config_entries(model_config, load_config), ignored=())
    if model_id is not None:
        return ModelIdentity(config, declared_weights(model_id))
    load_format = str(getattr(load_config, "load_format", "auto"))
    if load_format == "dummy":
        # Random weights, for profiling: never shared with another engine.
        return ModelIdentity(config, f"dummy:{uuid.uuid4().hex}")
    model = str(getattr(model_config, "model_weights", "") or model_config.model)
    if load_format not in FILE_LOAD_FORMATS:
        raise _undeclared(
            f"load_format={load_format!r} loads the weights of {model!r} from "
            "elsewhere than files kvtier can read"
        )
    download_dir = getattr(load_config, "download_dir", None)
    weights = identify_weights(
        model,
        revision=getattr(model_config, "revision", None),
        cache_dirs=(download_dir, None) if download_dir else (None,),
        full_read=full_read,
    )
    if weights is None:
        raise _undeclared(
            f"the weights of {model!r} are neither in a local directory nor in "
            "the Hugging Face cache"
        )
    return ModelIdentity(config, weights.token)


def _undeclared(reason: str) -> ConfigError:
    return ConfigError(
        [
            (
                "kv_connector_extra_config.kvtier_model_id",
                f"kvtier cannot identify the model's weights: {reason}; set kvtier_model_id "
                "to a name that you change whenever the weights change",
            )
        ]
    )


def model_name(model_config: Any) -> str:
    """A readable name for the layout, taken from the config rather than the path.

    The namespace's identity lies in the config and weights digests; the name
    only helps a person reading ``kvtier inspect``, and it must not make two
    copies of one model at different paths look different.
    """
    architectures = getattr(model_config.hf_config, "architectures", None) or ()
    return str(architectures[0]) if architectures else str(model_config.hf_config.model_type)
