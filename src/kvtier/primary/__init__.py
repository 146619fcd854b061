"""The CPU primary tier."""

from kvtier.primary.buffer import SlotBuffer
from kvtier.primary.tier import WRITING, PrimaryTier

__all__ = ["WRITING", "PrimaryTier", "SlotBuffer"]
