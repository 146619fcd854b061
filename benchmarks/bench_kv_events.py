"""What kvtier's KV events cost the vLLM scheduler: memory per remembered
chunk, and the time to announce chunks against vLLM's own events for the
same blocks (its block pool caching them), measured in the same run.

Needs vLLM (the environment of scripts/test-vllm.sh):

    python benchmarks/bench_kv_events.py                      # 256-token chunks, 16-token blocks
    python benchmarks/bench_kv_events.py --block-size 128     # vLLM's CPU block size
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import tracemalloc
from typing import Any

from vllm import SamplingParams, envs
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtier.integrations.vllm.events import TierEvents
from kvtier.keys import ChunkKey


def requests(count: int, chunk_tokens: int, block_size: int, seed: int = 0) -> list[Request]:
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(block_size, sha256_cbor)
    rng = random.Random(seed)
    return [
        Request(
            str(i),
            [rng.randrange(1000, 100_000) for _ in range(chunk_tokens)],
            SamplingParams(max_tokens=1),
            None,
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def tier_events(chunk_tokens: int, block_size: int, count: int) -> TierEvents:
    return TierEvents(
        ["cpu", "fs"],
        blocks_per_chunk=chunk_tokens // block_size,
        block_size=block_size,
        hash_block_size=block_size,
        max_chunks=count,
        max_queued=4 * count,
    )


def memory_per_chunk(reqs: list[Request], chunk_tokens: int, block_size: int) -> float:
    """Bytes the connector holds per chunk, announced in two tiers."""
    events = tier_events(chunk_tokens, block_size, len(reqs))
    keys = [ChunkKey(os.urandom(32)) for _ in reqs]
    tracemalloc.start()
    try:
        for request, key in zip(reqs, keys, strict=True):
            events.remember(request, [0], [key])
        events.changed("cpu", keys, True)
        events.changed("fs", keys, True)
        published = events.take()
        assert len(published) == 2 * len(reqs)
        del published
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held / len(reqs)


def kvtier_seconds(reqs: list[Request], chunk_tokens: int, block_size: int) -> float:
    """Record each chunk and announce it stored in one tier, then removed."""
    events = tier_events(chunk_tokens, block_size, len(reqs))
    keys = [ChunkKey(os.urandom(32)) for _ in reqs]
    began = time.perf_counter()
    for request, key in zip(reqs, keys, strict=True):
        events.remember(request, [0], [key])
    events.changed("cpu", keys, True)
    events.changed("cpu", keys, False)
    count = len(events.take())
    seconds = time.perf_counter() - began
    assert count == len(reqs) + 1  # one store per chunk, one removal of them all
    return seconds


def vllm_seconds(reqs: list[Request], chunk_tokens: int, block_size: int) -> float:
    """vLLM's block pool caching the same blocks with its events on, then taking them."""
    blocks = chunk_tokens // block_size
    pool = BlockPool(
        num_gpu_blocks=len(reqs) * blocks + 1,
        enable_caching=True,
        hash_block_size=block_size,
        enable_kv_cache_events=True,
    )
    began = time.perf_counter()
    for request in reqs:
        pool.cache_full_blocks(request, pool.get_new_blocks(blocks), 0, blocks, block_size, 0)
    count = len(pool.take_events())
    seconds = time.perf_counter() - began
    assert count == len(reqs)
    return seconds


def run(chunks: int, chunk_tokens: int, block_size: int, repeats: int) -> dict[str, Any]:
    # As vLLM's engine core does once it has started: its settings are read
    # once, not at every hash conversion.
    envs.enable_envs_cache()
    reqs = requests(chunks, chunk_tokens, block_size)
    ours = min(kvtier_seconds(reqs, chunk_tokens, block_size) for _ in range(repeats))
    theirs = min(vllm_seconds(reqs, chunk_tokens, block_size) for _ in range(repeats))
    return {
        "chunks": chunks,
        "chunk_tokens": chunk_tokens,
        "block_size": block_size,
        "bytes_per_chunk": round(memory_per_chunk(reqs, chunk_tokens, block_size)),
        "kvtier_us_per_chunk": ours / chunks * 1e6,
        "vllm_us_per_chunk": theirs / chunks * 1e6,
        "kvtier_over_vllm": ours / theirs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=4000)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few chunks, once")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.repeats = 50, 1
    result = run(args.chunks, args.chunk_tokens, args.block_size, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{result['chunks']} chunks of {result['chunk_tokens']} tokens in "
        f"{result['block_size']}-token blocks: {result['bytes_per_chunk']} bytes remembered "
        f"per chunk; announcing costs {result['kvtier_us_per_chunk']:.1f} us per chunk, "
        f"{result['kvtier_over_vllm']:.2f}x vLLM's own events for the same blocks "
        f"({result['vllm_us_per_chunk']:.1f} us)"
    )


if __name__ == "__main__":
    main()
