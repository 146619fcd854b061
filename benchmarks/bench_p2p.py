"""Loopback throughput of ``p2p`` chunk fetches against a raw socket transfer.

Starts a ``kvtier peer`` process holding ``--chunks`` synthetic chunks of
``--chunk-mib`` MiB, then, in this process, loads them all through a ``p2p``
tier into primary slots (integrity header checked on arrival) several times.
The baseline, measured in the same run, is a bare Python socket server in
its own process answering one request byte per chunk with the same number
of bytes, received with ``recv_into`` into one preallocated buffer: the same
request/response pattern with no protocol, no authentication, no checksum.

    python benchmarks/bench_p2p.py [--chunks 64] [--chunk-mib 2] [--rounds 5]

The same fetches also run against a second peer serving over TLS (a
self-signed certificate made with ``openssl``, which must be installed).
Prints MB/s for each and the ratio p2p / raw, by median and by best round,
and the throughput ratio TLS / plain.

Measured on a 2-core VM, three runs of ``python benchmarks/bench_p2p.py --rounds 10``
(64 chunks of 2 MiB per round); loopback figures on this machine swing widely
from run to run, the raw baseline most:

==================  ===================  ===================
variant             median MB/s (ratio)  best MB/s (ratio)
==================  ===================  ===================
raw socket          1437 / 1610 / 2009   2176 / 3151 / 3201
p2p, io_threads=1   1409 / 1725 / 1678   1686 / 2317 / 1880
                    (0.98 / 1.07 / 0.84) (0.78 / 0.74 / 0.59)
p2p, io_threads=4   1443 / 1783 / 1718   1810 / 1883 / 2010
                    (1.00 / 1.11 / 0.86) (0.83 / 0.60 / 0.63)
==================  ===================  ===================

TLS, one run of ``python benchmarks/bench_p2p.py --chunks 32 --rounds 3`` on the
same VM: p2p 1437 / 1426 MB/s (io_threads 1 / 4), p2p+TLS 738 / 724 MB/s by
median round: TLS / plain 0.51 (AES-GCM in OpenSSL, one more copy per byte).

What p2p pays on top of the raw transfer: an xxh3-128 pass over each chunk
on both ends (about 0.1 ms per 2 MiB each at 22 GB/s), the integrity and
frame headers, and the hand-off to the tier's worker threads.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.cli.peer import synthetic_chunks
from kvtier.cli.probe import probe_layout
from kvtier.config import load_config
from kvtier.keys import chunk_keys
from kvtier.primary import SlotBuffer
from kvtier.specs.tiering import TieringSpec
from kvtier.tiers.base import Lookup, TransferJob
from kvtier.tiers.drive import resolve_lookup, run_job
from kvtier.tiers.factory import SecondaryTierFactory

SECRET = "bench-secret-0123456789abcdef"
CHUNK_TOKENS = 256

RAW_SERVER = """
import socket, sys
payload = bytes(range(256)) * (int(sys.argv[1]) // 256)
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while conn.recv(1):
            conn.sendall(payload)
"""


def raw_round(sock: socket.socket, chunks: int, chunk_bytes: int, out: memoryview) -> float:
    """Seconds to fetch ``chunks`` chunks over one raw connection, one request each."""
    started = time.perf_counter()
    for index in range(chunks):
        sock.sendall(b"r")
        view = out[index * chunk_bytes : (index + 1) * chunk_bytes]
        filled = 0
        while filled < chunk_bytes:
            got = sock.recv_into(view[filled:])
            if not got:
                raise ConnectionError("raw server closed the connection")
            filled += got
    return time.perf_counter() - started


def make_certificate(workdir: Path) -> dict[str, object]:
    """A self-signed certificate for 127.0.0.1, made as docs/p2p.md shows; the server's options."""
    cert, key = workdir / "peer.pem", workdir / "peer.key"
    command = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
    command += " -subj /CN=kvtier-peer -addext subjectAltName=IP:127.0.0.1"
    subprocess.run(
        [*command.split(), "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return {"tls": True, "tls_cert_file": str(cert), "tls_key_file": str(key)}


def start_peer(
    workdir: Path, chunks: int, chunk_kib: int, tls: dict[str, object]
) -> tuple[subprocess.Popen[str], str]:
    layout = probe_layout(CHUNK_TOKENS, chunk_kib)
    config = {
        "chunk_tokens": CHUNK_TOKENS,
        "cpu_bytes_to_use": (chunks + 1) * layout.slot_bytes,
        "secondary_tiers": [{"type": "p2p", "secret": SECRET, **tls}],
    }
    path = workdir / ("peer-tls.json" if tls else "peer.json")
    path.write_text(json.dumps(config))
    command = [sys.executable, "-c", "from kvtier.cli import main; main()", "peer", str(path)]
    command += ["--chunk-kib", str(chunk_kib), "--synthetic-chunks", str(chunks), "--seed", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("listening on "):
            return process, line.split()[-1]
    raise RuntimeError("kvtier peer did not start")


class P2PClient:
    """A lone ``p2p`` tier over its own primary slots, fetching from one peer."""

    def __init__(
        self,
        address: str,
        chunks: int,
        chunk_kib: int,
        io_threads: int,
        tls: dict[str, object],
    ) -> None:
        layout = probe_layout(CHUNK_TOKENS, chunk_kib)
        tokens, self.expected = synthetic_chunks(layout, chunks, seed=1)
        self.keys = chunk_keys(layout.namespace, tokens, CHUNK_TOKENS)
        entry: dict[str, object] = {
            "type": "p2p",
            "secret": SECRET,
            "listen": None,
            "peers": [address],
            "io_threads": io_threads,
        }
        if tls:  # trusts the server's self-signed certificate
            entry.update(tls=True, tls_ca_file=tls["tls_cert_file"])
        config = load_config(
            {
                "chunk_tokens": CHUNK_TOKENS,
                "cpu_bytes_to_use": chunks * layout.slot_bytes,
                "secondary_tiers": [entry],
            }
        )
        self.buffer = SlotBuffer(chunks, layout.slot_bytes)
        self.tier = SecondaryTierFactory.create_secondary_tier(
            config.secondary_tiers[0].as_dict(), self.buffer.view, TieringSpec(config, layout)
        )

    def round(self) -> float:
        """Seconds to load every chunk (after an untimed lookup), checked byte-exact."""
        self.buffer.array[:] = 0
        if any(resolve_lookup(self.tier, key) is not Lookup.HIT for key in self.keys):
            raise RuntimeError("the peer does not hold its synthetic chunks")
        job = TransferJob(tuple(self.keys), tuple(range(len(self.keys))))
        started = time.perf_counter()
        result = run_job(self.tier, job, loading=True, timeout=600)
        seconds = time.perf_counter() - started
        if not result.success or not np.array_equal(self.buffer.array, self.expected):
            raise RuntimeError("p2p load was not byte-exact")
        return seconds

    def close(self) -> None:
        self.tier.shutdown()
        self.buffer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    chunk_kib = args.chunk_mib * 1024
    chunk_bytes = chunk_kib * 1024
    total = args.chunks * chunk_bytes

    raw = subprocess.Popen(
        [sys.executable, "-c", RAW_SERVER, str(chunk_bytes)], stdout=subprocess.PIPE, text=True
    )
    with tempfile.TemporaryDirectory() as workdir:
        tls = make_certificate(Path(workdir))
        peer, address = start_peer(Path(workdir), args.chunks, chunk_kib, {})
        tls_peer, tls_address = start_peer(Path(workdir), args.chunks, chunk_kib, tls)
        try:
            assert raw.stdout is not None
            port = int(raw.stdout.readline())
            # The baseline receives into mapped memory too, as the primary slots are.
            sink = SlotBuffer(args.chunks, chunk_bytes)
            clients = {
                f"p2p{suffix}, io_threads={threads}": P2PClient(
                    where, args.chunks, chunk_kib, threads, options
                )
                for suffix, where, options in (("", address, {}), ("+TLS", tls_address, tls))
                for threads in (1, 4)
            }
            results: dict[str, list[float]] = {"raw socket, 1 connection": []}
            results.update({name: [] for name in clients})
            raw_sock = socket.create_connection(("127.0.0.1", port))
            raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sink_view = sink.view.cast("B")
            # Round 0 warms every connection up (TCP buffers autotune) and is not counted;
            # rounds are interleaved, so drift in the machine's load hits every variant alike.
            for round_index in range(args.rounds + 1):
                raw_s = raw_round(raw_sock, args.chunks, chunk_bytes, sink_view)
                p2p_s = {name: client.round() for name, client in clients.items()}
                if round_index:
                    results["raw socket, 1 connection"].append(raw_s)
                    for name, seconds in p2p_s.items():
                        results[name].append(seconds)
            raw_sock.close()
            sink_view.release()
            for client in clients.values():
                client.close()
            sink.close()
        finally:
            for process in (peer, tls_peer, raw):
                process.terminate()
                process.wait()

    print(
        f"{args.chunks} chunks of {args.chunk_mib} MiB ({total / 2**20:.0f} MiB) per round, "
        f"{args.rounds} rounds after a warm-up; MB/s (ratio to raw) by median and by best round"
    )
    raw_rounds = results["raw socket, 1 connection"]
    for name, rounds in results.items():
        median = statistics.median(raw_rounds) / statistics.median(rounds)
        best = min(raw_rounds) / min(rounds)
        print(
            f"  {name:26s} median {total / statistics.median(rounds) / 1e6:6.0f} ({median:4.2f})"
            f"   best {total / min(rounds) / 1e6:6.0f} ({best:4.2f})"
        )
    print("TLS / plain, by median round:")
    for threads in (1, 4):
        plain = statistics.median(results[f"p2p, io_threads={threads}"])
        encrypted = statistics.median(results[f"p2p+TLS, io_threads={threads}"])
        print(f"  io_threads={threads}: {plain / encrypted:4.2f}")


if __name__ == "__main__":
    main()
