"""Prefill and greedy decoding over an explicit cache.

A small loop instead of ``model.generate`` so that a prefix loaded from
kvtier is used as is, the time to first token is measured where the first
token appears, and the cache is at hand afterwards to store.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from kvtier.integrations.transformers.chunks import new_cache


@dataclass(frozen=True)
class Generation:
    """One greedy generation and what kvtier did for it."""

    #: Generated token ids (the first one comes from the prompt's prefill).
    tokens: list[int]
    #: Seconds from the start of the request to the first generated token.
    ttft_s: float
    #: Seconds from the start of the request to the last generated token.
    total_s: float
    prompt_tokens: int
    #: Prompt tokens whose KV came from kvtier instead of the model.
    reused_tokens: int = 0
    #: Prompt tokens kvtier held (whole chunks; all but the last token can be reused).
    hit_tokens: int = 0
    #: Per secondary tier, in configuration order: chunks it served to this request.
    promoted_chunks: tuple[int, ...] = ()
    #: New chunks this request handed to kvtier.
    stored_chunks: int = 0
    #: The model's cache after the request: the prompt and all generated tokens but the last.
    cache: Cache | None = field(default=None, repr=False, compare=False)


@functools.cache
def _forward_arguments(model_class: type[PreTrainedModel]) -> tuple[str, bool]:
    """The name ``forward`` takes the cache by, and whether it takes
    ``logits_to_keep`` (once per model class, not once per token)."""
    parameters = inspect.signature(model_class.forward).parameters
    # transformers 5 names the argument ``cache``; earlier releases ``past_key_values``.
    return ("cache" if "cache" in parameters else "past_key_values"), "logits_to_keep" in parameters


def _forward(model: PreTrainedModel, token_ids: Sequence[int], cache: Cache) -> torch.Tensor:
    """Run ``token_ids`` after what ``cache`` holds; returns the last position's logits."""
    cache_argument, keeps_logits = _forward_arguments(type(model))  # type: ignore[arg-type]
    kwargs: dict[str, object] = {cache_argument: cache}
    if keeps_logits:
        kwargs["logits_to_keep"] = 1
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        output = model(input_ids=input_ids, use_cache=True, **kwargs)
    return output.logits[0, -1]


def prefill(
    model: PreTrainedModel, token_ids: Sequence[int], cache: Cache | None = None
) -> tuple[torch.Tensor, Cache]:
    """Prefill the tokens of ``token_ids`` that ``cache`` does not hold yet.

    ``cache`` holds the KV of a prefix of ``token_ids`` (or nothing); at least
    one token must be left to compute, since logits come from computed tokens.
    Returns the logits after the last token, and the cache now holding all of them.
    """
    cache = cache if cache is not None else new_cache(model.config)
    held = cache.get_seq_length()
    if held >= len(token_ids):
        raise ValueError(
            f"the cache holds {held} tokens of a {len(token_ids)}-token prompt: "
            "leave at least one token to prefill"
        )
    return _forward(model, token_ids[held:], cache), cache


def greedy_generate(
    model: PreTrainedModel,
    token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    cache: Cache | None = None,
    eos_token_id: int | None = None,
    started: float | None = None,
) -> Generation:
    """Greedy decoding of ``max_new_tokens`` tokens (fewer if ``eos_token_id`` comes).

    ``cache`` may hold the KV of a prefix of ``token_ids``: only the rest is
    prefilled. ``started`` is the ``time.perf_counter()`` the request began
    (default: now), so loading the prefix counts toward the time to first token.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    started = time.perf_counter() if started is None else started
    logits, cache = prefill(model, token_ids, cache)
    tokens = [int(logits.argmax())]
    ttft = time.perf_counter() - started
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        tokens.append(int(_forward(model, tokens[-1:], cache).argmax()))
    return Generation(
        tokens=tokens,
        ttft_s=ttft,
        total_s=time.perf_counter() - started,
        prompt_tokens=len(token_ids),
        cache=cache,
    )
