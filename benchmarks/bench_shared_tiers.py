"""Store and load throughput of the shared tiers against their raw client, in one run.

For each tier (``redis``, ``obj``) and chunk size, the same volume is written
and read twice against the same freshly started server on loopback:

* raw: the client library alone (redis-py pipelines / boto3 requests), with
  the tier's own concurrency (``io_threads`` threads; for Redis each thread
  pipelines as many commands at a time), sending each chunk's bytes as
  they are and reading replies without copying them anywhere: no framing, no
  checksums;
* tier: one kvtier store job and one load job of every chunk, through the
  tier's workers, with framing, verification and copies into primary slots.

It reports MiB/s of each and the ratio tier / raw (target: at least 0.8),
taking the best of ``--repeat`` rounds for each, and the median of the per-round
ratios. Run::

    python benchmarks/bench_shared_tiers.py [--tiers redis,obj] [--sizes 2MiB,256KiB]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter

from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.base import JobResult, SecondaryTier, TransferJob
from kvtier.tiers.redis import RedisBackend

# The loopback servers are kvtier's test fixtures (tests/support/servers.py), not part
# of the installed package: import them from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import RedisServer, S3Server

MiB = 1 << 20


@dataclass
class Result:
    tier: str
    chunk_bytes: int
    chunks: int
    raw_store_mib_s: float
    tier_store_mib_s: float
    raw_load_mib_s: float
    tier_load_mib_s: float
    #: Median over rounds of tier / raw within the round (adjacent in time,
    #: so less swayed by a busy machine than the ratio of the bests).
    store_ratio_paired: float
    load_ratio_paired: float
    #: Client-side CPU seconds per GiB moved, over all rounds.
    cpu_s_per_gib: dict[str, float]

    @property
    def store_ratio(self) -> float:
        return self.tier_store_mib_s / self.raw_store_mib_s

    @property
    def load_ratio(self) -> float:
        return self.tier_load_mib_s / self.raw_load_mib_s


def layout_for(chunk_bytes: int) -> Any:
    # small_layout: 2 layers x (K, V) x 2 heads x head_dim x tokens x 2 bytes.
    head_dim = 128
    tokens, rest = divmod(chunk_bytes, 16 * head_dim)
    if rest or tokens == 0:
        raise SystemExit(f"chunk size {chunk_bytes} is not a multiple of {16 * head_dim}")
    return small_layout(chunk_tokens=tokens, head_dim=head_dim)


def timed(action: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start


class CpuClock:
    """CPU seconds this process (client threads and tier workers) spent per phase.

    The servers run in other processes, so this is the client side's cost, and,
    unlike wall time, barely moved by other work on a busy machine.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.process_time()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.process_time() - start


def in_parallel(threads: int, items: list[Any], work: Callable[[list[Any]], None]) -> None:
    """Split ``items`` into ``threads`` even shares and run ``work`` on each at once."""
    shares = [items[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(work, share) for share in shares if share]:
            future.result()


# Raw baselines ------------------------------------------------------------------


class RawRedis:
    """redis-py pipelines of as many chunks as the tier pipelines (see
    ``RedisBackend.batch_chunks``; a load pipelines as the last store did)."""

    def __init__(self, url: str, threads: int) -> None:
        import redis
        from redis._parsers.encoders import Encoder
        from redis.connection import PythonRespSerializer

        # redis-py's Python packer, which sends large values as they are, as
        # kvtier's redis tier does (redis-py's hiredis packer copies each
        # twice); replies parsed by hiredis where it is installed.
        packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        pool = redis.BlockingConnectionPool.from_url(url, command_packer=packer)
        self.client = redis.Redis(connection_pool=pool)
        self.threads, self.batch = threads, RedisBackend.io_batch

    def store(self, names: list[str], values: list[Any]) -> None:
        self.batch = RedisBackend.batch_chunks(len(values[0]) if values else 1)

        def work(share: list[tuple[str, Any]]) -> None:
            for start in range(0, len(share), self.batch):
                pipe = self.client.pipeline(transaction=False)
                for name, value in share[start : start + self.batch]:
                    pipe.set(name, value)
                pipe.execute()

        in_parallel(self.threads, list(zip(names, values, strict=True)), work)

    def load(self, names: list[str]) -> None:
        def work(share: list[str]) -> None:
            for start in range(0, len(share), self.batch):
                pipe = self.client.pipeline(transaction=False)
                for name in share[start : start + self.batch]:
                    pipe.get(name)
                if any(v is None for v in pipe.execute()):
                    raise RuntimeError("raw redis load missed a value")

        in_parallel(self.threads, names, work)


class RawS3:
    def __init__(self, server: S3Server, bucket: str, threads: int) -> None:
        from botocore.config import Config

        self.client = server.client(
            Config(
                max_pool_connections=threads,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
        )
        self.bucket, self.threads = bucket, threads

    def store(self, names: list[str], values: list[Any]) -> None:
        def work(share: list[tuple[str, Any]]) -> None:
            for name, value in share:
                self.client.put_object(Bucket=self.bucket, Key=name, Body=value)

        in_parallel(self.threads, list(zip(names, values, strict=True)), work)

    def load(self, names: list[str]) -> None:
        def work(share: list[str]) -> None:
            for name in share:
                self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()

        in_parallel(self.threads, names, work)


def run(tier: SecondaryTier, keys: list[ChunkKey], slots: list[int], *, loading: bool) -> JobResult:
    """One job, waited for by ``drain`` (as an engine would between steps), not by polling."""
    job = TransferJob(tuple(keys), tuple(slots))
    (tier.submit_load if loading else tier.submit_store)(job)
    tier.drain()
    [result] = tier.get_finished_jobs()
    return result


# One measurement ------------------------------------------------------------------


def measure(
    tier_name: str,
    tier_config: dict[str, Any],
    raw: RawRedis | RawS3,
    chunk_bytes: int,
    chunks: int,
    repeat: int,
) -> Result:
    layout = layout_for(chunk_bytes)
    harness = TierHarness(tier_config, layout, num_slots=chunks)
    rates: dict[str, list[float]] = {k: [] for k in ("raw_s", "tier_s", "raw_l", "tier_l")}
    volume = chunks * chunk_bytes / MiB
    cpu = CpuClock()
    try:
        harness.fill(range(chunks))
        slots = list(range(chunks))
        # Each chunk's own bytes, ready before the clock starts: redis-py sends
        # a slot's memoryview as it is; boto3 takes only bytes-like objects it
        # knows, so its chunks are copied out first.
        values = (
            [harness.tier.slot(i) for i in slots]
            if isinstance(raw, RawRedis)
            else [bytearray(harness.tier.slot(i)) for i in slots]
        )
        for _ in range(repeat):
            round_id = uuid.uuid4().hex[:8]
            names = [f"raw:{round_id}:{i}" for i in range(chunks)]
            keys = harness.keys(chunks)
            with cpu.phase("raw_s"):
                rates["raw_s"].append(volume / timed(raw.store, names, values))
            with cpu.phase("tier_s"):
                stored = run(harness.tier, keys, slots, loading=False)
            if not stored.success:
                raise RuntimeError(f"{tier_name}: store job failed")
            rates["tier_s"].append(volume / stored.seconds)
            with cpu.phase("raw_l"):
                rates["raw_l"].append(volume / timed(raw.load, names))
            with cpu.phase("tier_l"):
                loaded = run(harness.tier, keys, slots, loading=True)
            if not loaded.success:
                raise RuntimeError(f"{tier_name}: load job failed")
            rates["tier_l"].append(volume / loaded.seconds)
    finally:
        harness.close()
    best = {k: max(v) for k, v in rates.items()}
    rounds = {k: [round(x) for x in v] for k, v in rates.items()}
    print(f"  {tier_name} {chunk_bytes // 1024} KiB, MiB/s per round: {rounds}", file=sys.stderr)
    return Result(
        tier_name,
        chunk_bytes,
        chunks,
        best["raw_s"],
        best["tier_s"],
        best["raw_l"],
        best["tier_l"],
        statistics.median(t / r for t, r in zip(rates["tier_s"], rates["raw_s"], strict=True)),
        statistics.median(t / r for t, r in zip(rates["tier_l"], rates["raw_l"], strict=True)),
        {k: v / (volume * repeat / 1024) for k, v in cpu.seconds.items()},
    )


#: Starts a server; yields the tier config, the raw client and a way to empty it.
Setup = Callable[
    [int], AbstractContextManager[tuple[dict[str, Any], "RawRedis | RawS3", Callable[[], object]]]
]


#: A bench job moves far more than one request's chunks: let it finish, so
#: the rate measured is the tier's, not its per-request deadline's.
WHOLE_JOBS = {"deadline_s": 60}


@contextmanager
def redis_setup(threads: int) -> Iterator[tuple[dict[str, Any], RawRedis, Callable[[], object]]]:
    with RedisServer() as server:
        config = {"type": "redis", "url": server.url, "io_threads": threads, **WHOLE_JOBS}
        raw = RawRedis(server.url, threads)
        yield config, raw, lambda: raw.client.flushall()


@contextmanager
def obj_setup(threads: int) -> Iterator[tuple[dict[str, Any], RawS3, Callable[[], None]]]:
    with S3Server() as server:
        bucket = server.create_bucket("kvtier-bench")
        config = {"type": "obj", **server.tier_options(bucket), "io_threads": threads, **WHOLE_JOBS}
        raw = RawS3(server, bucket, threads)

        def clear() -> None:
            listing = raw.client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for page in listing:
                for item in page.get("Contents", []):
                    raw.client.delete_object(Bucket=bucket, Key=item["Key"])

        yield config, raw, clear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="redis,obj")
    parser.add_argument("--sizes", default="2MiB,256KiB")
    parser.add_argument("--redis-volume", default="256MiB", help="bytes moved per round")
    parser.add_argument("--obj-volume", default="64MiB", help="bytes moved per round")
    parser.add_argument("--redis-threads", type=int, default=4)
    parser.add_argument("--obj-threads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    size = TypeAdapter(ByteSize)
    setups: dict[str, tuple[Setup, int, int]] = {
        "redis": (redis_setup, args.redis_threads, int(size.validate_python(args.redis_volume))),
        "obj": (obj_setup, args.obj_threads, int(size.validate_python(args.obj_volume))),
    }
    results: list[Result] = []
    for tier_name in args.tiers.split(","):
        setup, threads, volume = setups[tier_name]
        with setup(threads) as (config, raw, clear):
            for text in args.sizes.split(","):
                chunk_bytes = int(size.validate_python(text))
                chunks = max(1, volume // chunk_bytes)
                results.append(measure(tier_name, config, raw, chunk_bytes, chunks, args.repeat))
                clear()
    print("best of rounds in MiB/s; ratio = tier / raw (best), paired = median per-round ratio")
    print(
        f"{'tier':6} {'chunk':>8} {'chunks':>6} {'raw store':>10} {'tier store':>10} "
        f"{'ratio':>6} {'paired':>6} {'raw load':>10} {'tier load':>10} {'ratio':>6} {'paired':>6}"
    )
    for r in results:
        print(
            f"{r.tier:6} {r.chunk_bytes // 1024:>5}KiB {r.chunks:>6} "
            f"{r.raw_store_mib_s:>10.0f} {r.tier_store_mib_s:>10.0f} {r.store_ratio:>6.2f} "
            f"{r.store_ratio_paired:>6.2f} "
            f"{r.raw_load_mib_s:>10.0f} {r.tier_load_mib_s:>10.0f} {r.load_ratio:>6.2f} "
            f"{r.load_ratio_paired:>6.2f}"
        )
    print("client CPU seconds per GiB moved (this process: client threads, tier workers)")
    print(
        f"{'tier':6} {'chunk':>8} {'raw store':>10} {'tier store':>10} {'raw load':>10} "
        f"{'tier load':>10}"
    )
    for r in results:
        c = r.cpu_s_per_gib
        print(
            f"{r.tier:6} {r.chunk_bytes // 1024:>5}KiB {c['raw_s']:>10.2f} {c['tier_s']:>10.2f} "
            f"{c['raw_l']:>10.2f} {c['tier_l']:>10.2f}"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                [
                    {**asdict(r), "store_ratio": r.store_ratio, "load_ratio": r.load_ratio}
                    for r in results
                ],
                file,
                indent=2,
            )


if __name__ == "__main__":
    main()
