"""The demo's model: a small Llama built locally from a config, or a local checkpoint.

Nothing is downloaded: the built-in model is initialised from a fixed seed
(the same weights in every process), and ``--model PATH`` loads only files
already on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)


@dataclass(frozen=True)
class DemoSize:
    """The built-in model's shape and the workload run on it."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    #: Tokens of the shared system prompt.
    system_tokens: int
    #: Default ``chunk_tokens`` of the embedded configuration.
    chunk_tokens: int
    conversations: int
    turns: int
    new_tokens: int


SIZES = {
    # Prefill of ~2k tokens takes seconds on two CPU cores; a reused prefix, milliseconds.
    "default": DemoSize("default", 512, 8, 8, 2, 1536, 2048, 64, 2, 3, 12),
    # For CI: the same workload shape, in a second or two.
    "quick": DemoSize("quick", 64, 2, 4, 2, 128, 192, 16, 2, 2, 4),
}

#: Token ids of the built-in model: raw UTF-8 bytes.
BYTE_VOCAB = 256
SEED = 0


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: the built-in model needs no vocabulary files."""

    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class _HFTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def build_demo_model(size: DemoSize, seed: int = SEED) -> PreTrainedModel:
    """A Llama-family model with ``size``'s shape and weights drawn from ``seed``."""
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


#: Files of which any one means a model directory ships its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_local_model(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Tokenizer]:
    """A causal LM and its tokenizer from a local directory (bytes if it has no tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return model, _HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    if model.config.vocab_size < BYTE_VOCAB:
        raise ValueError(
            f"{path} has no tokenizer, and its vocabulary of {model.config.vocab_size} "
            "tokens is too small for byte tokens"
        )
    return model, ByteTokenizer()
