"""Helpers for the ``redis`` tier's ``watch_evictions`` tests."""

from __future__ import annotations

from typing import Any

from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness, small_layout
from kvtier.testing.outages import wait_until
from kvtier.tiers.redis import RedisTier


def watched(
    server: dict[str, Any], key_prefix: str, **options: Any
) -> tuple[TierHarness[RedisTier], list[ChunkKey]]:
    """A tier on ``server`` (``url`` or ``startup_nodes``) hearing its drops,
    and the keys residency was told are gone."""
    entry = {"type": "redis", **server, "key_prefix": key_prefix, "watch_evictions": True}
    harness = TierHarness({**entry, **options}, small_layout(), tier_class=RedisTier)
    removed: list[ChunkKey] = []
    harness.tier.removal_listeners.append(removed.extend)
    return harness, removed


def an_expiry_is_heard(
    harness: TierHarness[RedisTier], removed: list[ChunkKey], url: str
) -> ChunkKey:
    """Expire a chunk of the tier's behind its back (``url``: a raw client's
    way in) and wait until residency is told; the chunk's key."""
    import redis

    key = harness.keys(1)[0]
    redis.Redis.from_url(url).set(harness.tier.store_name(key), b"v", px=10)
    wait_until(lambda: key in removed, what="the expiry reported")
    return key


def every_expiry_is_heard(
    harness: TierHarness[RedisTier], removed: list[ChunkKey], count: int = 24
) -> list[ChunkKey]:
    """Store ``count`` chunks, which the tier's ``ttl_s`` expires, and wait
    until residency is told of each, and of nothing else; their keys."""
    keys = harness.keys(count)
    harness.fill(range(count))
    assert harness.store(keys, list(range(count))).success
    wait_until(lambda: len(removed) >= count, what=f"{count} expiries reported")
    assert sorted(removed) == sorted(keys)
    return keys
