"""A separate process using an ``fs`` tier, for the crash, restart and sharing tests.

    python fs_worker.py store ROOT SEED COUNT [max_bytes]   store COUNT chunks, exit 0
    python fs_worker.py churn ROOT SEED COUNT               print "ready", store until killed
    python fs_worker.py verify ROOT SEED COUNT              exit 0 iff every chunk hits, exact
    python fs_worker.py zygote ROOT 0 COUNT                 per SEED line on stdin: fork a
        child that prints "ready PID", stores COUNT chunks (printing "stored" after the
        first batch and "done" at the end); print "reaped" when it ends
    python fs_worker.py bounded ROOT SEED COUNT max_bytes   store COUNT chunks of its own
        and of a pool all workers share, in batches, loading some back after each batch
        and checking their bytes; prints "batch N" per batch, "wrong KEY" for any
        chunk whose bytes are not its own, "done"; exit 0, or 5 after a wrong chunk

The zygote pays the import cost once, so a crash test can kill many writers quickly.

Chunk bytes are a pure function of the key, so any process can tell what a
chunk must contain without being told.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from kvtier.keys import ChunkKey, chunk_keys
from kvtier.layout import KVLayout
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.base import Lookup
from kvtier.tiers.fs import FilesystemTier

#: 32 KiB chunks: big enough that a kill often lands inside a write.
LAYOUT = small_layout(chunk_tokens=64)


def keys_for(seed: int, count: int, layout: KVLayout = LAYOUT) -> list[ChunkKey]:
    tokens = np.random.default_rng(seed).integers(0, 2**31, count * layout.chunk_tokens)
    return chunk_keys(layout.namespace, tokens, layout.chunk_tokens)


def payload_for(key: bytes, layout: KVLayout = LAYOUT) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, layout.slot_bytes, dtype=np.uint8)


def open_tier(
    root: str | os.PathLike[str], num_slots: int = 16, **options: Any
) -> TierHarness[FilesystemTier]:
    harness = TierHarness(
        {"type": "fs", "root_dir": str(root), **options},
        LAYOUT,
        num_slots,
        tier_class=FilesystemTier,
    )
    harness.tier.wait_index(30)
    return harness


def store(harness: TierHarness, keys: list[ChunkKey]) -> bool:
    batch = harness.buffer.num_slots
    ok = True
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        for slot, key in enumerate(part):
            harness.buffer.array[slot] = payload_for(key)
        ok &= harness.store(part, list(range(len(part)))).success
    return ok


def zygote(root: str, count: int) -> int:
    """Fork one writer per seed read from stdin (no threads exist before the fork)."""
    for line in sys.stdin:
        seed = int(line)
        pid = os.fork()
        if pid == 0:
            try:
                harness = open_tier(root, io_threads=4)
                print(f"ready {os.getpid()}", flush=True)
                keys = keys_for(seed, count)
                first = harness.buffer.num_slots
                store(harness, keys[:first])
                print("stored", flush=True)
                store(harness, keys[first:])
                harness.close()
                print("done", flush=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
    return 0


#: Keys every ``bounded`` worker stores and loads, so they read each other's files.
POOL = 64


def bounded(harness: TierHarness, seed: int, count: int) -> int:
    rng = np.random.default_rng(seed)
    own, pool = keys_for(seed, count), keys_for(1_000_000, POOL)
    per_batch = harness.buffer.num_slots // 2
    wrong = 0
    for batch, start in enumerate(range(0, count, per_batch - 4)):
        mine = own[start : start + per_batch - 4]
        shared = [pool[i] for i in rng.choice(POOL, 4, replace=False)]
        store(harness, mine + shared)
        wanted = [own[i] for i in rng.integers(0, start + len(mine), 2)] + shared[:2]
        found = [key for key in dict.fromkeys(wanted) if harness.lookup(key) is Lookup.HIT]
        base = per_batch
        result = harness.load(found, list(range(base, base + len(found))))
        for slot, key in enumerate(found, start=base):
            # A chunk another worker evicted meanwhile fails to load: a miss.
            if key in result.succeeded and not np.array_equal(
                harness.buffer.array[slot], payload_for(key)
            ):
                print(f"wrong {key.hex()}", flush=True)
                wrong += 1
        print(f"batch {batch}", flush=True)
    print("done", flush=True)
    return 5 if wrong else 0


def main(argv: list[str]) -> int:
    command, root, seed, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    if command == "zygote":
        return zygote(root, count)
    options: dict[str, Any] = {"io_threads": 4}
    if len(argv) > 4:
        options["max_bytes"] = int(argv[4])
    keys = keys_for(seed, count)
    harness = open_tier(root, **options)
    try:
        if command == "store":
            return 0 if store(harness, keys) else 1
        if command == "bounded":
            return bounded(harness, seed, count)
        if command == "churn":
            print("ready", flush=True)
            store(harness, keys)
            print("done", flush=True)
            return 0
        if command == "verify":
            for slot, key in enumerate(keys):
                if harness.lookup(key) is not Lookup.HIT:
                    return 2
                if not harness.load([key], [slot % harness.buffer.num_slots]).success:
                    return 3
                if not np.array_equal(
                    harness.buffer.array[slot % harness.buffer.num_slots], payload_for(key)
                ):
                    return 4
            return 0
        raise SystemExit(f"unknown command {command!r}")
    finally:
        harness.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
