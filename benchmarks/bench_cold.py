"""A cold prefix from ``fs``: a fresh ``KVCache`` brings back what another process left.

Each measurement runs in a process of its own, as a restart does: it stores
one prefix (``--size`` bytes of chunks) through a ``KVCache`` with an ``fs``
tier into a fresh root, closes it, syncs and drops the page cache
(``drop_caches`` when permitted, else ``posix_fadvise(DONTNEED)`` per file:
the report says which), then builds a fresh ``KVCache`` on the same root and
times ``load_prefix`` of the whole prefix (an older kvtier, through
``--baseline-src``: ``cached_prefix`` + ``load``). Every byte loaded is
checked against the bytes stored.

In the same run, interleaved with it (each run starting with the next
system in turn):

* ``fio``: the disk's ceiling, ``O_DIRECT``, 4 jobs, sequential reads of the
  chunk size (``psync``), over files of the same total size;
* ``lmcache-disk-odirect``: LMCache 0.5.6's ``LocalDiskBackend`` with
  ``use_odirect`` storing and loading the same number of chunks of the same
  size, its page cache dropped before its load (``benchmarks/peers/``;
  skipped, with the reason, when ``.venv-lmcache`` is missing);
* ``baseline``: with ``--baseline-src DIR``, the same measurement with the
  kvtier package under ``DIR`` (an older checkout's ``src``), for before
  and after figures in the same runs.

Figures are GB/s (1e9 bytes/s); each ratio is taken within a run (the
machine is shared), then the median (p50) over runs, with the spread
(max - min) / p50. The breakdown of kvtier's cold prefix (medians):

* ``construct``: ``KVCache(...)``; ``populate``: from construction until
  the primary buffer's memory is mapped (in the background; the lookup
  starts after it, as an engine's first request comes after its start-up,
  or at once with ``--immediate``);
  ``reindex``: from construction until the fs tier's background re-index of
  the root finished (it may overlap the lookup: ``index_ready`` says whether
  it had finished when the lookup began, ``index_listed`` whether its first
  walk had, after which the chunk files' names answer lookups);
* ``lookup``, ``step``: the caller's thread inside the manager's lookups
  (tier lookups, reservations) and steps (collecting results, submitting
  promotions), with their counts;
* ``checks``: existence checks on the tier's workers (keys, summed seconds);
* ``first_submit``: from ``cached_prefix`` until the first promotion was
  submitted, and the number of promotion jobs;
* ``io``: seconds inside the chunk-file reads on the I/O threads (the read
  and, in the compiled code, the checksum in the same pass), summed, and
  from the first read's start to the last read's end (``io_span``);
  ``first_read``: from ``cached_prefix`` until the first read began (after
  ``first_submit``, a worker must get the interpreter's lock to start it);
* ``tail``: from the last read's end until ``cached_prefix`` returned (the
  results reaching the caller); ``waits``: the caller's thread neither in a
  lookup nor a step;
* ``checksum``: one thread hashing the prefix in memory, the CPU the
  in-pass verification costs; ``copies``: slots to the output, on the
  caller's thread (inside ``load_prefix``, overlapping the reads; an older
  kvtier's ``load``, after them).

``cpu s`` is the CPU time the timed part took (medians): ``client``, the
measuring process's (all its threads, user and system: for ``fs`` the
kernel's reads too), and for a remote tier ``server``, its server's
processes' (from ``/proc``, in clock ticks of 10 ms). On a machine of few
cores a remote tier's rate is bounded by the two together: a client that
spends more CPU per byte than its raw client takes it from the server.
``client threads`` splits the client's by thread: a pool's workers
together (``kvtier-mooncake``), ``MainThread`` (the caller: ``load_prefix``
and its copies into the engine's rows), ``native`` (threads a client
library started itself), ``other`` (threads that ended).

    python benchmarks/bench_cold.py --root /var/tmp/kvtier-cold --runs 5

Each chunk size ends with the goals its figures are judged against, met or
not: kvtier at least 0.9x the ceiling (``fio``, or a remote tier's raw
client), for ``fs`` a spread of at most 15 % and at least 1.2x LMCache's
disk backend (where it ran); in ``--json``, a chunk size's ``goals``.

``--tier redis|obj|mooncake`` measures a cold prefix from that remote tier
against its raw client instead (``bench_cold_remote.py``; ``--threads`` is
then the tier's ``io_threads``, 4 by default, and the raw client's;
``--baseline-src`` works alike).

``--codec NAME`` (repeatable, or a comma-separated list) measures the cold
prefix through each named codec and ``none`` in the same runs, on KV-like
bf16 values (``cold_codecs.py``; a table per chunk size follows the lines
above):

    python benchmarks/bench_cold.py --tier redis --codec none,lossless,int8,int4

``--quick`` (8 MiB, one run, no peer) checks the driver, as the test suite does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from bench_fs import clear_directory, parse_size  # noqa: E402
from cold_codecs import (  # noqa: E402
    codec_names,
    codec_row,
    codec_table,
    prefix_rows,
    served_rows,
    stored_ratio,
    system_name,
    tier_entry,
)
from physical import drop_caches  # noqa: E402

#: Bytes of one token across the layout's layers (4 layers, 2 KV heads, 64 dims, fp16, K and V).
TOKEN_BYTES = 2 * 4 * 2 * 64 * 2
PEER = "lmcache-disk-odirect"
#: The cold prefix's goals: kvtier at least this share of the ceiling (the
#: disk's or the raw client's), with at most this spread over runs (fs), and
#: at least this many times LMCache's disk backend (fs).
GOAL_VS_CEILING = 0.9
GOAL_FS_SPREAD = 0.15
GOAL_VS_PEER = 1.2


# One measurement, in its own process -----------------------------------------


def layout_for(chunk: int, codec: str | None = None) -> Any:
    """The prefix's layout: fp16, or bf16 when measured through codecs."""
    from kvtier import KVLayout

    if chunk % TOKEN_BYTES:
        raise SystemExit(f"--chunk must be a multiple of {TOKEN_BYTES} bytes, got {chunk}")
    dtype = "float16" if codec is None else "bfloat16"
    return KVLayout("bench-cold", 4, 2, 64, dtype, chunk // TOKEN_BYTES)


class Probe:
    """Wraps the cold path's steps to time them; every wrapper only adds a clock read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def add(self, name: str, started: float, ended: float, count: int = 1) -> None:
        with self.lock:
            self.sums[name] = self.sums.get(name, 0.0) + ended - started
            self.counts[name] = self.counts.get(name, 0) + count
            self.first[name] = min(self.first.get(name, started), started)
            self.last[name] = max(self.last.get(name, ended), ended)

    def wrap(
        self, owner: Any, attribute: str, name: str, count: Callable[..., int] | None = None
    ) -> None:
        real = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.add(name, started, time.perf_counter(), count(*args) if count else 1)

        setattr(owner, attribute, timed)


def probe_lookup_path(probe: Probe, cache: Any, tier: Any) -> None:
    """Time the caller's lookups and steps, the tier's existence checks and submits."""
    manager = cache.manager
    # Tiers on the composed runtime check through their store; older ones, by a hook.
    if hasattr(getattr(tier, "store", None), "contains_many"):
        probe.wrap(tier.store, "contains_many", "checks", count=len)
    else:
        probe.wrap(tier, "_contains", "checks", count=len)
    probe.wrap(tier, "submit_load", "submit")
    # KVCache enters the manager once per look (lookup_pinned); older ones, by lookup.
    entry = "lookup_pinned" if hasattr(manager, "lookup_pinned") else "lookup"
    probe.wrap(manager, entry, "lookup")
    probe.wrap(manager, "step", "step")
    facade = sys.modules[type(cache).__module__]
    if hasattr(cache, "load_prefix"):  # copies made while waiting: timed where they run
        probe.wrap(facade, "copy_out", "copies")
    stage = getattr(tier, "codec_stage", None)  # kvtier releases before codecs have none
    if stage is not None:
        probe.wrap(stage, "decode", "decode")


#: Pids of the processes serving a remote tier, comma-separated (set by
#: ``bench_cold_remote.remote_server``; children inherit it): their CPU time
#: is counted beside this process's.
SERVER_PIDS = "KVTIER_BENCH_SERVER_PIDS"


#: CPU seconds so far: this process's, its server's (``None`` without one),
#: and each of its live threads' (:func:`thread_cpu_seconds`).
CpuSnapshot = tuple[float, float | None, dict[int, tuple[str, float]]]


def cpu_seconds() -> CpuSnapshot:
    """CPU seconds so far: this process's (all its threads, user and system),
    the serving processes' (:data:`SERVER_PIDS`, in clock ticks; ``None``
    without a server) and each thread's of this process. Taken before the
    timed part: the totals first, then the threads, so that no thread counts
    CPU there that the totals miss (:func:`cpu_spent` reads in the other order)."""
    client, server = _total_cpu_seconds()
    return client, server, thread_cpu_seconds()


def _total_cpu_seconds() -> tuple[float, float | None]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    pids = [int(pid) for pid in os.environ.get(SERVER_PIDS, "").split(",") if pid]
    server = sum(_stat_cpu_s(f"/proc/{pid}/stat") for pid in pids) if pids else None
    return usage.ru_utime + usage.ru_stime, server


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """This process's live threads by id: ``(group, CPU seconds so far)``. A
    Python thread's group is its name less a trailing number (a pool's
    workers together); a thread Python did not start is ``native`` (a
    client library's own, Mooncake's transfer engine say). The seconds are
    the scheduler's, in nanoseconds (``schedstat``): the clock the process's
    total is kept on, where ``stat``'s whole clock ticks would round each
    thread apart."""
    groups = {t.native_id: re.sub(r"[-_]?\d+(?= \(|$)", "", t.name) for t in threading.enumerate()}
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            with open(task / "schedstat") as schedstat:
                on_cpu_ns = int(schedstat.read().split()[0])
        except OSError:  # it ended meanwhile
            continue
        threads[int(task.name)] = (groups.get(int(task.name), "native"), on_cpu_ns / 1e9)
    return threads


def _stat_cpu_s(path: str | Path) -> float:
    """utime + stime from a ``/proc`` stat file (a process's counts the threads that ended)."""
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_spent(before: CpuSnapshot) -> dict[str, Any]:
    """The CPU seconds since ``before`` (:func:`cpu_seconds`): the client's,
    the server's where there is one, and the client's by thread group
    (``thread_cpu``; ``other``: what the live threads do not account for,
    threads that ended meanwhile)."""
    # The threads first, then the totals: a thread busy in between counts in
    # the total too, and the groups never add up to more than it.
    threads = thread_cpu_seconds()
    client, server = _total_cpu_seconds()
    spent: dict[str, Any] = {"client_cpu_s": client - before[0]}
    if server is not None and before[1] is not None:
        spent["server_cpu_s"] = server - before[1]
    by_group: dict[str, float] = {}
    for thread, (group, seconds) in threads.items():
        earlier = before[2].get(thread, (group, 0.0))[1]
        by_group[group] = by_group.get(group, 0.0) + seconds - earlier
    # Floored: the total is kept in microseconds, the threads in nanoseconds.
    by_group["other"] = max(0.0, spent["client_cpu_s"] - sum(by_group.values()))
    spent["thread_cpu"] = by_group
    return spent


def bring_back(
    cache: Any, tokens: Any, expected: Any, out: Any
) -> tuple[float, float, float, dict[str, float]]:
    """``load_prefix`` of ``tokens`` into ``out`` (older kvtier: ``cached_prefix`` +
    ``load``), every byte checked against ``expected``: ``(begin, prefix_s,
    load_s, cpu)``, ``load_s`` 0 for the one call, ``cpu`` what the calls took
    of the CPU (:func:`cpu_spent`; the check after is not counted)."""
    import numpy as np

    cpu_before = cpu_seconds()
    begin = time.perf_counter()
    if hasattr(cache, "load_prefix"):  # the copies overlap the promotions
        loaded = cache.load_prefix(tokens, out)
        prefix_s, load_s = time.perf_counter() - begin, 0.0
    else:
        found = cache.cached_prefix(tokens)
        prefix_s = time.perf_counter() - begin
        loaded = cache.load(tokens, found, out)
        load_s = time.perf_counter() - begin - prefix_s
    cpu = cpu_spent(cpu_before)
    if loaded != len(tokens) or not np.array_equal(out, expected):
        raise SystemExit(f"loaded {loaded} of {len(tokens)} tokens, or wrong bytes")
    return begin, prefix_s, load_s, cpu


def breakdown(
    probe: Probe, begin: float, prefix_s: float, load_s: float, expected: Any
) -> dict[str, Any]:
    """The figures of one cold prefix (see the module's header) from its probe,
    and the time one thread takes to checksum the prefix in memory."""
    from kvtier import integrity

    hashed = time.perf_counter()
    for row in expected:
        integrity.checksum(row)
    checksum_s = time.perf_counter() - hashed
    sums, counts = probe.sums, probe.counts
    io_end = probe.last.get("io", begin)
    return {
        "verified_chunks": len(expected),
        "total_s": prefix_s + load_s,
        "prefix_s": prefix_s,
        "lookup_s": sums.get("lookup", 0.0),
        "lookups": counts.get("lookup", 0),
        "step_s": sums.get("step", 0.0),
        "steps": counts.get("step", 0),
        "checks_s": sums.get("checks", 0.0),
        "checked_keys": counts.get("checks", 0),
        "checks_span_s": probe.last.get("checks", begin) - begin,
        "first_submit_s": probe.first.get("submit", begin) - begin,
        "jobs": counts.get("submit", 0),
        "io_s": sums.get("io", 0.0),
        "io_span_s": io_end - probe.first.get("io", begin),
        "first_read_s": probe.first.get("io", begin) - begin,
        "decode_s": sums.get("decode", 0.0),
        "tail_s": begin + prefix_s - io_end,
        "waits_s": prefix_s - sums.get("lookup", 0.0) - sums.get("step", 0.0),
        "checksum_s": checksum_s,
        "copies_s": sums.get("copies", load_s),
    }


def measure_cold(
    root: str, size: int, chunk: int, seed: int, threads: int, immediate: bool, codec: str | None
) -> dict[str, Any]:
    """One cold prefix from ``fs``; ``codec``: through it, on KV-like values."""
    import numpy as np

    from kvtier import KVCache
    from kvtier.tiers.fs import io as chunk_io

    layout = layout_for(chunk, codec)
    chunks = size // chunk
    entry = {"type": "fs", "root_dir": root, "io_threads": threads}
    config = {
        "chunk_tokens": layout.chunk_tokens,
        "cpu_bytes_to_use": chunks * layout.slot_bytes,
        "secondary_tiers": [tier_entry(entry, codec)],
    }
    tokens, rows = prefix_rows(layout, chunks, seed, kv=codec is not None)
    expected = served_rows(rows, layout, codec)
    with KVCache(config, layout) as writer:
        mapped = getattr(writer.manager.primary.buffer, "wait_populated", None)
        if mapped is not None and not immediate:
            mapped()  # an engine stores once it is up, as it looks up (see below)
        started = time.perf_counter()
        if writer.store(tokens, rows) != chunks:
            raise SystemExit("the prefix was not stored whole")
        writer.drain()
        os.sync()
        store_s = time.perf_counter() - started
        codec_figures = {}
        if codec is not None:
            codec_figures = {"stored_ratio": stored_ratio(writer.manager.tiers[0])}
    cold = drop_caches(root)
    out = np.ones_like(expected)  # the engine's memory: allocated and touched before

    probe = Probe()
    # A task's files in one call (kvtier since the batched reads), else one
    # call a file (a variable-size codec's chunks, and older kvtier).
    for reads in ("_load_files", "_load_file"):
        if hasattr(chunk_io, reads):
            probe.wrap(chunk_io, reads, "io")
    started = time.perf_counter()
    cache = KVCache(config, layout)
    construct_s = time.perf_counter() - started
    populate_s = None
    try:
        # As in service, where kvtier starts with the engine: the request
        # comes once the primary buffer is mapped (kvtier versions that map
        # it on first use have nothing to wait for).
        buffer = cache.manager.primary.buffer
        if hasattr(buffer, "wait_populated") and not immediate:
            buffer.wait_populated()
            populate_s = time.perf_counter() - started
        tier: Any = cache.manager.tiers[0]  # the fs tier
        reindexed: list[float] = []
        watcher = threading.Thread(
            target=lambda: reindexed.append(tier.wait_index(60) and time.perf_counter())
        )
        watcher.start()
        index_ready = tier.index_ready
        # Whether its names were listed (kvtier since the two-walk re-index):
        # lookups are answered from them, with no existence check.
        listed = getattr(getattr(getattr(tier, "backend", None), "index", None), "listed", None)
        index_listed = index_ready if listed is None else listed.is_set()
        probe_lookup_path(probe, cache, tier)
        begin, prefix_s, load_s, cpu = bring_back(cache, tokens, expected, out)
        watcher.join()
    finally:
        cache.close()
    return {
        **breakdown(probe, begin, prefix_s, load_s, expected),
        **cpu,
        "store_s": store_s,
        "cold": cold,
        "construct_s": construct_s,
        "populate_s": populate_s,
        "reindex_s": reindexed[0] - started if reindexed and reindexed[0] else None,
        "index_ready": index_ready,
        "index_listed": index_listed,
        "io_threads": threads,
        **codec_figures,
    }


# The run -------------------------------------------------------------------------


def child_command(
    src: Path | None,
    args: argparse.Namespace,
    root: Path,
    chunk: int,
    seed: int,
    codec: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(root)]
    command += ["--size", str(args.size), "--chunk", str(chunk), "--seed", str(seed)]
    command += ["--threads", str(args.threads)] + (["--immediate"] if args.immediate else [])
    return command + (["--codec", codec] if codec is not None else []), env


def run_kvtier(
    src: Path | None,
    args: argparse.Namespace,
    root: Path,
    chunk: int,
    seed: int,
    codec: str | None = None,
) -> dict[str, Any]:
    clear_directory(root, args.root)
    command, env = child_command(src, args, root, chunk, seed, codec)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    shutil.rmtree(root, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"cold measurement failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    result["gbps"] = args.size / result["total_s"] / 1e9
    result["store_gbps"] = args.size / result["store_s"] / 1e9
    return result


def run_fio(args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    """The disk's ceiling: fio, O_DIRECT, 4 jobs of sequential chunk-sized reads."""
    directory = args.root / "fio"
    directory.mkdir(parents=True, exist_ok=True)
    jobs = 4
    command = [
        "fio",
        "--name=ceiling",
        f"--directory={directory}",
        f"--size={max(1, args.size // jobs)}",
        f"--numjobs={jobs}",
        "--rw=read",
        f"--bs={chunk}",
        "--direct=1",
        "--ioengine=psync",
        "--group_reporting",
        "--output-format=json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"fio failed: {done.stderr[-2000:]}")
    read = json.loads(done.stdout)["jobs"][0]["read"]
    return {"gbps": read["bw_bytes"] / 1e9}


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "p50": round(statistics.median(values), 3),
        "spread": round(spread(values), 3),
        "runs": [round(v, 3) for v in values],
    }


def measure_chunk(
    args: argparse.Namespace, chunk: int, systems: dict[str, Callable[[int, Path], Any]]
) -> dict[str, Any]:
    names = list(systems)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index in range(args.runs):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            runs[name].append(systems[name](index, args.root / f"{chunk}-{index}-{name}"))
    result: dict[str, Any] = {"chunk": chunk, "chunks": args.size // chunk}
    # The ceiling: the disk's (fio) for fs, the raw client's for a remote tier.
    top = next((name for name in ("fio", "raw") if name in runs), None)
    for name, rounds in runs.items():
        row: dict[str, Any] = {"gbps": summary([r["gbps"] for r in rounds])}
        # CPU seconds of the timed part (see cpu_seconds), where counted: medians.
        row["cpu_s"] = {
            side: round(statistics.median(r[f"{side}_cpu_s"] for r in rounds), 4)
            for side in ("client", "server")
            if f"{side}_cpu_s" in rounds[0]
        }
        if all("thread_cpu" in r for r in rounds):
            groups = sorted({group for r in rounds for group in r["thread_cpu"]})
            row["thread_cpu_s"] = {
                group: round(statistics.median(r["thread_cpu"].get(group, 0.0) for r in rounds), 4)
                for group in groups
            }
        if top is not None and name != top:
            ceiling = [r["gbps"] / f["gbps"] for r, f in zip(rounds, runs[top], strict=True)]
            row[f"vs_{top}"] = summary(ceiling)
        if name.startswith("kvtier") or name == "baseline":
            row["store_gbps"] = summary([r["store_gbps"] for r in rounds])
            row["cold"] = rounds[0]["cold"]
            row["verified_chunks"] = [r["verified_chunks"] for r in rounds]
            keys = [k for k in rounds[0] if k.endswith("_s") or k in ("lookups", "steps", "jobs")]
            row["breakdown"] = {
                k: round(statistics.median(r[k] for r in rounds), 4)
                for k in keys
                if all(isinstance(r[k], int | float) for r in rounds)
            }
            for key in ("checked_keys", "index_listed", "index_ready"):
                row["breakdown"][key] = [r.get(key) for r in rounds]
            # Without load's copy into the engine's rows: what a peer whose
            # load hands back its own buffers (LMCache's) is measured doing.
            promotion = [r["gbps"] * r["total_s"] / r["prefix_s"] for r in rounds]
            row["promotion_gbps"] = summary(promotion)
            for other in ("baseline", PEER):
                if other in runs and other != name:
                    paired = [
                        r["gbps"] / o["gbps"] for r, o in zip(rounds, runs[other], strict=True)
                    ]
                    row[f"vs_{other}"] = summary(paired)
            if PEER in runs:
                paired = [p / o["gbps"] for p, o in zip(promotion, runs[PEER], strict=True)]
                row[f"promotion_vs_{PEER}"] = summary(paired)
            if "stored_ratio" in rounds[0]:
                row["codec"] = codec_row(rounds, runs["kvtier"], summary)
        result[name] = row
    if "kvtier" in result:
        result["goals"] = goals(result["kvtier"], top)
    return result


def goals(row: dict[str, Any], ceiling: str | None) -> list[dict[str, Any]]:
    """Each goal kvtier's ``row`` was measured against: what it asks, the
    figure (medians of the per-run ratios) and whether it is met."""
    wanted: list[tuple[str, str, float, bool]] = []  # (figure, bound, value, met)
    if ceiling is not None:
        value = row[f"vs_{ceiling}"]["p50"]
        wanted.append((f"vs {ceiling}", f">= {GOAL_VS_CEILING}x", value, value >= GOAL_VS_CEILING))
    if ceiling == "fio":
        value = row["gbps"]["spread"]
        wanted.append(("spread", f"<= {GOAL_FS_SPREAD:.0%}", value, value <= GOAL_FS_SPREAD))
    if f"vs_{PEER}" in row:
        value = row[f"vs_{PEER}"]["p50"]
        wanted.append((f"vs {PEER}", f">= {GOAL_VS_PEER}x", value, value >= GOAL_VS_PEER))
    return [
        {"figure": figure, "goal": bound, "value": value, "met": met}
        for figure, bound, value, met in wanted
    ]


def peer_system(args: argparse.Namespace, stack: ExitStack) -> tuple[Any, str | None]:
    """LMCache's disk backend in its own environment, or why not."""
    from bench_peers import PeerProcess, peer_python

    python = peer_python(PEER, args.peer_envs)
    if isinstance(python, str):
        return None, python
    options = ["--threads", str(args.peer_threads)]
    return stack.enter_context(closing(PeerProcess(PEER, python, options))), None


def systems_for(
    args: argparse.Namespace, chunk: int, peer: Any, notes: dict[str, str]
) -> dict[str, Callable[[int, Path], dict[str, Any]]]:
    """Each system's run ``(run index, fresh root) -> figures`` for one chunk size."""

    def kvtier(src: Path | None, codec: str | None = None) -> Callable[[int, Path], dict[str, Any]]:
        return lambda index, root: run_kvtier(src, args, root, chunk, args.seed + index, codec)

    systems = {system_name(codec): kvtier(None, codec) for codec in args.codecs or [None]}
    if "fio" not in notes:
        systems["fio"] = lambda index, root: run_fio(args, chunk)
    if args.baseline_src is not None:
        # Through codecs, on the same KV-like prefix as the others, with none.
        reference = args.codecs[0] if args.codecs else None
        systems["baseline"] = kvtier(args.baseline_src.absolute(), reference)
    if peer is not None:

        def peer_run(index: int, root: Path) -> dict[str, Any]:
            clear_directory(root, args.root)
            answer = peer.round(str(root), args.seed + index, chunk, args.size // chunk)
            shutil.rmtree(root, ignore_errors=True)
            return {"gbps": args.size / answer["load_s"] / 1e9, **answer}

        systems[PEER] = peer_run
    return systems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("kvtier-bench-cold"))
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    parser.add_argument("--chunk", type=parse_size, action="append", help="repeatable")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--tier",
        default="fs",
        choices=("fs", "redis", "obj", "mooncake"),
        help="a remote tier: its server on loopback, against its raw client (bench_cold_remote)",
    )
    parser.add_argument("--threads", type=int, help="the tier's io_threads (fs: 16, else 4)")
    parser.add_argument("--peer-threads", type=int, default=16, help="LMCache's disk_io_threads")
    parser.add_argument("--baseline-src", type=Path, help="an older kvtier's src, run alike")
    parser.add_argument("--no-peer", action="store_true", help="leave LMCache out")
    parser.add_argument("--peer-envs", type=Path, default=BENCHMARKS.parent)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--codec",
        action="append",
        help="measure through this codec too (repeatable or a,b,c; none is always run)",
    )
    parser.add_argument(
        "--immediate",
        action="store_true",
        help="look the prefix up right after construction, not once the buffer is mapped",
    )
    parser.add_argument("--quick", action="store_true", help="8 MiB, one run, no peer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    parser.add_argument("--remote-child", metavar="TIER_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.remote_child:
        from bench_cold_remote import measure_child

        entry = json.loads(args.remote_child)
        print(json.dumps(measure_child(entry, args.size, args.chunk[0], args.seed)))
        return 0
    if args.child:
        chunk, root, codec = args.chunk[0], args.child, (args.codec or [None])[0]
        figures = measure_cold(
            root, args.size, chunk, args.seed, args.threads, args.immediate, codec
        )
        print(json.dumps(figures))
        return 0
    args.codecs = codec_names(args.codec)
    if args.threads is None:
        args.threads = 16 if args.tier == "fs" else 4
    if args.quick:
        args.size, args.runs, args.no_peer = parse_size("8MiB"), 1, True
    if args.tier != "fs":
        return run_remote(args, parser)
    chunks = args.chunk or [parse_size("256KiB"), parse_size("2MiB")]
    if args.runs < 1 or any(args.size < c for c in chunks):
        parser.error("need --runs >= 1 and --size of at least one chunk")
    args.root = args.root.absolute()
    args.root.mkdir(parents=True, exist_ok=True)
    notes: dict[str, str] = {}
    results = []
    with ExitStack() as stack:
        peer, why_not = (None, "--no-peer") if args.no_peer else peer_system(args, stack)
        if why_not:
            notes[PEER] = why_not
        if shutil.which("fio") is None:
            notes["fio"] = "fio is not installed (Debian: apt-get install fio)"
        for chunk in chunks:
            systems = systems_for(args, chunk, peer, notes)
            results.append(measure_chunk(args, chunk, systems))
        shutil.rmtree(args.root / "fio", ignore_errors=True)
    report(args, results, notes)
    return 0


def run_remote(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A cold prefix from a remote tier against its raw client (see ``bench_cold_remote``)."""
    from bench_cold_remote import remote_server, remote_systems

    chunks = args.chunk or [parse_size("256KiB"), parse_size("2MiB")]
    if args.runs < 1 or any(args.size < c for c in chunks):
        parser.error("need --runs >= 1 and --size of at least one chunk")
    results = []
    # With --baseline-src the children store their run's prefix again (the
    # same values: a put over a held value), while the last run's may be held.
    prefixes = len(args.codecs or [None]) + (args.baseline_src is not None)
    with remote_server(args.tier, args.threads, args.size, prefixes) as (config, new_client):
        for chunk in chunks:
            with remote_systems(args, chunk, config, new_client) as systems:
                results.append(measure_chunk(args, chunk, systems))
    report(args, results, {})
    return 0


def report(args: argparse.Namespace, results: list[dict[str, Any]], notes: dict[str, str]) -> None:
    out = {"tier": args.tier, "io_threads": args.threads, "size": args.size, "runs": args.runs}
    out["codecs"] = args.codecs
    out |= {"results": results, "skipped": notes}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"cold prefix of {args.size} bytes from {args.tier}, {args.runs} runs; GB/s p50 (spread)")
    for result in results:
        print(f"\nchunk {result['chunk']} B ({result['chunks']} chunks)")
        for name, row in result.items():
            if not isinstance(row, dict):
                continue
            line = f"  {name:<22} {row['gbps']['p50']:6.2f} ({row['gbps']['spread']:.0%})"
            for key in [k for k in row if k.startswith(("vs_", "promotion_vs_"))]:
                line += f"  {key} {row[key]['p50']:.2f}x ({row[key]['spread']:.0%})"
            if "store_gbps" in row:
                line += f"  store {row['store_gbps']['p50']:.2f}"
            if row.get("cpu_s"):
                line += "  cpu s " + " ".join(f"{k} {v:.3f}" for k, v in row["cpu_s"].items())
            busy = {k: v for k, v in row.get("thread_cpu_s", {}).items() if v >= 0.01}
            if busy:
                line += " (client threads: " + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
                line += ")"
            print(line)
            if "breakdown" in row:
                parts = ", ".join(f"{k} {v}" for k, v in row["breakdown"].items())
                print(f"    {parts}")
        for line in codec_table(result):
            print(line)
        for goal in result.get("goals", []):
            verdict = "met" if goal["met"] else "NOT met"
            value = goal["value"]
            # As many digits as the figure has (rounded to 3 decimals): a
            # spread of 15.2 % must not read as a 15 % that failed.
            shown = f"{value:.1%}" if goal["figure"] == "spread" else f"{value:.3f}x"
            print(f"  goal: kvtier {goal['figure']} {goal['goal']}: {shown}, {verdict}")
    for name, why in notes.items():
        print(f"skipped {name}: {why}")


if __name__ == "__main__":
    sys.exit(main())
