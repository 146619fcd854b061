import numpy as np

from kvtier import KVCache
from kvtier.testing import small_layout
from tests.support.round_trip import assert_served_after_primary_reset


def test_store_then_reload_after_primary_reset_is_byte_exact() -> None:
    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * layout.slot_bytes,
        "secondary_tiers": [{"type": "memory"}],
    }
    tokens = list(range(20))
    data = np.random.default_rng(0).integers(0, 256, (5, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        assert_served_after_primary_reset(cache, tokens, data)
