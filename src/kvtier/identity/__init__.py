"""What identifies a model's KV cache: its resolved configuration and its weights.

Two engines may share a chunk only if they would compute the same bytes for
it, so every engine integration mixes a :class:`ModelIdentity` into its
layout's namespace (see :attr:`kvtier.layout.KVLayout.extra`):

- ``config``: :func:`config_digest` of the configuration as the engine
  resolved it (overrides, rope settings, quantization, dtype, revision);
- ``weights``: what identifies the weights: :func:`weights_identity` of the
  files they were loaded from, a fingerprint of weights held in memory, or
  an identity the user declares and answers for.

A LoRA adapter changes a prefix's KV too: :class:`AdapterIdentities`
identifies an adapter by its files, for the first link of a request's chain.

An integration (vLLM's, SGLang's) needs a plain mapping of its resolved
configuration and the model's name or path::

    weights = identify_weights(model_path, revision=revision)
    if weights is None:
        ...  # neither a local path nor a cached hub snapshot: ask the user for an id
    identity = ModelIdentity(config_digest(resolved_config), weights.token)
    layout = KVLayout(..., extra=(*identity.layout_extra, ...))
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.identity.adapters import AdapterIdentities
from kvtier.identity.config import IGNORED_CONFIG_KEYS, config_digest
from kvtier.identity.hub import locate_model
from kvtier.identity.weights import WeightsIdentity, hub_revision, weights_identity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelIdentity:
    """A model's identity as a layout records it."""

    #: :func:`config_digest` of the resolved configuration.
    config: str
    #: An identity of the weights, e.g. :attr:`WeightsIdentity.token`.
    weights: str

    @property
    def layout_extra(self) -> tuple[tuple[str, str], ...]:
        """Entries for :attr:`kvtier.layout.KVLayout.extra`."""
        return (("config", self.config), ("weights", self.weights))


def identify_weights(
    name_or_path: str,
    *,
    revision: str | None = None,
    cache_dirs: Iterable[str | os.PathLike[str] | None] = (None,),
    full_read: bool = False,
) -> WeightsIdentity | None:
    """:func:`weights_identity` of a model named by path or Hugging Face repository id.

    Finds it with :func:`locate_model` (no network); ``None`` when it is in
    neither place. Logs what it read and how long it took.
    """
    path = locate_model(name_or_path, revision=revision, cache_dirs=cache_dirs)
    if path is None:
        return None
    began = time.perf_counter()
    weights = weights_identity(path, full_read=full_read)
    logger.info(
        "kvtier: weights of %s identified from %d files (%.1f GB%s): read %.1f MB in %.2f s",
        name_or_path,
        weights.files,
        weights.total_bytes / 1e9,
        f", revision {weights.revision}" if weights.revision else "",
        weights.bytes_read / 1e6,
        time.perf_counter() - began,
    )
    return weights


def declared_weights(model_id: str) -> str:
    """The weights identity of a model whose identity its user declares."""
    return f"declared:{model_id}"


__all__ = [
    "IGNORED_CONFIG_KEYS",
    "AdapterIdentities",
    "ModelIdentity",
    "WeightsIdentity",
    "config_digest",
    "declared_weights",
    "hub_revision",
    "identify_weights",
    "locate_model",
    "weights_identity",
]
