"""A cache's secondary tiers, and a remote tier's backend, as the types a test
built them as, checked."""

from __future__ import annotations

from typing import Any, TypeVar

from kvtier import KVCache
from kvtier.tiers.backend import Backend
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.remote import RemoteTier

Tier = TypeVar("Tier", bound=SecondaryTier)
SomeBackend = TypeVar("SomeBackend", bound=Backend[Any])


def tier_at(cache: KVCache, index: int, kind: type[Tier]) -> Tier:
    """The cache's secondary tier ``index``, which must be a ``kind``."""
    tier = cache.manager.tiers[index]
    assert isinstance(tier, kind), f"tier {index} is a {type(tier).__name__}, not a {kind.__name__}"
    return tier


def tiers_of(cache: KVCache, kind: type[Tier]) -> list[Tier]:
    """Every secondary tier of the cache, each of which must be a ``kind``."""
    return [tier_at(cache, index, kind) for index in range(len(cache.manager.tiers))]


def backend_of(tier: RemoteTier[Any], kind: type[SomeBackend]) -> SomeBackend:
    """The remote tier's backend, which must be a ``kind``."""
    backend = tier.backend
    assert isinstance(backend, kind), (
        f"the backend is a {type(backend).__name__}, not a {kind.__name__}"
    )
    return backend
