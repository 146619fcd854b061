"""What identifies a model's KV cache: its resolved configuration and its
weights, mixed into a layout's namespace so that only engines computing the
same bytes share chunks.

See docs/engine-api.md, 'The model's identity'.
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
