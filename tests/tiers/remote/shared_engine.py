"""One engine process of ``test_shared_engines``: stores or loads chunks through kvtier.

    python shared_engine.py CONFIG.json store|load OUT.npy

``store`` offloads random chunks of a fixed token sequence and saves them to
``OUT.npy``; ``load`` finds the cached prefix of the same sequence, copies
it out of kvtier and saves what it got. Prints the tier's stats as JSON.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvtier import KVCache
from kvtier.testing import small_layout

CHUNKS = 6


def main() -> None:
    config_path, mode, out_path = sys.argv[1:]
    with open(config_path) as file:
        config = json.load(file)
    layout = small_layout(chunk_tokens=config["chunk_tokens"])
    tokens = list(range(5000, 5000 + CHUNKS * layout.chunk_tokens))
    with KVCache(config, layout) as cache:
        if mode == "store":
            data = np.random.default_rng().integers(
                0, 256, (CHUNKS, layout.slot_bytes), dtype=np.uint8
            )
            stored = cache.store(tokens, data)
            cache.drain()
            if stored != CHUNKS:
                raise SystemExit(f"stored {stored} of {CHUNKS} chunks")
        else:
            hit = cache.cached_prefix(tokens)
            data = np.zeros((hit // layout.chunk_tokens, layout.slot_bytes), dtype=np.uint8)
            cache.load(tokens, hit, data)
        np.save(out_path, data)
        print(json.dumps(cache.manager.tiers[0].stats.as_dict()))


if __name__ == "__main__":
    main()
