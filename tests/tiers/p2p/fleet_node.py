"""One node of a test fleet, run as a process: ``python fleet_node.py INDEX CHUNKS CHUNK_KIB``.

It stores ``CHUNKS`` synthetic chunks (seed ``INDEX``) and serves them through
a ``p2p`` tier with default settings, prints ``listening on ADDRESS``, then
reads one JSON line: the ``[address, seed]`` of every other node. It fetches
every chunk of every one of them through a second cache whose ``p2p`` tier
(default settings) names them as peers, checks the bytes, prints one JSON
line of results, and keeps serving (its connections open and idle) until
its standard input closes; then it prints what it served, and exits.
"""

from __future__ import annotations

import json
import random
import sys
import threading

import numpy as np

from kvtier import KVCache
from kvtier.cli.peer import synthetic_chunks
from kvtier.cli.probe import probe_layout

SECRET = "kvtier-fleet-secret-0123456789"
CHUNK_TOKENS = 16


def main() -> None:
    index, chunks, chunk_kib = (int(arg) for arg in sys.argv[1:4])
    layout = probe_layout(CHUNK_TOKENS, chunk_kib)
    serving = KVCache(
        {
            "chunk_tokens": CHUNK_TOKENS,
            "cpu_bytes_to_use": (chunks + 2) * layout.slot_bytes,
            "secondary_tiers": [{"type": "p2p", "secret": SECRET}],
        },
        layout,
    )
    tokens, data = synthetic_chunks(layout, chunks, index)
    serving.store(tokens, data)
    tier = serving.manager.tiers[0]
    print(f"listening on {tier.describe()['listen']}", flush=True)
    stop = threading.Event()

    def step() -> None:  # as an engine would, between requests
        while not stop.wait(0.05):
            serving.step()

    stepper = threading.Thread(target=step, daemon=True)
    stepper.start()

    peers = [(str(address), int(seed)) for address, seed in json.loads(sys.stdin.readline())]
    random.Random(index).shuffle(peers)  # not every node asks the same peer first
    fetcher = KVCache(
        {
            "chunk_tokens": CHUNK_TOKENS,
            "cpu_bytes_to_use": (len(peers) * chunks + 2) * layout.slot_bytes,
            "secondary_tiers": [
                {"type": "p2p", "secret": SECRET, "listen": None, "peers": [a for a, _ in peers]}
            ],
        },
        layout,
    )
    results = {}
    for address, seed in peers:
        peer_tokens, peer_data = synthetic_chunks(layout, chunks, seed)
        found = fetcher.cached_prefix(peer_tokens) // CHUNK_TOKENS
        out = np.zeros_like(peer_data)
        exact = 0
        if found:
            fetcher.load(peer_tokens, found * CHUNK_TOKENS, out)
            exact = int(sum(np.array_equal(out[i], peer_data[i]) for i in range(found)))
        results[address] = exact
    print(
        json.dumps(
            {
                "index": index,
                "fetched": results,
                "served": tier.describe(),
                "fetcher": fetcher.manager.tiers[0].describe(),
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # until the test closes it: connections stay open meanwhile
    print(json.dumps({"served": tier.describe()}), flush=True)
    stop.set()
    stepper.join()
    fetcher.close()
    serving.close()


if __name__ == "__main__":
    main()
