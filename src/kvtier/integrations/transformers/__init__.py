"""kvtier for Hugging Face ``transformers`` causal language models:
:class:`PrefixCache` loads a prompt's cached prefix so the model prefills
only the rest, and stores the full chunks of every sequence it runs.
Requires ``pip install 'kvtier[transformers]'``.

See docs/transformers.md.
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
