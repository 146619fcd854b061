"""kvtier for Hugging Face ``transformers`` causal language models.

    from kvtier.integrations.transformers import PrefixCache

    with PrefixCache(model, "kvtier.yaml") as kv:
        result = kv.generate(prompt_ids, max_new_tokens=32)   # greedy
        result.reused_tokens                                  # prefill skipped

:class:`PrefixCache` counts the cached prefix of a prompt, loads it into a
fresh cache so the model prefills only the rest, and stores the full chunks
of every sequence it runs. The layout (and so the namespace every chunk key
starts from) comes from the model's config, dtype and weights: two models
that would compute different KV bytes never share a chunk.

Requires ``pip install 'kvtier[transformers]'``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from kvtier.errors import MissingDependencyError

    raise MissingDependencyError(exc.name or "transformers", "transformers") from exc

from kvtier.integrations.transformers.chunks import ChunkReader, ChunkWriter, new_cache
from kvtier.integrations.transformers.generate import Generation, greedy_generate, prefill
from kvtier.integrations.transformers.layout import (
    layout_for_model,
    layout_from_config,
    weights_fingerprint,
)
from kvtier.integrations.transformers.prefix_cache import PrefixCache, PrefixLoad

__all__ = [
    "ChunkReader",
    "ChunkWriter",
    "Generation",
    "PrefixCache",
    "PrefixLoad",
    "greedy_generate",
    "layout_for_model",
    "layout_from_config",
    "new_cache",
    "prefill",
    "weights_fingerprint",
]
