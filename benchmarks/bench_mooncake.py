"""Store and load throughput of the ``mooncake`` tier against the raw Mooncake client.

One ``mooncake_master`` on loopback with a storage process lending the pool
its memory (so values cross a process boundary, as in a cluster); in the same
run, for each chunk size, the same volume is written and read by:

* raw: ``MooncakeDistributedStore`` alone with the tier's concurrency
  (``io_threads`` threads, each moving ``io_batch`` chunks per
  ``batch_put_from`` / ``batch_get_into`` from a buffer it registered), the
  chunks' bytes as they are: no framing, no checksums, no copy into slots;
* tier: one kvtier store job and one load job of every chunk through the
  tier's workers, with framing, verification and copies into primary slots.

Each round uses fresh names and removes them after, so every put writes.
Reports MiB/s of each, the best of ``--repeat`` rounds, and the median of the
per-round tier / raw ratios (target: at least 0.8). Run::

    python benchmarks/bench_mooncake.py [--sizes 2MiB,256KiB] [--volume 128MiB] [--repeat 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import sys
import time
import uuid
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

# The loopback servers are kvtier's test fixtures (tests/servers.py), not part
# of the installed package: import them from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.servers import MooncakeMaster

MiB = 1 << 20


@dataclass
class Result:
    chunk_bytes: int
    chunks: int
    raw_store_mib_s: float
    tier_store_mib_s: float
    raw_load_mib_s: float
    tier_load_mib_s: float
    store_ratio_paired: float
    load_ratio_paired: float
    #: This process's CPU seconds (client threads, tier workers, Mooncake's
    #: own threads) per GiB moved, over the counted rounds: steadier than wall
    #: time on a busy machine, and the cost framing and checksums add.
    cpu_s_per_gib: dict[str, float]


def layout_for(chunk_bytes: int) -> KVLayout:
    # small_layout: 2 layers x (K, V) x 2 heads x head_dim x tokens x 2 bytes.
    head_dim = 128
    tokens, rest = divmod(chunk_bytes, 16 * head_dim)
    if rest or tokens == 0:
        raise SystemExit(f"chunk size {chunk_bytes} is not a multiple of {16 * head_dim}")
    return small_layout(chunk_tokens=tokens, head_dim=head_dim)


class RawMooncake:
    """The bare client, moving chunks from buffers registered once per thread."""

    def __init__(self, master: MooncakeMaster, threads: int, batch: int, chunk_bytes: int):
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
        self.threads, self.batch, self.chunk_bytes = threads, batch, chunk_bytes
        self.buffers: list[tuple[mmap.mmap, int]] = []
        for _ in range(threads):
            mapping = mmap.mmap(-1, batch * chunk_bytes)
            mapping.write(bytes(range(256)) * (len(mapping) // 256))
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            if self.store.register_buffer(address, len(mapping)) != 0:
                raise SystemExit("raw client could not register its buffer")
            self.buffers.append((mapping, address))

    def _each_thread(self, names: list[str], call: Callable[..., list[int]]) -> None:
        shares = [names[i :: self.threads] for i in range(self.threads)]

        def work(thread: int) -> None:
            _, address = self.buffers[thread]
            share = shares[thread]
            for start in range(0, len(share), self.batch):
                batch = share[start : start + self.batch]
                pointers = [address + i * self.chunk_bytes for i in range(len(batch))]
                codes = call(batch, pointers, [self.chunk_bytes] * len(batch))
                if any(code < 0 for code in codes):
                    raise RuntimeError(f"raw mooncake call failed: {codes}")

        with ThreadPoolExecutor(self.threads) as pool:
            for future in [pool.submit(work, t) for t in range(self.threads)]:
                future.result()

    def put(self, names: list[str]) -> None:
        self._each_thread(names, self.store.batch_put_from)

    def get(self, names: list[str]) -> None:
        self._each_thread(names, self.store.batch_get_into)

    def remove(self, names: list[str]) -> None:
        self.store.batch_remove(names, True)

    def close(self) -> None:
        for _, address in self.buffers:
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
    """Wall and CPU seconds of ``action()``."""
    start, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - start, time.process_time() - cpu


def measure(master: MooncakeMaster, chunk_bytes: int, volume: int, repeat: int) -> Result:
    layout = layout_for(chunk_bytes)
    chunks = max(MooncakeTier.io_batch, volume // chunk_bytes)
    config = {**master.tier_options(), "global_segment_size": 0, "deadline_s": 60}
    harness = TierHarness(config, layout, num_slots=chunks)
    tier = harness.tier
    if not isinstance(tier, MooncakeTier):
        raise SystemExit("not a mooncake tier")
    threads = tier.options.io_threads
    raw = RawMooncake(master, threads, tier.io_batch, chunk_bytes)
    seconds: dict[str, list[float]] = {k: [] for k in ("raw_s", "tier_s", "raw_l", "tier_l")}
    cpu: dict[str, float] = dict.fromkeys(seconds, 0.0)
    try:
        harness.fill(range(chunks))
        for round_ in range(repeat + 1):  # the first round warms both up and is not counted
            names = [f"raw:{uuid.uuid4().hex}:{i}" for i in range(chunks)]
            keys = harness.keys(chunks)
            actions: dict[str, Callable[[], object]] = {
                "raw_s": partial(raw.put, names),
                "tier_s": partial(run_job, tier, keys, loading=False),
                "raw_l": partial(raw.get, names),
                "tier_l": partial(run_job, tier, keys, loading=True),
            }
            # Who goes first alternates: the first writer into a region of the
            # pool pays the storage process's page faults.
            order = ["raw_s", "tier_s", "raw_l", "tier_l"]
            if round_ % 2:
                order = ["tier_s", "raw_s", "tier_l", "raw_l"]
            timings = {phase: timed(actions[phase]) for phase in order}
            raw.remove(names)
            raw.remove([tier.store_name(k) for k in keys])
            for phase, (wall, cpu_spent) in timings.items():
                seconds[phase].append(wall)
                if round_:
                    cpu[phase] += cpu_spent
    finally:
        raw.close()
        harness.close()
    mib = chunks * chunk_bytes / MiB

    def best(phase: str) -> float:
        return mib / min(seconds[phase][1:])

    def paired(raw_phase: str, tier_phase: str) -> float:
        return statistics.median(
            r / t for r, t in zip(seconds[raw_phase][1:], seconds[tier_phase][1:], strict=True)
        )

    return Result(
        chunk_bytes=chunk_bytes,
        chunks=chunks,
        raw_store_mib_s=round(best("raw_s"), 1),
        tier_store_mib_s=round(best("tier_s"), 1),
        raw_load_mib_s=round(best("raw_l"), 1),
        tier_load_mib_s=round(best("tier_l"), 1),
        store_ratio_paired=round(paired("raw_s", "tier_s"), 3),
        load_ratio_paired=round(paired("raw_l", "tier_l"), 3),
        cpu_s_per_gib={k: round(v / (mib * repeat / 1024), 3) for k, v in cpu.items()},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2MiB,256KiB", help="Chunk sizes, comma-separated.")
    parser.add_argument("--volume", default="128MiB", help="Bytes moved per phase and round.")
    parser.add_argument("--repeat", type=int, default=3, help="Rounds counted per size.")
    parser.add_argument("--json", action="store_true", help="Print JSON only.")
    args = parser.parse_args(argv)
    sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in args.sizes.split(",")]
    volume = int(TypeAdapter(ByteSize).validate_python(args.volume))
    results = []
    # Room for one round of raw and tier values at once, and the allocator's slack.
    with MooncakeMaster(storage_bytes=4 * volume + 64 * MiB) as master:
        for size in sizes:
            results.append(measure(master, size, volume, max(1, args.repeat)))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    print("MiB/s, best of the rounds; ratio: tier / raw, median of the rounds")
    print(
        f"{'chunk':>9} {'raw store':>10} {'tier store':>10} {'ratio':>6}"
        f" {'raw load':>9} {'tier load':>9} {'ratio':>6}"
    )
    for r in results:
        print(
            f"{r.chunk_bytes // 1024:>6}KiB {r.raw_store_mib_s:>10} {r.tier_store_mib_s:>10}"
            f" {r.store_ratio_paired:>6} {r.raw_load_mib_s:>9} {r.tier_load_mib_s:>9}"
            f" {r.load_ratio_paired:>6}   CPU s/GiB {r.cpu_s_per_gib}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
