"""The offloading spec: what builds the tiers and the manager for a layout."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvtier.config.model import KVTierConfig
from kvtier.errors import LayoutMismatchError
from kvtier.layout import KVLayout

if TYPE_CHECKING:
    from kvtier.manager import TieringManager


class OffloadingSpec(ABC):
    """Binds a validated configuration to an engine's KV layout.

    Secondary tiers receive the spec: ``spec.layout`` tells them the chunk
    size and ``spec.layout.namespace`` the digest to store beside each chunk.
    """

    def __init__(self, config: KVTierConfig, layout: KVLayout) -> None:
        if layout.chunk_tokens != config.chunk_tokens:
            raise LayoutMismatchError(
                f"layout has chunk_tokens={layout.chunk_tokens}, "
                f"configuration has chunk_tokens={config.chunk_tokens}"
            )
        self.config = config
        self.layout = layout

    @abstractmethod
    def build_manager(self) -> TieringManager:
        """Create the primary tier, the secondary tiers and the manager over them."""
