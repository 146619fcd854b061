"""The cluster index at fleet scale, on loopback: node processes, one Redis.

Starts ``--nodes`` kvtier node processes (each a ``p2p`` tier and the
``index`` section, on one ``redis-server``), has each store ``--prompts``
prompts of ``--prompt-chunks`` chunks one at a time, and reports:

* **store to visible**: from a node's ``store`` returning to its chunk
  showing in the index (the node polls it every millisecond), p50 / p99;
* **index writes per stored chunk**: Redis commands that changed entries
  (``ZADD``, ``ZREMRANGEBYSCORE``, ``PEXPIRE``, ``ZREM``) per chunk stored,
  and publish round trips (pipelines) per chunk;
* **Redis memory per indexed chunk**: ``used_memory`` grown over entries;
* **peer queries per lookup batch**: a fetcher that names every node as a
  peer looks up other nodes' prompts, with the index (asking only holders)
  and without it (asking every peer);
* **routing call latency**: :meth:`FleetIndex.scores_for_tokens` in
  process, and ``POST /v1/scores`` through ``kvtier route``'s service.

    python benchmarks/bench_fleet.py --nodes 32
    python benchmarks/bench_fleet.py --quick --json      # 4 nodes, as the tests run it
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# kvtier's loopback redis fixture lives in the checkout's tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import RedisServer

from kvtier import KVCache
from kvtier.cli.peer import synthetic_chunks
from kvtier.cli.probe import probe_layout
from kvtier.config import load_config
from kvtier.fleet import FleetIndex, build_index
from kvtier.fleet.service import RouteService

SECRET = "kvtier-bench-fleet-secret-0123456789"
CHUNK_TOKENS = 16
ENTRY_COMMANDS = ("zadd", "zremrangebyscore", "pexpire", "zrem")


def node_config(args: argparse.Namespace, url: str, name: str) -> dict[str, Any]:
    layout = probe_layout(CHUNK_TOKENS, args.chunk_kib)
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "cpu_bytes_to_use": (args.prompts * args.prompt_chunks + 8) * layout.slot_bytes,
        "secondary_tiers": [{"type": "p2p", "secret": SECRET}],
        "index": {
            "type": "redis",
            "url": url,
            "node": name,
            "flush_interval_s": args.flush_interval_s,
        },
    }


def prompt(args: argparse.Namespace, node: int, number: int) -> tuple[np.ndarray, np.ndarray]:
    layout = probe_layout(CHUNK_TOKENS, args.chunk_kib)
    return synthetic_chunks(layout, args.prompt_chunks, node * 1_000_003 + number)


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


# One node process ---------------------------------------------------------------


def run_node(args: argparse.Namespace) -> None:
    config = load_config(json.loads(Path(args.config).read_text()))
    assert config.index is not None
    name = config.index.options.node_name()
    cache = KVCache(config, probe_layout(CHUNK_TOKENS, args.chunk_kib))
    stop = threading.Event()

    def step() -> None:
        while not stop.wait(0.05):
            cache.step()

    threading.Thread(target=step, daemon=True).start()
    tier: Any = cache.manager.tiers[0]
    print(f"listening on {tier.advertised_address()}", flush=True)
    sys.stdin.readline()  # every node is up: store
    reader = FleetIndex(build_index(config.index.index_class, config.index.options), CHUNK_TOKENS)
    visible: list[float] = []
    for number in range(args.prompts):
        tokens, data = prompt(args, args.node_number, number)
        key = cache.keys(tokens)[-1]
        started = time.perf_counter()
        cache.store(tokens, data)
        while name not in reader.index.holders([key]).per_key[0]:
            time.sleep(0.001)
        visible.append(time.perf_counter() - started)
    publisher: Any = cache.manager.attachments[0]
    print(
        json.dumps({"visible_s": visible, "batches": publisher.batches, "added": publisher.added}),
        flush=True,
    )
    sys.stdin.readline()  # until the bench is done with the fleet
    stop.set()
    reader.close()
    cache.close()


# The bench ----------------------------------------------------------------------


def start_nodes(args: argparse.Namespace, url: str, workdir: Path) -> list[Any]:
    nodes = []
    for number in range(args.nodes):
        config_path = workdir / f"node{number}.json"
        config_path.write_text(json.dumps(node_config(args, url, f"node-{number}")))
        command = [sys.executable, __file__, "node", "--config", str(config_path)]
        command += ["--node-number", str(number), "--prompts", str(args.prompts)]
        command += ["--prompt-chunks", str(args.prompt_chunks), "--chunk-kib", str(args.chunk_kib)]
        command += ["--flush-interval-s", str(args.flush_interval_s)]
        log = (workdir / f"node{number}.log").open("w")
        nodes.append(
            subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        )
    return nodes


def read_line(node: Any, what: str) -> str:
    line = node.stdout.readline()
    if not line:
        raise RuntimeError(f"a node ended before {what} (see its log)")
    return str(line)


def lookups(args: argparse.Namespace, url: str, addresses: list[str], with_index: bool) -> dict:
    layout = probe_layout(CHUNK_TOKENS, args.chunk_kib)
    config: dict[str, Any] = {
        "chunk_tokens": CHUNK_TOKENS,
        "cpu_bytes_to_use": (args.lookups * args.prompt_chunks + 8) * layout.slot_bytes,
        "secondary_tiers": [{"type": "p2p", "secret": SECRET, "listen": None, "peers": addresses}],
    }
    if with_index:
        config["index"] = {"type": "redis", "url": url, "node": "fetcher"}
    rng = random.Random(7)
    found = asked = 0
    with KVCache(config, layout) as cache:
        for _ in range(args.lookups):
            node, number = rng.randrange(args.nodes), rng.randrange(args.prompts)
            tokens, _ = prompt(args, node, number)
            found += cache.cached_prefix(tokens)
            asked += len(tokens)
        tier: Any = cache.manager.tiers[0]
        batches, queries = tier.backend.query_batches, tier.backend.peer_queries
    return {
        "lookups": args.lookups,
        "tokens_found": found,
        "tokens_asked": asked,
        "lookup_batches": batches,
        "peer_queries": queries,
        "peer_queries_per_batch": queries / batches if batches else 0.0,
    }


def routing_latency(args: argparse.Namespace, url: str) -> dict[str, Any]:
    config = load_config({"chunk_tokens": CHUNK_TOKENS, "index": {"type": "redis", "url": url}})
    assert config.index is not None
    layout = probe_layout(CHUNK_TOKENS, args.chunk_kib)
    fleet = FleetIndex(
        build_index(config.index.index_class, config.index.options), CHUNK_TOKENS, layout
    )
    rng = random.Random(11)
    prompts = [
        prompt(args, rng.randrange(args.nodes), rng.randrange(args.prompts))[0]
        for _ in range(args.routing_calls)
    ]
    in_process = []
    correct = 0
    for tokens in prompts:
        started = time.perf_counter()
        scores = fleet.scores_for_tokens(tokens)
        in_process.append(time.perf_counter() - started)
        correct += bool(scores) and scores[0].best == len(tokens)
    service = RouteService(fleet, token="bench-token").start()
    host, port = service.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    over_http = []
    headers = {"Authorization": "Bearer bench-token", "Content-Type": "application/json"}
    for tokens in prompts:
        body = json.dumps({"tokens": [int(t) for t in tokens]})
        started = time.perf_counter()
        conn.request("POST", "/v1/scores", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        over_http.append(time.perf_counter() - started)
        if response.status != 200:
            raise RuntimeError(f"the route service answered {response.status}")
    conn.close()
    service.close()
    fleet.close()
    return {
        "calls": len(prompts),
        "prompt_chunks": args.prompt_chunks,
        "answers_naming_the_holder_first": correct,
        "in_process_ms": {
            "p50": 1e3 * percentile(in_process, 0.5),
            "p99": 1e3 * percentile(in_process, 0.99),
        },
        "http_ms": {
            "p50": 1e3 * percentile(over_http, 0.5),
            "p99": 1e3 * percentile(over_http, 0.99),
        },
    }


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import redis

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        baseline = int(client.info("memory")["used_memory"])
        client.config_resetstat()
        nodes = start_nodes(args, server.url, workdir)
        try:
            addresses = [read_line(n, "listening").split()[-1] for n in nodes]
            for node in nodes:
                node.stdin.write("go\n")
                node.stdin.flush()
            results = [json.loads(read_line(n, "its results")) for n in nodes]
            stats = client.info("commandstats")
            memory = int(client.info("memory")["used_memory"]) - baseline
            stored = args.nodes * args.prompts * args.prompt_chunks
            writes = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ENTRY_COMMANDS)
            chunk_keys = list(client.scan_iter(match="kvtier:index:c:*", count=1000))
            entries = sum(int(client.zcard(k)) for k in chunk_keys)
            key_bytes = sum(int(client.memory_usage(k, samples=0) or 0) for k in chunk_keys)
            with_index = lookups(args, server.url, addresses, with_index=True)
            without_index = lookups(args, server.url, addresses, with_index=False)
            routing = routing_latency(args, server.url)
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.stdin.write("done\n")
                    node.stdin.close()
            for node in nodes:
                node.wait(120)
        client.close()
    visible = [v for result in results for v in result["visible_s"]]
    return {
        "nodes": args.nodes,
        "prompts_per_node": args.prompts,
        "prompt_chunks": args.prompt_chunks,
        "chunks_stored": stored,
        "flush_interval_s": args.flush_interval_s,
        "store_to_visible_ms": {
            "p50": 1e3 * statistics.median(visible),
            "p99": 1e3 * percentile(visible, 0.99),
            "samples": len(visible),
        },
        "index_entry_writes_per_chunk": writes / stored,
        "publish_round_trips_per_chunk": sum(r["batches"] for r in results) / stored,
        "entries": entries,
        # The chunk keys alone (MEMORY USAGE), and the server's whole growth
        # (leases, client buffers and allocator slack too).
        "redis_key_bytes_per_entry": key_bytes / entries if entries else None,
        "redis_used_memory_per_entry": memory / entries if entries else None,
        "lookups_with_index": with_index,
        "lookups_without_index": without_index,
        "routing": routing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "node"))
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64, help="Prompts each node stores.")
    parser.add_argument("--prompt-chunks", type=int, default=8)
    parser.add_argument("--chunk-kib", type=int, default=4)
    parser.add_argument("--lookups", type=int, default=64)
    parser.add_argument("--routing-calls", type=int, default=500)
    parser.add_argument(
        "--flush-interval-s", type=float, default=0.05, help="The nodes' index flush_interval_s."
    )
    parser.add_argument("--quick", action="store_true", help="4 nodes, a few prompts.")
    parser.add_argument("--json", action="store_true", help="Print the results as JSON.")
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--node-number", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "node":
        run_node(args)
        return
    if args.quick:
        args.nodes, args.prompts, args.prompt_chunks = 4, 4, 4
        args.lookups, args.routing_calls = 8, 20
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-fleet-") as workdir:
        report = bench(args, Path(workdir))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    visible, routing = report["store_to_visible_ms"], report["routing"]
    print(f"{report['nodes']} nodes, {report['chunks_stored']} chunks, {report['entries']} entries")
    print(f"store -> visible: p50 {visible['p50']:.1f} ms, p99 {visible['p99']:.1f} ms")
    print(
        f"index writes per chunk: {report['index_entry_writes_per_chunk']:.2f} commands, "
        f"{report['publish_round_trips_per_chunk']:.3f} round trips"
    )
    print(
        f"Redis memory per entry: {report['redis_key_bytes_per_entry']:.0f} bytes of keys, "
        f"{report['redis_used_memory_per_entry']:.0f} bytes of used_memory growth"
    )
    for label in ("with", "without"):
        row = report[f"lookups_{label}_index"]
        print(
            f"peer queries per lookup batch {label} the index: {row['peer_queries_per_batch']:.2f} "
            f"({row['tokens_found']}/{row['tokens_asked']} tokens found)"
        )
    print(
        f"routing call: in process p50 {routing['in_process_ms']['p50']:.2f} ms "
        f"p99 {routing['in_process_ms']['p99']:.2f} ms; over HTTP p50 "
        f"{routing['http_ms']['p50']:.2f} ms p99 {routing['http_ms']['p99']:.2f} ms"
    )


if __name__ == "__main__":
    main()
