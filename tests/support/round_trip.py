"""The round trip most cache tests end with: chunks stored, the CPU tier
emptied, the whole prefix found and loaded back from the secondary tiers."""

from __future__ import annotations

import numpy as np

from kvtier import KVCache


def assert_served_after_primary_reset(cache: KVCache, tokens: list[int], data: np.ndarray) -> None:
    """Store ``data`` (one row a chunk) for ``tokens``, empty the primary tier,
    then find every token cached and load ``data`` back byte-exact."""
    assert cache.store(tokens, data) == len(data)
    cache.drain()
    cache.manager.reset()
    assert cache.cached_prefix(tokens) == len(tokens)
    out = np.zeros_like(data)
    cache.load(tokens, len(tokens), out)
    np.testing.assert_array_equal(out, data)
