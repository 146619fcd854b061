"""kvtier's ``fs`` and ``redis`` tiers against the peers' own storage layers, in one run.

Every system stores the same chunks (deterministic bytes from each round's
seed), then loads them back, and every loaded byte is checked. The systems:

* ``raw-odirect``: the disk's floor for a file per chunk written from
  Python: ``--threads`` threads, ``O_DIRECT`` ``pwrite`` / ``preadv``, no
  checksum, trailer or rename;
* ``raw-redis``: the same server's floor for a Python client: redis-py
  ``SET`` / ``GET`` pipelines on ``--redis-threads`` threads, bytes as they are;
* ``kvtier-fs``, ``kvtier-redis``: kvtier's tiers (checksums on), one
  transfer job per ``--job-chunks`` chunks, ``io_threads`` = ``--threads``
  for ``fs`` and ``--redis-threads`` for ``redis`` (by default the redis
  tier's own default: more threads only contend for the interpreter while
  the server's single thread is the limit);
* ``lmcache-disk``, ``lmcache-disk-odirect``, ``lmcache-redis``: LMCache
  0.5.6's ``StorageManager`` over ``LocalDiskBackend`` (without and with
  ``use_odirect``; ``disk_io_threads = --threads``) and over its redis
  ``RemoteBackend`` (an asyncio loop, a connection per chunk in flight);
* ``aibrix-shfs``, ``aibrix-rocksdb``: AIBrix KV cache 0.8.0's ``SHFS`` and
  ``ROCKSDB`` L2 connectors (an executor of ``--threads`` threads);
* ``sglang-file``: SGLang 0.5.23's ``HiCacheFile`` (synchronous, one thread).

Each peer runs in its own environment (``scripts/peer-envs.sh`` builds
``.venv-lmcache``, ``.venv-aibrix`` and ``.venv-sglang``; they pin conflicting
packages) through a driver in ``benchmarks/peers/``; a peer whose
environment is missing is skipped and the reason printed. The ``fs`` systems
get a fresh directory under ``--root`` per round; their store is timed up to
``os.sync()`` (what writes through the page cache pays to reach the disk) and
the page cache is dropped before the load; removing a round's directory is
followed by a sync and a cache drop too (see ``bench_fs.py``: on ext4 without
a journal the next writer would otherwise pay for the files just deleted).
Thread pools and kvtier's workers are running before the clock starts. The redis systems share one
``redis-server`` started on loopback, emptied between rounds. Rounds
interleave the systems, each round starting with the next one in turn.

Figures are GB/s (1e9 bytes/s). ``kvtier / peer`` is the median over rounds
of the peer's seconds over kvtier's in the same round (``kvtier-fs`` against
the file peers and ``raw-odirect``, ``kvtier-redis`` against ``raw-redis`` and
the redis peer).

    python benchmarks/bench_peers.py --root /mnt/nvme/bench --volume 256MiB --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_fs import (  # beside this script
    add_workload_options,
    build_tier,
    clear_directory,
    parse_size,
    run_jobs,
    start_workers,
    started_pool,
)
from bench_shared_tiers import RawRedis, in_parallel
from peers.common import chunk_payloads, run_round

from kvtier.primary import SlotBuffer
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.redis import RedisTierOptions

# kvtier's loopback redis test fixture (bench_shared_tiers puts the checkout on sys.path).
from tests.support.servers import RedisServer  # isort: skip

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(__file__).resolve().parent / "peers"
CHUNK_TOKENS = 256


@dataclass(frozen=True)
class PeerSystem:
    """A peer's system: the driver that runs it and the environment it needs."""

    driver: str
    env: str


PEER_SYSTEMS = {
    "lmcache-disk": PeerSystem("lmcache_driver.py", ".venv-lmcache"),
    "lmcache-disk-odirect": PeerSystem("lmcache_driver.py", ".venv-lmcache"),
    "lmcache-redis": PeerSystem("lmcache_driver.py", ".venv-lmcache"),
    "aibrix-shfs": PeerSystem("aibrix_driver.py", ".venv-aibrix"),
    "aibrix-rocksdb": PeerSystem("aibrix_driver.py", ".venv-aibrix"),
    "sglang-file": PeerSystem("sglang_driver.py", ".venv-sglang"),
}
LOCAL_SYSTEMS = ("raw-odirect", "kvtier-fs", "raw-redis", "kvtier-redis")
SYSTEMS = LOCAL_SYSTEMS + tuple(PEER_SYSTEMS)
#: The kvtier system each system is compared with.
BASELINE = {name: "kvtier-redis" if name.endswith("redis") else "kvtier-fs" for name in SYSTEMS}


# The systems run in this process ----------------------------------------------


class RawDirect:
    """A file per chunk, O_DIRECT writes and reads on a thread pool: the disk's floor."""

    def __init__(self, chunk: int, count: int, threads: int) -> None:
        self.chunk, self.count, self.threads = chunk, count, threads
        # Stored from the first half, loaded into the second.
        self.buffer = SlotBuffer(2 * count, chunk)

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        os.makedirs(directory)
        self.paths = [os.path.join(directory, f"{i:06d}") for i in range(self.count)]
        for row, payload in zip(self.buffer.array[: self.count], payloads, strict=True):
            row[:] = memoryview(payload)
        self.pool = started_pool(self.threads)

    def _each(self, move: Any) -> None:
        list(self.pool.map(move, range(self.count)))

    def store(self) -> None:
        rows = self.buffer.array

        def write(i: int) -> None:
            fd = os.open(self.paths[i], os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                if os.pwrite(fd, rows[i], 0) != self.chunk:
                    raise OSError(f"short write of {self.paths[i]}")
            finally:
                os.close(fd)

        self._each(write)

    def load(self) -> Sequence[Any]:
        rows = self.buffer.array

        def read(i: int) -> None:
            fd = os.open(self.paths[i], os.O_RDONLY | os.O_DIRECT)
            try:
                if os.preadv(fd, [rows[self.count + i]], 0) != self.chunk:
                    raise OSError(f"short read of {self.paths[i]}")
            finally:
                os.close(fd)

        self._each(read)
        return list(self.buffer.array[self.count :])

    def clear(self) -> None:
        self.pool.shutdown()
        self.buffer.array[self.count :] = 0

    def close(self) -> None:
        self.buffer.close()


class RawRedisClient:
    """redis-py alone, as kvtier's redis tier uses it (``--threads`` threads, each
    pipelining as many commands as the tier): SETs of each chunk's bytes,
    GETs of them, no framing, checksum or copy into a buffer: the ceiling
    for a Python client of this server."""

    def __init__(self, url: str, threads: int) -> None:
        self.raw = RawRedis(url, threads)

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        self.values = payloads
        self.names = [f"raw:{i}" for i in range(len(payloads))]

    def store(self) -> None:
        self.raw.store(self.names, list(self.values))

    def load(self) -> Sequence[Any]:
        loaded: list[Any] = [None] * len(self.names)
        batch = self.raw.batch  # as the store pipelined

        def work(share: list[int]) -> None:
            for start in range(0, len(share), batch):
                pipe = self.raw.client.pipeline(transaction=False)
                for index in share[start : start + batch]:
                    pipe.get(self.names[index])
                for index, value in zip(share[start : start + batch], pipe.execute(), strict=True):
                    loaded[index] = value

        in_parallel(self.raw.threads, list(range(len(self.names))), work)
        return loaded

    def clear(self) -> None:
        self.values = []

    def close(self) -> None:
        self.raw.client.close()


class KVTierTier:
    """A kvtier tier over its own primary buffer: stored from one half, loaded into the other."""

    def __init__(
        self, tier_config: dict[str, Any], chunk: int, count: int, job_chunks: int
    ) -> None:
        self.tier_config, self.chunk, self.count, self.job_chunks = (
            tier_config,
            chunk,
            count,
            job_chunks,
        )
        self.buffer = SlotBuffer(2 * count, chunk)
        self.tier: SecondaryTier | None = None
        self.round = 0

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        if self.tier is None:
            entry = dict(self.tier_config, **({"root_dir": directory} if directory else {}))
            self.tier = build_tier(entry, self.buffer)
        if isinstance(self.tier, FilesystemTier):
            self.tier.wait_index(30)
        start_workers(self.tier)
        self.round += 1
        self.keys = [
            hashlib.blake2b(f"{self.round}:{i}".encode(), digest_size=32).digest()
            for i in range(self.count)
        ]
        for row, payload in zip(self.buffer.array[: self.count], payloads, strict=True):
            row[:] = memoryview(payload)

    def store(self) -> None:
        assert self.tier is not None
        run_jobs(self.tier, self.keys, self.job_chunks, loading=False)

    def load(self) -> Sequence[Any]:
        assert self.tier is not None
        run_jobs(self.tier, self.keys, self.job_chunks, loading=True, first_slot=self.count)
        return list(self.buffer.array[self.count :])

    def clear(self) -> None:
        assert self.tier is not None
        if self.tier_config["type"] == "fs":
            # A fresh directory each round. A redis tier lives on, as the
            # raw client and the peer's backend do: its connections, threads
            # and framing buffers are made once, not once a round.
            self.tier.shutdown()
            self.tier = None
        self.buffer.array[self.count :] = 0

    def close(self) -> None:
        if self.tier is not None:
            self.tier.shutdown()
        self.buffer.close()


# The peers, each in its own environment --------------------------------------


class PeerProcess:
    """A peer's driver in its own interpreter, one round per request (see peers/common.py)."""

    def __init__(self, system: str, python: Path, args: list[str]) -> None:
        self.system = system
        script = PEERS / PEER_SYSTEMS[system].driver
        # The peers log a lot: into a file, which never blocks them as a full pipe would.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.process = subprocess.Popen(
            [str(python), str(script), "--system", system, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self._answer()  # ready

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        answer: dict[str, Any] = json.loads(line) if line else {}
        if "error" in answer or not line:
            self.process.kill()
            self.log.seek(0)
            log = self.log.read()[-4000:]
            raise SystemExit(f"{self.system}: {answer.get('error', 'driver exited')}\n{log}")
        return answer

    def round(self, directory: str, seed: int, chunk: int, count: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        command = {"dir": directory, "seed": seed, "chunk": chunk, "count": count}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def peer_python(system: str, envs: Path) -> Path | str:
    """The peer's interpreter, or why it cannot run."""
    python = envs / PEER_SYSTEMS[system].env / "bin" / "python"
    if not python.exists():
        return f"{python.parent.parent} is missing: build it with scripts/peer-envs.sh"
    return python


# The run ------------------------------------------------------------------------


def start_peers(
    args: argparse.Namespace, redis_url: str, skipped: dict[str, str], stack: ExitStack
) -> dict[str, PeerProcess]:
    """A driver for each peer system asked for whose environment is there, for the whole run."""
    peers = {}
    for name in args.systems:
        if name not in PEER_SYSTEMS:
            continue
        python = peer_python(name, args.peer_envs)
        if isinstance(python, str):
            skipped[name] = python
            continue
        options = ["--threads", str(args.threads), "--redis-url", redis_url]
        peers[name] = stack.enter_context(closing(PeerProcess(name, python, options)))
    return peers


def local_systems(
    chunk: int, count: int, args: argparse.Namespace, redis_url: str, stack: ExitStack
) -> dict[str, InProcess]:
    """The systems of this process asked for, with buffers for one chunk size."""
    build: dict[str, Any] = {
        "raw-odirect": lambda: RawDirect(chunk, count, args.threads),
        "raw-redis": lambda: RawRedisClient(redis_url, args.redis_threads),
        "kvtier-fs": lambda: KVTierTier(
            {"type": "fs", "io_threads": args.threads}, chunk, count, args.job_chunks
        ),
        "kvtier-redis": lambda: KVTierTier(
            {"type": "redis", "url": redis_url, "io_threads": args.redis_threads, "deadline_s": 60},
            chunk,
            count,
            args.job_chunks,
        ),
    }
    return {
        name: InProcess(name, stack.enter_context(closing(build[name]())))
        for name in args.systems
        if name in build
    }


class InProcess:
    """A system of this process, answering rounds as a peer's driver does."""

    def __init__(self, name: str, system: Any) -> None:
        self.name, self.system = name, system

    def round(self, directory: str, seed: int, chunk: int, count: int) -> dict[str, Any]:
        payloads = chunk_payloads(seed, count, chunk)
        return run_round(self.system, self.name, directory, payloads)


def is_redis(name: str) -> bool:
    return name.endswith("redis")


def measure(
    chunk: int, args: argparse.Namespace, redis: RedisServer, peers: dict[str, PeerProcess]
) -> dict[str, list[dict[str, Any]]]:
    count = max(1, args.volume // chunk)
    with ExitStack() as stack:
        local = local_systems(chunk, count, args, redis.url, stack)
        runners = {
            name: local.get(name) or peers[name]
            for name in args.systems
            if name in local or name in peers
        }
        names = list(runners)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for index in range(args.rounds):
            seed = chunk * 1000 + index
            base = args.root / f"{chunk}-{index}"
            for name in names[index % len(names) :] + names[: index % len(names)]:
                directory = "" if is_redis(name) else str(base / name)
                if directory:
                    clear_directory(Path(directory), args.root)
                runs[name].append(runners[name].round(directory, seed, chunk, count))
                if is_redis(name):
                    redis.command("FLUSHALL")
            shutil.rmtree(base, ignore_errors=True)
    return runs


def summarise(chunk: int, volume: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, rounds in runs.items():
        store = [volume / r["store_s"] / 1e9 for r in rounds]
        load = [volume / r["load_s"] / 1e9 for r in rounds]
        row: dict[str, Any] = {
            "verified_chunks": [r["verified"] for r in rounds],
            "cold": rounds[0]["cold"],
            "store_gbps": [round(x, 3) for x in store],
            "load_gbps": [round(x, 3) for x in load],
            "store_median": round(statistics.median(store), 3),
            "load_median": round(statistics.median(load), 3),
        }
        baseline = BASELINE[name]
        if name != baseline and runs.get(baseline):
            # Paired: each round's figures divided, then the median over rounds,
            # so that a slow spell of the shared machine hits both sides.
            row["kvtier_vs"] = {
                "baseline": baseline,
                **{
                    phase: round(
                        statistics.median(
                            theirs[f"{phase}_s"] / ours[f"{phase}_s"]
                            for ours, theirs in zip(runs[baseline], rounds, strict=True)
                        ),
                        3,
                    )
                    for phase in ("store", "load")
                },
            }
        summary[name] = row
    return summary


def print_table(chunk: int, count: int, summary: dict[str, Any], out: Any) -> None:
    print(f"\n{count} chunks of {chunk // 1024} KiB per round", file=out)
    print(
        f"{'system':21} {'store GB/s':>20} {'load GB/s':>20} {'kvtier/it store':>16} {'load':>6}",
        file=out,
    )
    for name, row in summary.items():
        store, load = row["store_gbps"], row["load_gbps"]
        ratio = row.get("kvtier_vs")
        ratios = f"{ratio['store']:>15.2f}x {ratio['load']:>5.2f}x" if ratio else ""
        print(
            f"{name:21} {row['store_median']:6.2f} ({min(store):.2f}-{max(store):.2f})"
            f"   {row['load_median']:6.2f} ({min(load):.2f}-{max(load):.2f})   {ratios}",
            file=out,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_options(
        parser,
        root_help="Directory on the filesystem to measure (a fresh one per round, removed after).",
        volume="256MiB",
        threads=16,
        threads_help="I/O threads of every system that has them.",
    )
    parser.add_argument(
        "--redis-threads",
        type=int,
        default=RedisTierOptions.model_fields["io_threads"].default,
        help="Threads of raw-redis and of kvtier's redis tier (default: the tier's own).",
    )
    parser.add_argument(
        "--job-chunks", type=int, default=16, help="Chunks per kvtier transfer job."
    )
    parser.add_argument(
        "--systems",
        type=lambda text: text.split(","),
        default=list(SYSTEMS),
        help=f"Comma-separated subset of: {','.join(SYSTEMS)}.",
    )
    parser.add_argument(
        "--peer-envs",
        type=Path,
        default=ROOT,
        help="Directory holding the peers' .venv-* environments.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="A tiny volume, one round: checks the drivers."
    )
    parser.add_argument(
        "--json", action="store_true", help="Print the report as JSON (the table goes to stderr)."
    )
    args = parser.parse_args()
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; expected some of {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.quick:
        args.volume, args.rounds = parse_size("4MiB"), 1
    chunks = args.chunk or [parse_size("2MiB"), parse_size("256KiB")]

    table = sys.stderr if args.json else sys.stdout
    load = os.getloadavg()
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "volume": args.volume,
        "rounds": args.rounds,
        "threads": args.threads,
        "load_average": [round(x, 2) for x in load],
        "skipped": {},
        "sizes": {},
    }
    started = time.monotonic()
    for chunk in chunks:
        if chunk % 4096:
            parser.error(f"chunk size {chunk} is not a multiple of 4096 (O_DIRECT's alignment)")
    with RedisServer() as redis, ExitStack() as stack:
        peers = start_peers(args, redis.url, report["skipped"], stack)
        for chunk in chunks:
            runs = measure(chunk, args, redis, peers)
            summary = summarise(chunk, max(1, args.volume // chunk) * chunk, runs)
            report["sizes"][str(chunk)] = summary
            print_table(chunk, max(1, args.volume // chunk), summary, table)
    for name, reason in report["skipped"].items():
        print(f"skipped {name}: {reason}", file=table)
    report["seconds"] = round(time.monotonic() - started, 1)
    print(f"load average before: {load[0]:.2f} (1 min); took {report['seconds']} s", file=table)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
