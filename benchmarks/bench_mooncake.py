"""Store and load throughput of the ``mooncake`` tier against the raw Mooncake client.

One ``mooncake_master`` on loopback with a storage process lending the pool
its memory (so values cross a process boundary, as in a cluster). For each
chunk size, in the same run, the same number of values of the same size,
under names of the same length, are written and read by:

* raw: ``MooncakeDistributedStore`` alone, driven the way the tier drives
  it: ``io_threads`` threads pulling batches of ``io_batch`` values from one
  queue, each thread moving them with ``batch_put_from`` /
  ``batch_get_into`` from a buffer it registered once; the bytes as they
  are, no framing, no checksum, no copy;
* tier: one kvtier store job and one load job of every chunk through the
  tier's workers, with framing, verification and the copies between its
  registered buffers and the primary slots.

Rounds interleave the two (raw then tier, tier then raw, ...: whoever goes
first pays for a cold pool), so that the machine's noise hits both; the first
``--warmup`` rounds are not counted. Each round uses fresh names and removes
them after, so every put writes. Reported per size and direction: MiB/s of
each (median of the rounds), the tier / raw ratio of each round (median and
range; target: at least 0.8), and the CPU seconds this process spent per GiB
on each side. Run::

    python benchmarks/bench_mooncake.py [--sizes 2MiB,256KiB] [--volume 64MiB] [--repeat 24]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from pydantic import ByteSize, TypeAdapter

from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.base import TransferJob
from kvtier.tiers.mooncake import MooncakeTier

# The loopback servers are kvtier's test fixtures (tests/support/servers.py), not part
# of the installed package: import them from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import MooncakeMaster

MiB = 1 << 20
PHASES = ("raw_store", "tier_store", "raw_load", "tier_load")


@dataclass
class Direction:
    """One direction (stores or loads) at one chunk size, over the counted rounds."""

    raw_mib_s: float
    tier_mib_s: float
    #: tier / raw throughput of each round: the median, and the lowest and highest.
    ratio_median: float
    ratio_min: float
    ratio_max: float
    #: CPU seconds of this process (client threads, tier workers, Mooncake's
    #: own threads, which poll while a transfer runs) per GiB moved.
    raw_cpu_s_per_gib: float
    tier_cpu_s_per_gib: float


@dataclass
class Result:
    chunk_bytes: int
    chunks: int
    rounds: int
    store: Direction
    load: Direction


def layout_for(chunk_bytes: int) -> KVLayout:
    # small_layout: 2 layers x (K, V) x 2 heads x head_dim x tokens x 2 bytes.
    head_dim = 128
    tokens, rest = divmod(chunk_bytes, 16 * head_dim)
    if rest or tokens == 0:
        raise SystemExit(f"chunk size {chunk_bytes} is not a multiple of {16 * head_dim}")
    return small_layout(chunk_tokens=tokens, head_dim=head_dim)


class RawMooncake:
    """The bare client, driven like the tier drives it (see the module docstring)."""

    def __init__(self, master: MooncakeMaster, threads: int, batch: int, value_bytes: int):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        code = self.store.setup(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "0",
                "local_buffer_size": str(16 * MiB),
                "protocol": "tcp",
                "rdma_devices": "",
                "master_server_addr": master.address,
            }
        )
        if code != 0:
            raise SystemExit(f"raw client setup failed: {code}")
        self.batch, self.value_bytes = batch, value_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-mooncake")
        self.local = threading.local()
        self.registered: list[tuple[mmap.mmap, int]] = []
        self.lock = threading.Lock()

    def _buffer(self) -> int:
        """This thread's registered buffer (one batch of values), registered on first use."""
        address: int | None = getattr(self.local, "address", None)
        if address is None:
            mapping = mmap.mmap(-1, self.batch * self.value_bytes)
            mapping.write(os.urandom(len(mapping)))
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            if self.store.register_buffer(address, len(mapping)) != 0:
                raise SystemExit("raw client could not register its buffer")
            with self.lock:
                self.registered.append((mapping, address))
            self.local.address = address
        return address

    def _batches(self, names: list[str], call: Callable[..., list[int]]) -> None:
        def move(batch: list[str]) -> None:
            address = self._buffer()
            pointers = [address + i * self.value_bytes for i in range(len(batch))]
            codes = call(batch, pointers, [self.value_bytes] * len(batch))
            if any(code < 0 for code in codes):
                raise RuntimeError(f"raw mooncake call failed: {codes}")

        batches = [names[i : i + self.batch] for i in range(0, len(names), self.batch)]
        for future in [self.pool.submit(move, batch) for batch in batches]:
            future.result()

    def put(self, names: list[str]) -> None:
        self._batches(names, self.store.batch_put_from)

    def get(self, names: list[str]) -> None:
        self._batches(names, self.store.batch_get_into)

    def remove(self, names: list[str]) -> None:
        self.store.batch_remove(names, True)

    def close(self) -> None:
        self.pool.shutdown()
        for _, address in self.registered:
            self.store.unregister_buffer(address)
        self.store.close()


def run_job(tier: MooncakeTier, keys: list[ChunkKey], *, loading: bool) -> None:
    job = TransferJob(tuple(keys), tuple(range(len(keys))))
    (tier.submit_load if loading else tier.submit_store)(job)
    tier.drain()
    [result] = tier.get_finished_jobs()
    if not result.success:
        raise RuntimeError(f"tier {'load' if loading else 'store'} failed")


def timed(action: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of ``action()``.

    A full collection first, not counted: one falling due during a phase
    would cost that phase milliseconds for garbage any phase may have left.
    """
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - start, time.process_time() - cpu


def measure(
    master: MooncakeMaster,
    chunk_bytes: int,
    volume: int,
    rounds: int,
    warmup: int,
    io_threads: int,
) -> Result:
    layout = layout_for(chunk_bytes)
    chunks = max(MooncakeTier.io_batch, volume // chunk_bytes)
    config = {
        **master.tier_options(),
        "global_segment_size": 0,
        "deadline_s": 60,
        "io_threads": io_threads,
    }
    harness = TierHarness(config, layout, num_slots=chunks)
    tier = harness.tier
    if not isinstance(tier, MooncakeTier):
        raise SystemExit("not a mooncake tier")
    raw = RawMooncake(master, tier.options.io_threads, tier.io_batch, tier.value_bytes)
    # Names as long as the tier's, under a prefix of their own.
    prefix = tier.options.key_prefix
    raw_prefix = "raw:".ljust(len(prefix), "-")
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    cpu = dict.fromkeys(PHASES, 0.0)
    try:
        harness.fill(range(chunks))
        for round_ in range(warmup + rounds):
            keys = harness.keys(chunks)
            names = [raw_prefix + tier.store_name(k)[len(prefix) :] for k in harness.keys(chunks)]
            actions: dict[str, Callable[[], object]] = {
                "raw_store": partial(raw.put, names),
                "tier_store": partial(run_job, tier, keys, loading=False),
                "raw_load": partial(raw.get, names),
                "tier_load": partial(run_job, tier, keys, loading=True),
            }
            order = PHASES if round_ % 2 else ("tier_store", "raw_store", "tier_load", "raw_load")
            timings = {phase: timed(actions[phase]) for phase in order}
            raw.remove(names)
            raw.remove([tier.store_name(k) for k in keys])
            if round_ >= warmup:
                for phase, (wall, cpu_spent) in timings.items():
                    seconds[phase].append(wall)
                    cpu[phase] += cpu_spent
    finally:
        raw.close()
        harness.close()
    mib = chunks * chunk_bytes / MiB
    gib = mib * rounds / 1024

    def direction(kind: str) -> Direction:
        raw_s, tier_s = seconds[f"raw_{kind}"], seconds[f"tier_{kind}"]
        ratios = [r / t for r, t in zip(raw_s, tier_s, strict=True)]
        return Direction(
            raw_mib_s=round(mib / statistics.median(raw_s), 1),
            tier_mib_s=round(mib / statistics.median(tier_s), 1),
            ratio_median=round(statistics.median(ratios), 3),
            ratio_min=round(min(ratios), 3),
            ratio_max=round(max(ratios), 3),
            raw_cpu_s_per_gib=round(cpu[f"raw_{kind}"] / gib, 3),
            tier_cpu_s_per_gib=round(cpu[f"tier_{kind}"] / gib, 3),
        )

    return Result(chunk_bytes, chunks, rounds, direction("store"), direction("load"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2MiB,256KiB", help="Chunk sizes, comma-separated.")
    parser.add_argument("--volume", default="64MiB", help="Bytes moved per phase and round.")
    parser.add_argument("--repeat", type=int, default=24, help="Rounds counted per size.")
    parser.add_argument("--warmup", type=int, default=1, help="Rounds run first, not counted.")
    parser.add_argument(
        "--io-threads", type=int, default=4, help="The tier's io_threads, and the raw client's."
    )
    parser.add_argument("--json", action="store_true", help="Print JSON only.")
    args = parser.parse_args(argv)
    sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in args.sizes.split(",")]
    volume = int(TypeAdapter(ByteSize).validate_python(args.volume))
    rounds, warmup = max(1, args.repeat), max(0, args.warmup)
    results = []
    # Room for one round of raw and tier values at once, and the allocator's slack.
    with MooncakeMaster(storage_bytes=3 * volume + 64 * MiB) as master:
        for size in sizes:
            results.append(measure(master, size, volume, rounds, warmup, args.io_threads))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    print(f"load average {os.getloadavg()[0]:.2f}; {rounds} rounds after {warmup} warm-up")
    print("MiB/s: median of the rounds; ratio: tier / raw per round, median [min-max]")
    print(
        f"{'chunk':>8} {'':>5} {'raw':>7} {'tier':>7} {'ratio':>6} {'range':>13}"
        f" {'CPU s/GiB raw':>13} {'tier':>6}"
    )
    for r in results:
        for kind, d in (("store", r.store), ("load", r.load)):
            print(
                f"{r.chunk_bytes // 1024:>5}KiB {kind:>5} {d.raw_mib_s:>7} {d.tier_mib_s:>7}"
                f" {d.ratio_median:>6} {f'{d.ratio_min}-{d.ratio_max}':>13}"
                f" {d.raw_cpu_s_per_gib:>13} {d.tier_cpu_s_per_gib:>6}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
