"""Redis memory per chunk of the cluster index, by how many nodes hold each chunk.

Starts a loopback ``redis-server``, publishes ``--chunks`` chunk keys through
:class:`kvtier.fleet.redis.RedisIndex` as ``h`` nodes each holding every one
(``h`` = 1, 2, 4, 8; a fresh database each time), and prints the server's
``used_memory`` growth per chunk key: what the fleet model in docs/fleet.md
sizes the index with.

    python benchmarks/bench_index_memory.py [--chunks 20000]
    python benchmarks/bench_index_memory.py --quick --json   # 500 keys, as the tests run it
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
import sys
from pathlib import Path
from typing import Any

# kvtier's loopback redis fixture lives in the checkout's tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import RedisServer

from kvtier.fleet.base import PRIMARY_MEDIUM, NodeLease
from kvtier.fleet.publisher import INCARNATION_CHARS
from kvtier.fleet.redis import RedisIndex, RedisIndexOptions
from kvtier.keys import ChunkKey

BATCH = 4096  # the index's default batch_size


def bytes_per_key(index: RedisIndex, client: Any, chunks: int, holders: int) -> dict[str, Any]:
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    keys = [
        ChunkKey(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())
        for i in range(chunks)
    ]
    for node in range(holders):
        incarnation = secrets.token_hex(INCARNATION_CHARS // 2)
        lease = NodeLease(f"node-{node}", f"127.0.0.1:{9000 + node}")
        for start in range(0, chunks, BATCH):
            added = [(key, PRIMARY_MEDIUM) for key in keys[start : start + BATCH]]
            index.publish(incarnation, lease, added, [])
    grown = int(client.info("memory")["used_memory"]) - before
    chunk_keys = list(client.scan_iter(match="kvtier:index:c:*", count=1000))
    entries = sum(int(client.zcard(name)) for name in chunk_keys)
    return {
        "holders": holders,
        "chunk_keys": len(chunk_keys),
        "entries": entries,
        "bytes_per_key": grown / chunks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--holders", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--quick", action="store_true", help="500 keys: checks the driver only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
    args = parser.parse_args()
    chunks = 500 if args.quick else args.chunks
    import redis

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        # A generous timeout: a loaded machine may take seconds over a batch.
        index = RedisIndex(RedisIndexOptions(url=server.url, timeout_s=30.0))
        version = client.info("server")["redis_version"]
        try:
            rows = [bytes_per_key(index, client, chunks, holders) for holders in args.holders]
        finally:
            index.close()
            client.close()
    if args.json:
        print(json.dumps({"redis": version, "chunks": chunks, "rows": rows}, indent=2))
        return
    print(f"redis {version}, {chunks} chunk keys, used_memory growth per key:")
    for row in rows:
        holders = row["holders"]
        print(f"  {holders} holder{'s' if holders > 1 else ''}: {row['bytes_per_key']:.0f} bytes")


if __name__ == "__main__":
    main()
