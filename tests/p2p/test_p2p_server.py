"""The peer service in this process: pinning while it sends, connection cap, clean close."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvtier.keys import ChunkKey, chunk_keys
from kvtier.policies.lru import LRUCachePolicy
from kvtier.primary import PrimaryTier, SlotBuffer
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.protocol import MessageType
from kvtier.tiers.p2p.server import PeerServer
from tests.p2p.p2p_nodes import SAFETY_S, SECRET, authenticate, layout_of, read_to_end, wait_until


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


def fetch_header(sock: socket.socket, key: ChunkKey) -> protocol.Frame:
    protocol.send_message(sock, MessageType.FETCH, key)
    return protocol.read_frame(sock, {MessageType.CHUNK: (0, 1 << 30)})


def test_a_chunk_stays_pinned_while_it_is_sent() -> None:
    # 2 MiB at 1 MiB/s: eight paced pieces, the last one about 1.75 s after the first.
    with served(chunk_kib=2048, slots=1, max_send_rate=float(1 << 20)) as node:
        with node.connect() as sock:
            authenticate(sock)
            frame = fetch_header(sock, node.key)
            assert node.primary.refcount(node.key) == 1
            # Pinned, so the only slot cannot be evicted for another chunk.
            assert node.primary.prepare_store([node.other]) is None
            body = protocol.recv_exact(sock, frame.length)
        assert len(body) == protocol.chunk_length(node.layout.slot_bytes)
        wait_until(lambda: node.primary.refcount(node.key) == 0, "the chunk to be unpinned")
        assert node.server.counters.chunks_served == 1


def test_a_missing_chunk_is_answered_missing() -> None:
    with served() as node, node.connect() as sock:
        authenticate(sock)
        protocol.send_message(sock, MessageType.FETCH, node.other)
        frame = protocol.read_frame(sock, {MessageType.MISSING: (0, 0)})
        assert frame.length == 0
        protocol.send_message(sock, MessageType.QUERY, node.key + node.other)
        frame = protocol.read_frame(sock, {MessageType.HOLDS: (2, 2)})
        assert protocol.decode_holds(protocol.recv_exact(sock, 2), 2) == [True, False]


def test_connections_beyond_the_cap_are_refused() -> None:
    with served(max_connections=1) as node:
        with node.connect() as first:
            authenticate(first)
            with node.connect() as second:
                assert read_to_end(second) == b""
        assert node.server.counters.refused == 1
        wait_until(lambda: node.server.open_connections == 0, "the first connection to end")
        with node.connect() as third:  # the first one closed: room again
            authenticate(third)


def test_close_cuts_idle_connections_and_returns() -> None:
    node = Served(64, 2)
    sock = node.connect()
    authenticate(sock)
    node.close()  # would hang if it waited for the idle connection to end by itself
    assert read_to_end(sock) == b""
    sock.close()
