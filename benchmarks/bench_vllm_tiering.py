"""kvtier's fs tier inside vLLM's tiering, side by side with vLLM's own fs tier.

Runs in a vLLM environment (``.venv-vllm``). Both tiers are built from the
same ``secondary_tiers`` entries vLLM's factory takes (vLLM's ``fs``, and
``KVTierSecondaryTier`` with ``tier: {type: fs}``) over one primary buffer,
and driven through vLLM's ``SecondaryTierManager`` calls: stores of every
chunk in jobs of ``--job-chunks``, page cache dropped, loads back with every
byte checked. Rounds alternate between the two tiers; the figure is each
tier's median over ``--runs`` and kvtier ÷ vLLM per round. Then the same
chunks under faults: a flipped byte, a restart, two processes on one root,
a full disk::

    .venv-vllm/bin/python benchmarks/bench_vllm_tiering.py --root /mnt/nvme/bench
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from peer_vllm_fs import offloading_spec  # beside this script
from physical import drop_caches

MiB = 1 << 20
TIERS = ("vllm-fs", "kvtier-fs")


def build(kind: str, view: memoryview, root: str, threads: int, max_bytes: int = 0) -> Any:
    """A tier as vLLM's factory builds it from a ``secondary_tiers`` entry."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if kind == "vllm-fs":
        entry: dict[str, Any] = {
            "type": "fs",
            "root_dir": root,
            "n_read_threads": threads,
            "n_write_threads": threads,
        }
    else:
        # vLLM's pool has ``threads`` read-first and ``threads`` write-first
        # workers, each taking either kind of job: as many threads in all.
        tier: dict[str, Any] = {"type": "fs", "root_dir": root, "io_threads": 2 * threads}
        if max_bytes:
            tier["max_bytes"] = max_bytes
        entry = {
            "type": "KVTierSecondaryTier",
            "module_path": "kvtier.integrations.vllm.tiering",
            "tier": tier,
        }
    return SecondaryTierFactory.create_secondary_tier(entry, view, offloading_spec(16))


class Buffer:
    """A primary tier's rows: private, page-aligned, on huge pages where the kernel allows."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self._map = mmap.mmap(-1, rows * row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map).cast("B", (rows, row_bytes))
        self.array = np.frombuffer(self._map, dtype=np.uint8).reshape(rows, row_bytes)
        self.array[:] = np.random.default_rng(1).integers(0, 256, self.array.shape, np.uint8)
        self.digests = [xxhash.xxh3_64_digest(row.data) for row in self.array]

    def wrong_rows(self) -> int:
        return sum(
            xxhash.xxh3_64_digest(row.data) != digest
            for row, digest in zip(self.array, self.digests, strict=True)
        )


def keys(count: int, tag: bytes = b"bench") -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [
        make_offload_key(xxhash.xxh3_128_digest(tag + i.to_bytes(4, "big")), 0)
        for i in range(count)
    ]


_job_ids = iter(range(1, 1 << 40))


def transfer(
    tier: Any, chunk_keys: Sequence[bytes], *, load: bool, job_chunks: int
) -> tuple[float, int]:
    """Submit jobs of ``job_chunks`` chunks (slot ``i`` for key ``i``); seconds
    until all finished, and how many chunks failed."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    context = ReqContext(req_id="bench")
    submit = tier.submit_load if load else tier.submit_store
    started = time.perf_counter()
    pending: dict[int, int] = {}
    for start in range(0, len(chunk_keys), job_chunks):
        part = list(chunk_keys[start : start + job_chunks])
        job_id = next(_job_ids)
        pending[job_id] = len(part)
        chunk_ids = np.arange(start, start + len(part), dtype=np.int64)
        submit(TransferJob(job_id, part, chunk_ids, load, context))
    failed = 0
    while pending:
        for result in tier.get_finished_jobs():
            count = pending.pop(result.job_id)
            if not result.success:
                good = result.successful_keys
                failed += count - (len(good) if good else 0)
        time.sleep(0.0002)
    return time.perf_counter() - started, failed


def lookups(tier: Any, chunk_keys: Sequence[bytes]) -> list[str]:
    """Each key's lookup answer once the tier's existence checks resolved."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    context = ReqContext(req_id="bench-lookup")
    answers: list[Any] = []
    for _ in range(20000):
        answers = [tier.lookup(key, context) for key in chunk_keys]
        if LookupResult.RETRY not in answers:
            break
        tier.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.001)
    return [answer.name for answer in answers]


def speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for chunk in args.chunk_bytes:
        count = args.volume // chunk
        buffer = Buffer(count, chunk)
        results: dict[str, dict[str, list[float]]] = {t: {"store": [], "load": []} for t in TIERS}
        for run in range(args.runs):
            for kind in TIERS if run % 2 == 0 else reversed(TIERS):
                root = tempfile.mkdtemp(prefix=f"{kind}-", dir=args.root)
                tier = build(kind, buffer.view, root, args.threads)
                chunk_keys = keys(count, tag=f"{kind}{run}".encode())
                store_s, failed = transfer(tier, chunk_keys, load=False, job_chunks=args.job_chunks)
                tier.drain_jobs()
                drop_caches(root)
                saved = buffer.array.copy()
                buffer.array[:] = 0
                load_s, failed_loads = transfer(
                    tier, chunk_keys, load=True, job_chunks=args.job_chunks
                )
                wrong = buffer.wrong_rows()
                buffer.array[:] = saved
                tier.shutdown()
                shutil.rmtree(root, ignore_errors=True)
                if failed or failed_loads or wrong:
                    raise SystemExit(
                        f"{kind}: {failed} stores, {failed_loads} loads failed, {wrong} wrong"
                    )
                results[kind]["store"].append(args.volume / store_s / 1e9)
                results[kind]["load"].append(args.volume / load_s / 1e9)
        for what in ("store", "load"):
            ratios = [
                k / v
                for k, v in zip(results["kvtier-fs"][what], results["vllm-fs"][what], strict=True)
            ]
            rows.append(
                {
                    "chunk_KiB": chunk // 1024,
                    "what": what,
                    "vllm_fs_GBps": round(statistics.median(results["vllm-fs"][what]), 2),
                    "kvtier_fs_GBps": round(statistics.median(results["kvtier-fs"][what]), 2),
                    "kvtier_over_vllm": round(statistics.median(ratios), 2),
                    "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)],
                }
            )
    return rows


def flipped_byte(kind: str, root: str) -> str:
    buffer = Buffer(4, 256 * 1024)
    chunk_keys = keys(4, tag=b"flip")
    tier = build(kind, buffer.view, root, 2)
    transfer(tier, chunk_keys, load=False, job_chunks=4)
    tier.drain_jobs()
    files = sorted(
        str(p) for p in Path(root).rglob("*") if p.is_file() and p.stat().st_size >= 256 * 1024
    )
    with open(files[0], "r+b") as handle:  # one chunk file: flip a byte in its payload
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0x01]))
    drop_caches(root)
    buffer.array[:] = 0
    _, failed = transfer(tier, chunk_keys, load=True, job_chunks=4)
    wrong = buffer.wrong_rows() - failed  # rows a failed load left zeroed are not served
    tier.shutdown()
    if wrong > 0:
        return f"served {wrong} chunk(s) with the flipped byte"
    return f"{failed} chunk(s) refused; no wrong byte served"


def restart(kind: str, root: str) -> str:
    buffer = Buffer(4, 256 * 1024)
    chunk_keys = keys(4, tag=b"restart")
    tier = build(kind, buffer.view, root, 2)
    transfer(tier, chunk_keys, load=False, job_chunks=4)
    tier.shutdown()
    buffer.array[:] = 0
    again = build(kind, buffer.view, root, 2)
    found = lookups(again, chunk_keys)
    _, failed = transfer(again, chunk_keys, load=True, job_chunks=4)
    again.shutdown()
    return f"{found.count('HIT')}/4 found, {4 - failed - buffer.wrong_rows()}/4 loaded exact"


def full_disk(kind: str, root: str) -> str:
    """Stores into a 4 MiB filesystem: what fails, and whether the tier still serves."""
    mount = os.path.join(root, "small")
    os.makedirs(mount)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount]).returncode:
        return "not measured (cannot mount a small tmpfs here)"
    try:
        buffer = Buffer(32, 256 * 1024)
        chunk_keys = keys(32, tag=b"full")
        tier = build(kind, buffer.view, mount, 2)
        _, failed = transfer(tier, chunk_keys, load=False, job_chunks=8)
        buffer.array[:] = 0
        found = lookups(tier, chunk_keys)
        hits = [key for key, answer in zip(chunk_keys, found, strict=True) if answer == "HIT"]
        slots = [chunk_keys.index(key) for key in hits]
        _, failed_loads = transfer(tier, hits, load=True, job_chunks=8) if hits else (0.0, 0)
        # Hit ``i`` was loaded into slot ``i``; it was stored from slot ``slots[i]``.
        wrong = (
            sum(
                xxhash.xxh3_64_digest(buffer.array[i].data) != buffer.digests[slot]
                for i, slot in enumerate(slots)
            )
            - failed_loads
        )
        tier.shutdown()
        return f"{failed}/32 stores failed, {len(hits)} found, {wrong} wrong after load"
    finally:
        subprocess.run(["umount", "-l", mount])


def two_processes(kind: str, root: str) -> str:
    """Another process stores chunks on the same root; this one finds and loads them."""
    here = str(Path(__file__).parent)
    script = (
        f"import sys; sys.path.insert(0, {here!r}); import bench_vllm_tiering as b; "
        f"buf = b.Buffer(8, 256*1024); t = b.build({kind!r}, buf.view, {root!r}, 2); "
        "b.transfer(t, b.keys(8, tag=b'other'), load=False, job_chunks=8); t.shutdown()"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    buffer = Buffer(8, 256 * 1024)
    chunk_keys = keys(8, tag=b"other")
    buffer.array[:] = 0
    tier = build(kind, buffer.view, root, 2)
    found = lookups(tier, chunk_keys)
    _, failed = transfer(tier, chunk_keys, load=True, job_chunks=8)
    tier.shutdown()
    return f"{found.count('HIT')}/8 found, {8 - failed - buffer.wrong_rows()}/8 loaded exact"


def faults(args: argparse.Namespace) -> list[dict[str, str]]:
    rows = []
    for name, case in (
        ("a flipped byte", flipped_byte),
        ("restart", restart),
        ("two processes, one root", two_processes),
        ("full disk", full_disk),
    ):
        row = {"case": name}
        for kind in TIERS:
            root = tempfile.mkdtemp(prefix=f"{kind}-", dir=args.root)
            try:
                row[kind] = case(kind, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", default=None, help="directory on the disk to measure (default: a temp dir)"
    )
    parser.add_argument(
        "--volume", type=int, default=512 * MiB, help="bytes stored and loaded per round"
    )
    parser.add_argument("--chunk-bytes", type=int, nargs="+", default=[256 * 1024, 2 * MiB])
    parser.add_argument(
        "--threads",
        type=int,
        default=4,
        help="vLLM's read and write threads each; kvtier gets both",
    )
    parser.add_argument(
        "--job-chunks", type=int, default=32, help="chunks per job, as vLLM batches them"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small volume, two runs: seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.volume, args.runs = 16 * MiB, 2
    args.root = args.root or tempfile.mkdtemp(prefix="kvtier-bench-vllm-tiering-")
    report: dict[str, Any] = {"speed": speed(args), "faults": faults(args)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("| chunk | | vLLM fs GB/s | kvtier fs GB/s | kvtier ÷ vLLM (range) |")
    print("|---|---|---|---|---|")
    for row in report["speed"]:
        low, high = row["ratio_range"]
        print(
            f"| {row['chunk_KiB']} KiB | {row['what']} | {row['vllm_fs_GBps']} | "
            f"{row['kvtier_fs_GBps']} | {row['kvtier_over_vllm']}× ({low}–{high}) |"
        )
    print()
    print("| case | vLLM fs | kvtier fs |")
    print("|---|---|---|")
    for row in report["faults"]:
        print(f"| {row['case']} | {row['vllm-fs']} | {row['kvtier-fs']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
