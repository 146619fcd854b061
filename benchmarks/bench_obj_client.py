"""What one ``GET`` costs the caller's CPU through the ``obj`` tier's boto3
client, against a boto3 client made as boto3's documentation makes one.

On moto's S3 server on loopback (``tests/support/servers.py``), both clients
read the same objects in turn, round after round, one thread each: the
tier's client as ``ObjectStoreBackend`` builds it, and the raw boto3 client
``bench_cold.py --tier obj`` measures against (``bench_shared_tiers.RawS3``),
with the same connection pool and checksum settings. Per object size: the
CPU time of the calling thread per ``GET`` (the body read whole), the median
and the least over ``--rounds``, and tier ÷ boto3 round by round, its median
and least (below 1: the tier's client costs less). Both pay alike for
moto's closing of every connection.

Run: ``python benchmarks/bench_obj_client.py [--rounds 12] [--json]``;
``--quick``: 2 rounds of 4 objects.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench_shared_tiers import RawS3  # puts the checkout on sys.path
from tests.support.servers import S3Server

SIZES = (256 << 10, 2 << 20)


def clients(server: S3Server, bucket: str) -> dict[str, Any]:
    """The tier's client and the raw one ``bench_cold.py --tier obj`` measures
    against, with the same pool and checksums."""
    from kvtier.tiers.obj import ObjectStoreTierOptions, _connect

    _, tier_client = _connect(ObjectStoreTierOptions(**server.tier_options(bucket), io_threads=4))
    return {"tier": tier_client, "boto3": RawS3(server, bucket, threads=4).client}


def cpu_per_get_ms(client: Any, bucket: str, names: list[str]) -> float:
    started = time.thread_time()
    for name in names:
        client.get_object(Bucket=bucket, Key=name)["Body"].read()
    return (time.thread_time() - started) / len(names) * 1e3


def measure(objects: int, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with S3Server() as server:
        bucket = server.create_bucket("kvtier-bench-client")
        made = clients(server, bucket)
        for size in SIZES:
            stored = {f"object-{size}-{i}": os.urandom(size) for i in range(objects)}
            names = list(stored)
            for name, value in stored.items():
                made["boto3"].put_object(Bucket=bucket, Key=name, Body=value)
            for system, client in made.items():  # each reads what was stored, once untimed
                for name, value in stored.items():
                    if client.get_object(Bucket=bucket, Key=name)["Body"].read() != value:
                        raise SystemExit(f"{system}'s client read {name} wrong")
            times: dict[str, list[float]] = {system: [] for system in made}
            for index in range(rounds):
                # Taking turns at going first: neither always meets a fresh server.
                order = list(made) if index % 2 == 0 else list(reversed(made))
                for system in order:
                    times[system].append(cpu_per_get_ms(made[system], bucket, names))
            figures = {
                system: {"median_ms": statistics.median(t), "least_ms": min(t)}
                for system, t in times.items()
            }
            # Per round: the two clients read in the same minute, on the same server.
            ratios = [t / b for t, b in zip(times["tier"], times["boto3"], strict=True)]
            figures["tier_over_boto3"] = {"median": statistics.median(ratios), "least": min(ratios)}
            results[str(size)] = figures
        for client in made.values():
            client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--objects", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.objects = 2, 4
    if args.rounds < 1 or args.objects < 1:
        raise SystemExit("--rounds and --objects must be at least 1")
    results = measure(args.objects, args.rounds)
    if args.json:
        print(json.dumps(results))
        return
    print(f"CPU per GET of the calling thread, ms: median and least of {args.rounds} rounds")
    for size, figures in results.items():
        ratio = figures["tier_over_boto3"]
        print(
            f"{int(size) >> 10:>5} KiB  tier {figures['tier']['median_ms']:.3f} "
            f"({figures['tier']['least_ms']:.3f})  boto3 {figures['boto3']['median_ms']:.3f} "
            f"({figures['boto3']['least_ms']:.3f})  tier/boto3 {ratio['median']:.2f}x "
            f"({ratio['least']:.2f}x)"
        )


if __name__ == "__main__":
    main()
