"""A cache's secondary tiers as the types a test built them as, checked."""

from __future__ import annotations

from typing import TypeVar

from kvtier import KVCache
from kvtier.tiers.base import SecondaryTier

Tier = TypeVar("Tier", bound=SecondaryTier)


def tier_at(cache: KVCache, index: int, kind: type[Tier]) -> Tier:
    """The cache's secondary tier ``index``, which must be a ``kind``."""
    tier = cache.manager.tiers[index]
    assert isinstance(tier, kind), f"tier {index} is a {type(tier).__name__}, not a {kind.__name__}"
    return tier


def tiers_of(cache: KVCache, kind: type[Tier]) -> list[Tier]:
    """Every secondary tier of the cache, each of which must be a ``kind``."""
    return [tier_at(cache, index, kind) for index in range(len(cache.manager.tiers))]
