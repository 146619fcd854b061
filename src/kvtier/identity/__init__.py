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

from dataclasses import dataclass

from kvtier.identity.adapters import AdapterIdentities
from kvtier.identity.config import IGNORED_CONFIG_KEYS, config_digest
from kvtier.identity.hub import locate_model
from kvtier.identity.named import identify_weights
from kvtier.identity.weights import WeightsIdentity, hub_revision, weights_identity


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
