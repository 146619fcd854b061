"""Drive vLLM's own filesystem tier for ``bench_fs.py`` (runs in a vLLM environment).

Started by ``bench_fs.py --peer-python /path/to/vllm-env/bin/python``; not
imported by kvtier. It builds ``FileSystemTierManager`` from the installed
``vllm`` (``vllm.v1.kv_offload.tiering.fs``) over a primary buffer of its own
(private and on huge pages, as kvtier's), then answers one line per round on
stdin::

    ROOT      store VOLUME bytes into a fresh ROOT, drop caches, load them back,
              check the bytes, print {"store_s": ..., "load_s": ..., "io": ...}
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from typing import Any

import numpy as np
import xxhash
from physical import drop_caches, segments_per_slot  # beside this script


def offloading_spec(tokens_per_block: int) -> Any:
    """A vLLM ``OffloadingSpec`` of one layer group: what a secondary tier reads of it."""
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    class BenchSpec(OffloadingSpec):
        def get_manager(self):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def get_worker(self, kv_caches):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("layer.0",), 0),),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="kvtier-bench", dtype="uint8"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return BenchSpec(config)


def main() -> int:
    volume, chunk, threads, job_chunks = (int(arg) for arg in sys.argv[1:5])
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    slots = volume // chunk
    # The same kind of buffer bench_fs.py gives kvtier: private, on huge pages.
    buffer = mmap.mmap(-1, slots * chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buffer).cast("B", (slots, chunk))
    array = np.frombuffer(buffer, dtype=np.uint8).reshape(slots, chunk)
    rng = np.random.default_rng(1)
    array[:] = rng.integers(0, 256, array.shape, dtype=np.uint8)
    digests = [xxhash.xxh3_64_digest(row.data) for row in array]
    spec = offloading_spec(256)
    segments = segments_per_slot(array, chunk)
    print(json.dumps({"ready": True, "segments_per_slot": segments}), flush=True)
    job_ids = iter(range(1, 1 << 30))
    for line in sys.stdin:
        root = line.strip()
        tier = FileSystemTierManager(
            spec,
            view,
            "fs",
            root_dir=root,
            n_read_threads=threads // 2,
            n_write_threads=threads - threads // 2,
        )
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(slots)]
        store_s = _run(tier, tier.submit_store, keys, job_chunks, False, job_ids)
        tier.drain_jobs()
        cold = drop_caches(root)
        array[:] = 0
        load_s = _run(tier, tier.submit_load, keys, job_chunks, True, job_ids)
        bad = sum(
            xxhash.xxh3_64_digest(row.data) != d for row, d in zip(array, digests, strict=True)
        )
        if bad:
            raise SystemExit(f"vLLM fs tier: {bad} chunks loaded wrong bytes")
        io_mode = "direct" if tier._use_o_direct else "buffered"
        tier.shutdown()
        print(
            json.dumps({"store_s": store_s, "load_s": load_s, "io": io_mode, "cold": cold}),
            flush=True,
        )
    return 0


def _run(tier, submit, keys, job_chunks, promotion, job_ids) -> float:  # type: ignore[no-untyped-def]
    """Submit jobs of ``job_chunks`` chunks for every key; seconds until all finished."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    context = ReqContext(req_id="bench")
    started = time.perf_counter()
    pending = set()
    for start in range(0, len(keys), job_chunks):
        job_id = next(job_ids)
        pending.add(job_id)
        chunk_ids = np.arange(start, min(start + job_chunks, len(keys)), dtype=np.int64)
        part = keys[start : start + job_chunks]
        submit(TransferJob(job_id, part, chunk_ids, promotion, context))
    failed = 0
    while pending:
        for result in tier.get_finished_jobs():
            pending.discard(result.job_id)
            failed += not result.success
        time.sleep(0.0002)
    seconds = time.perf_counter() - started
    if failed:
        raise SystemExit(f"vLLM fs tier: {failed} jobs failed")
    return seconds


if __name__ == "__main__":
    sys.exit(main())
