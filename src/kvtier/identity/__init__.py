"""What identifies a model's KV cache: its resolved configuration and its weights.

Two engines may share a chunk only if they would compute the same bytes for
it, so every engine integration mixes a :class:`ModelIdentity` into its
layout's namespace (see :attr:`kvtier.layout.KVLayout.extra`):

- ``config``: :func:`config_digest` of the configuration as the engine
  resolved it (overrides, rope settings, quantization, dtype, revision);
- ``weights``: what identifies the weights: :func:`weights_identity` of the
  files they were loaded from, a fingerprint of weights held in memory, or
  an identity the user declares and answers for.

An integration calls it with a plain mapping and a model path::

    identity = ModelIdentity(
        config=config_digest(hf_config.to_dict() | {"dtype": "bfloat16"}),
        weights=weights_identity(locate_model(model_path)).token,
    )
    layout = KVLayout(..., extra=(*identity.layout_extra, ...))
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.identity.config import IGNORED_CONFIG_KEYS, config_digest
from kvtier.identity.hub import locate_model
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
    "ModelIdentity",
    "WeightsIdentity",
    "config_digest",
    "declared_weights",
    "hub_revision",
    "locate_model",
    "weights_identity",
]
