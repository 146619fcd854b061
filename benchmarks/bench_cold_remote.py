"""A cold prefix from a remote tier (``redis``, ``obj``, ``mooncake``) against its raw client.

``bench_cold.py --tier redis|obj|mooncake`` runs this: the tier's server is
started on loopback (``tests/support/servers.py``) for the whole run. In each run a
``KVCache`` stores one prefix through the tier and closes; then, in turn
(each run starting with the next one):

* ``kvtier``: a fresh ``KVCache`` on the same server times ``load_prefix``
  of the whole prefix, every byte checked (existence checks, promotion,
  verification, the copy into the engine's rows);
* ``raw``: the tier's client library alone reads the very values kvtier
  stored, under their names, with the tier's parallelism: ``io_threads``
  threads, each moving batches of the tier's size (redis-py pipelines of
  ``RedisBackend.batch_chunks`` GETs, boto3 ``get_object`` per value, Mooncake
  ``batch_get_into`` of ``io_batch`` values into a registered buffer), no
  existence check, no verification, no copy. A client of its own each run,
  set up before the clock starts (its connections and buffers made on first
  use), as the fresh ``KVCache`` is built before its clock starts.

With ``--codec``, each codec's kvtier runs on a prefix of its own (the same
values, stored through that codec); the raw client reads ``none``'s.

With ``--baseline-src DIR``, ``baseline`` is the kvtier under ``DIR`` (an
older checkout's ``src``), for before and after figures, stores included,
in the same runs. It runs in a process of its own, and so does ``kvtier``
then (a fresh process's memory, as after a restart, for both alike): each
stores the run's prefix again (the same values under the same names) and
brings it back.

The others run in this process; jobs get a 60 s deadline, so that the figure
is the tier's rate, not its per-request deadline's (``deadline_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench_cold import (
    SERVER_PIDS,
    Probe,
    breakdown,
    bring_back,
    cpu_seconds,
    cpu_spent,
    layout_for,
    probe_lookup_path,
)
from cold_codecs import (
    REFERENCE,
    prefix_rows,
    served_rows,
    stored_ratio,
    system_name,
    tier_entry,
)

#: A raw client of its own for one run, set up before the clock starts, as the
#: fresh ``KVCache`` is: ``(its read of all the names, its close)``.
RawClient = tuple[Callable[[list[str]], None], Callable[[], None]]
#: ``chunk bytes -> RawClient``.
NewRawClient = Callable[[int], RawClient]
REMOTE_TIERS = ("redis", "obj", "mooncake")


@contextmanager
def counting_cpu_of(server: Any) -> Iterator[None]:
    """Count ``server``'s processes' CPU time beside this process's (see
    ``bench_cold.cpu_seconds``), in children too, while in the block."""
    os.environ[SERVER_PIDS] = ",".join(map(str, server.pids()))
    try:
        yield
    finally:
        del os.environ[SERVER_PIDS]


@contextmanager
def remote_server(
    tier: str, threads: int, size: int, prefixes: int = 1
) -> Iterator[tuple[dict[str, Any], NewRawClient]]:
    """The tier's server on loopback: yields the tier's config and a maker of raw
    clients. ``prefixes``: how many prefixes of ``size`` bytes it holds at once."""
    from bench_shared_tiers import WHOLE_JOBS, RawRedis, RawS3  # puts the checkout on sys.path
    from tests.support.servers import MooncakeMaster, RedisServer, S3Server

    if tier == "redis":
        from kvtier.tiers.redis import RedisBackend

        with RedisServer() as redis_server:

            def raw_redis(chunk: int) -> RawClient:
                raw = RawRedis(redis_server.url, threads)
                raw.batch = RedisBackend.batch_chunks(chunk)  # the tier's pipeline depth
                return raw.load, raw.client.close

            with counting_cpu_of(redis_server):
                yield {"type": "redis", "url": redis_server.url, **WHOLE_JOBS}, raw_redis
    elif tier == "obj":
        with S3Server() as s3_server:
            bucket = s3_server.create_bucket("kvtier-bench-cold")

            def raw_s3(chunk: int) -> RawClient:
                raw = RawS3(s3_server, bucket, threads)
                return raw.load, raw.client.close

            with counting_cpu_of(s3_server):
                yield {"type": "obj", **s3_server.tier_options(bucket), **WHOLE_JOBS}, raw_s3
    elif tier == "mooncake":
        from bench_mooncake import RawMooncake

        from kvtier import integrity
        from kvtier.tiers.mooncake import MooncakeTier

        # Room for one more prefix than held at once (the last run's is
        # removed before the next is stored) and the allocator's slack.
        with MooncakeMaster(storage_bytes=(prefixes + 1) * size + (64 << 20)) as master:

            def raw_mooncake(chunk: int) -> RawClient:
                value_bytes = integrity.HEADER_BYTES + chunk
                raw = RawMooncake(master, threads, MooncakeTier.io_batch, value_bytes)
                return raw.get, raw.close

            config = {**master.tier_options(), "global_segment_size": 0, **WHOLE_JOBS}
            with counting_cpu_of(master):
                yield config, raw_mooncake
    else:
        raise SystemExit(f"--tier must be fs or one of {', '.join(REMOTE_TIERS)}, got {tier!r}")


class StoredPrefix:
    """One run's prefix, stored through kvtier once for both systems of the run
    (they share the run's seed), removed when the next run stores its own."""

    def __init__(
        self, config: dict[str, Any], size: int, chunk: int, codec: str | None = None
    ) -> None:
        self.config, self.size, self.chunk, self.codec = config, size, chunk, codec
        self.seed: int | None = None
        self.keys: list[Any] = []
        self.names: list[str] = []
        self.figures: dict[str, Any] = {}
        self.expected: Any = None

    def ensure(self, seed: int) -> tuple[Any, Any, Any]:
        """``(layout, tokens, expected rows)`` of ``seed``'s prefix, stored
        (expected: what the tier serves, a lossy codec's round trip)."""
        from kvtier import KVCache

        layout = layout_for(self.chunk, self.codec)
        chunks = self.size // self.chunk
        tokens, rows = prefix_rows(layout, chunks, seed, kv=self.codec is not None)
        if seed == self.seed:
            return layout, tokens, self.expected
        with KVCache(self.cache_config(), layout) as writer:
            tier: Any = writer.manager.tiers[0]
            tier.discard(self.keys)  # the last run's values: room for this one's
            self.keys = []
            writer.manager.primary.buffer.wait_populated()
            started = time.perf_counter()
            if writer.store(tokens, rows) != chunks:
                raise SystemExit("the prefix was not stored whole")
            writer.drain()
            store_s = time.perf_counter() - started
            if tier.stats.store_failures:  # a full server, say: say so now, not at the load
                raise SystemExit(
                    f"{tier.stats.store_failures} of {chunks} chunks failed to store "
                    f"in {self.config['type']} (see the server's log)"
                )
            self.keys = writer.keys(tokens)
            self.names = [tier.store_name(key) for key in self.keys]
            self.figures = {"store_s": store_s}
            if self.codec is not None:
                self.figures["stored_ratio"] = stored_ratio(tier)
        self.seed, self.expected = seed, served_rows(rows, layout, self.codec)
        return layout, tokens, self.expected

    def discard(self) -> None:
        """Remove the values stored last: room for the next chunk size's prefix."""
        from kvtier import KVCache

        if self.keys:
            with KVCache(self.cache_config(), layout_for(self.chunk, self.codec)) as cache:
                cache.manager.tiers[0].discard(self.keys)
        self.keys, self.names, self.seed = [], [], None

    def cache_config(self) -> dict[str, Any]:
        layout = layout_for(self.chunk, self.codec)
        return {
            "chunk_tokens": layout.chunk_tokens,
            "cpu_bytes_to_use": self.size // self.chunk * layout.slot_bytes,
            "secondary_tiers": [tier_entry(self.config, self.codec)],
        }


def measure_kvtier(stored: StoredPrefix, seed: int) -> dict[str, Any]:
    """A fresh ``KVCache`` brings the stored prefix back; every byte checked."""
    import numpy as np

    from kvtier import KVCache

    layout, tokens, expected = stored.ensure(seed)
    out = np.ones_like(expected)  # the engine's memory: allocated and touched before
    started = time.perf_counter()
    cache = KVCache(stored.cache_config(), layout)
    construct_s = time.perf_counter() - started
    probe = Probe()
    try:
        cache.manager.primary.buffer.wait_populated()  # as an engine's first request
        populate_s = time.perf_counter() - started
        tier: Any = cache.manager.tiers[0]
        probe_lookup_path(probe, cache, tier)
        if hasattr(getattr(tier, "store", None), "move_many"):  # the composed runtime
            probe.wrap(tier.store, "move_many", "io")
        else:
            probe.wrap(tier, "_transfer", "io")
        begin, prefix_s, load_s, cpu = bring_back(cache, tokens, expected, out)
    finally:
        cache.close()
    return {
        **stored.figures,
        **breakdown(probe, begin, prefix_s, load_s, expected),
        **cpu,
        "gbps": stored.size / (prefix_s + load_s) / 1e9,
        "store_gbps": stored.size / stored.figures["store_s"] / 1e9,
        "cold": "fresh KVCache",
        "construct_s": construct_s,
        "populate_s": populate_s,
        "index_ready": None,
    }


def measure_raw(stored: StoredPrefix, new_client: NewRawClient, seed: int) -> dict[str, Any]:
    """A fresh raw client reads the stored values (its connections and buffers
    made on first use, as the fresh ``KVCache``'s are)."""
    stored.ensure(seed)
    read, close = new_client(stored.chunk)
    try:
        cpu_before = cpu_seconds()
        started = time.perf_counter()
        read(stored.names)
        seconds = time.perf_counter() - started
        return {"gbps": stored.size / seconds / 1e9, **cpu_spent(cpu_before)}
    finally:
        close()


def measure_in_child(stored: StoredPrefix, src: Path, seed: int) -> dict[str, Any]:
    """:func:`measure_kvtier` with the kvtier under ``src``, in a child process
    (``bench_cold.py --remote-child``) on the same server."""
    command = [sys.executable, str(Path(__file__).with_name("bench_cold.py"))]
    command += ["--remote-child", json.dumps(stored.config), "--seed", str(seed)]
    command += ["--size", str(stored.size), "--chunk", str(stored.chunk)]
    env = {**os.environ, "PYTHONPATH": str(src.absolute())}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"cold measurement under {src} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def measure_child(entry: dict[str, Any], size: int, chunk: int, seed: int) -> dict[str, Any]:
    """The child of :func:`measure_in_child`: store the run's prefix, bring it back."""
    return measure_kvtier(StoredPrefix(entry, size, chunk), seed)


@contextmanager
def remote_systems(
    args: argparse.Namespace, chunk: int, config: dict[str, Any], new_client: NewRawClient
) -> Iterator[dict[str, Callable[[int, Path], dict[str, Any]]]]:
    """``bench_cold.measure_chunk``'s systems for a remote tier: kvtier (through
    each of ``args.codecs``) and its raw client; their values are removed from
    the server at the end (a server sized for one chunk size's prefixes)."""
    entry = {**config, "io_threads": args.threads}
    stored = {c: StoredPrefix(entry, args.size, chunk, c) for c in args.codecs or [None]}
    reference = stored[REFERENCE if args.codecs else None]

    def through(prefix: StoredPrefix) -> Callable[[int, Path], dict[str, Any]]:
        return lambda index, _: measure_kvtier(prefix, args.seed + index)

    systems = {system_name(codec): through(prefix) for codec, prefix in stored.items()}
    systems["raw"] = lambda index, _: measure_raw(reference, new_client, args.seed + index)
    if args.baseline_src is not None:
        import kvtier

        def in_child(src: Path) -> Callable[[int, Path], dict[str, Any]]:
            return lambda index, _: measure_in_child(reference, src, args.seed + index)

        systems[system_name(None)] = in_child(Path(kvtier.__file__).parents[1])
        systems["baseline"] = in_child(args.baseline_src)
    try:
        yield systems
    finally:
        for prefix in stored.values():
            prefix.discard()
