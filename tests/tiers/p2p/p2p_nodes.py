"""Peer nodes for the p2p tests: ``kvtier peer`` processes, in-process nodes and services."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import KVCache
from kvtier.cli.peer import synthetic_chunks
from kvtier.cli.probe import probe_layout
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.layout import KVLayout
from kvtier.policies.lru import LRUCachePolicy
from kvtier.primary import PrimaryTier, SlotBuffer
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.client import PeerClient
from kvtier.tiers.p2p.protocol import MessageType
from kvtier.tiers.p2p.server import PeerServer

SECRET = "kvtier-test-secret-0123456789"
CHUNK_TOKENS = 16
#: Safety net for waiting on processes and conditions; never a test's pass criterion.
SAFETY_S = 60.0


def layout_of(chunk_kib: int) -> KVLayout:
    return probe_layout(CHUNK_TOKENS, chunk_kib)


class PeerProcess:
    """A ``kvtier peer`` process holding ``chunks`` synthetic chunks made from ``seed``."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        *,
        chunk_kib: int = 64,
        chunks: int = 4,
        seed: int = 0,
        secret: str = SECRET,
        index: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """``index``: the node's ``index`` section (none by default)."""
        self.name = name
        self._pump: threading.Thread | None = None
        self.layout = layout_of(chunk_kib)
        self.tokens, self.data = synthetic_chunks(self.layout, chunks, seed)
        config = {
            "chunk_tokens": CHUNK_TOKENS,
            "cpu_bytes_to_use": (chunks + 2) * self.layout.slot_bytes,
            "secondary_tiers": [{"type": "p2p", "secret": secret, **options}],
        }
        if index is not None:
            config["index"] = index
        config_path = workdir / f"{name}.json"
        config_path.write_text(json.dumps(config))
        self.log_path = workdir / f"{name}.log"
        command = [sys.executable, "-c", "from kvtier.cli import main; main()", "peer"]
        command += [str(config_path), "--chunk-kib", str(chunk_kib)]
        command += ["--synthetic-chunks", str(chunks), "--seed", str(seed)]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            self.address = self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self.host, port = protocol.parse_address(self.address)
        self.port = port

    def _wait_listening(self) -> str:
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                lines.put(line)
            lines.put("")  # end of output

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + SAFETY_S
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line.startswith("listening on "):
                return line.split()[-1]
            if not line:
                break
        raise RuntimeError(f"peer {self.name} did not start:\n{self.log()}")

    @property
    def keys(self) -> list[ChunkKey]:
        return list(chunk_keys(self.layout.namespace, self.tokens, CHUNK_TOKENS))

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(SAFETY_S)

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(SAFETY_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            if self._pump is not None:
                self._pump.join(SAFETY_S)  # ends at the end of the output
            self.process.stdout.close()
        return self.process.returncode


@contextlib.contextmanager
def node(
    peers: list[str],
    *,
    chunk_kib: int = 64,
    slots: int = 16,
    secret: str = SECRET,
    index: dict[str, Any] | None = None,
    **options: Any,
) -> Iterator[KVCache]:
    """An in-process kvtier node (node C) whose only secondary tier is ``p2p``."""
    layout = layout_of(chunk_kib)
    config: dict[str, Any] = {
        "chunk_tokens": CHUNK_TOKENS,
        "cpu_bytes_to_use": slots * layout.slot_bytes,
        "secondary_tiers": [{"type": "p2p", "secret": secret, "peers": peers, **options}],
    }
    if index is not None:
        config["index"] = index
    with KVCache(config, layout) as cache:
        yield cache


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SAFETY_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.001)


def load_all(cache: KVCache, tokens: np.ndarray) -> np.ndarray:
    out = np.zeros((len(tokens) // CHUNK_TOKENS, cache.layout.slot_bytes), dtype=np.uint8)
    cache.load(tokens, len(tokens), out)
    return out


def connect(peer: PeerProcess) -> socket.socket:
    sock = socket.create_connection((peer.host, peer.port), timeout=SAFETY_S)
    sock.settimeout(SAFETY_S)
    return sock


def authenticate(sock: socket.socket, secret: str = SECRET) -> protocol.Hello:
    """Run the client side of the handshake on a raw socket."""
    frame = protocol.read_frame(
        sock, {MessageType.HELLO: (protocol.HELLO_BYTES, protocol.HELLO_BYTES)}
    )
    hello_body = protocol.recv_exact(sock, frame.length)
    nonce = protocol.new_nonce()
    protocol.send_message(
        sock, MessageType.AUTH, protocol.client_proof(secret.encode(), hello_body, nonce)
    )
    frame = protocol.read_frame(
        sock, {MessageType.WELCOME: (protocol.MAC_BYTES, protocol.MAC_BYTES)}
    )
    protocol.check_server_proof(
        secret.encode(), hello_body, nonce, protocol.recv_exact(sock, frame.length)
    )
    return protocol.Hello.decode(hello_body)


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes the connection."""
    received = bytearray()
    while True:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not data:
            break
        received += data
    return bytes(received)


Spawn = Callable[..., PeerProcess]


def spawner(workdir: Path) -> tuple[Spawn, list[PeerProcess]]:
    """A function starting peers in ``workdir``, and the list of those it started."""
    started: list[PeerProcess] = []

    def spawn(name: str, **kwargs: Any) -> PeerProcess:
        peer = PeerProcess(workdir, name, **kwargs)
        started.append(peer)
        return peer

    return spawn, started


class Served:
    """A primary tier of ``slots`` slots holding one chunk, and a service over it."""

    def __init__(self, chunk_kib: int, slots: int, **server_options: object) -> None:
        self.layout = layout_of(chunk_kib)
        self.buffer = SlotBuffer(slots, self.layout.slot_bytes)
        self.primary = PrimaryTier(self.buffer, LRUCachePolicy(slots))
        tokens = np.arange(self.layout.chunk_tokens * 2)
        self.key, self.other = chunk_keys(self.layout.namespace, tokens, self.layout.chunk_tokens)
        reserved = self.primary.prepare_store([self.key])
        assert reserved is not None
        self.buffer.array[reserved[self.key]] = np.arange(self.layout.slot_bytes) % 253
        self.primary.complete_store([self.key])
        self._flat = self.buffer.view.cast("B")
        size = self.layout.slot_bytes
        options: dict[str, object] = {
            "handshake_timeout": SAFETY_S,
            "request_timeout": SAFETY_S,
            "max_message_bytes": 4096,
            "max_inflight_bytes": 64 << 20,
            "max_connections": 8,
            **server_options,
        }
        self.server = PeerServer(
            address=("127.0.0.1", 0),
            slot_view=lambda i: self._flat[i * size : (i + 1) * size],
            slot_bytes=size,
            namespace=self.layout.namespace,
            secret=SECRET.encode(),
            **options,  # type: ignore[arg-type]
        )
        self.server.start(self.primary)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.server.address, timeout=SAFETY_S)
        sock.settimeout(SAFETY_S)
        return sock

    def close(self) -> None:
        self.server.close()
        self._flat.release()
        self.buffer.close()


@contextmanager
def served(chunk_kib: int = 64, slots: int = 2, **options: object) -> Iterator[Served]:
    node = Served(chunk_kib, slots, **options)
    try:
        yield node
    finally:
        node.close()


def peer_client(node: Served, **options: Any) -> PeerClient:
    settings: dict[str, Any] = {
        "secret": SECRET.encode(),
        "namespace": node.layout.namespace,
        "slot_bytes": node.layout.slot_bytes,
        "connect_timeout": SAFETY_S,
        "request_timeout": SAFETY_S,
        "retry_after": 3600.0,
        "max_message_bytes": 4096,
        **options,
    }
    return PeerClient(node.server.address, **settings)
