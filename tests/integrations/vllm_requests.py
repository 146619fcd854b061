"""A stand-in for vLLM's ``Request`` with the fields the connector's
scheduler side reads, for tests that drive it without an engine."""

from __future__ import annotations

from types import SimpleNamespace


def request(request_id: str, tokens: list[int]) -> SimpleNamespace:
    """A plain text request (no images, adapter or salt) for ``tokens``."""
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        mm_features=None,
        lora_request=None,
        cache_salt=None,
    )
