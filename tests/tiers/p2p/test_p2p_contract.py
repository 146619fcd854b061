"""The secondary tier contract, checked the way it applies to a pull-only tier.

``TierContractTests`` stores chunks through the tier under test and expects to
load them back. A ``p2p`` tier's stores deliberately send nothing (peers pull;
nobody pushes), so that shape cannot hold. The same promises are checked here
with the chunks held by a peer process: lookups answer HIT/MISS for what the
peers hold, loads are byte-exact and report partial success, results come
once, stores succeed without effect, options are validated, shutdown is
idempotent, and bytes that fail verification never count as loaded.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrity import pack_header
from kvtier.policies.lru import LRUCachePolicy
from kvtier.primary import PrimaryTier, SlotBuffer
from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup, TransferJob
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p import server as server_module
from kvtier.tiers.p2p.protocol import format_address
from kvtier.tiers.p2p.server import PeerServer
from tests.tiers.p2p.p2p_nodes import SECRET, PeerProcess, layout_of, node, spawner, wait_until


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    spawn, started = spawner(tmp_path_factory.mktemp("contract"))
    try:
        yield spawn("H", seed=3, chunks=4)
    finally:
        for peer in started:
            peer.stop()


def client_config(*peers: str) -> dict[str, object]:
    return {"type": "p2p", "secret": SECRET, "listen": None, "peers": list(peers)}


@pytest.fixture
def harness(holder: PeerProcess) -> Iterator[TierHarness]:
    harness = TierHarness(client_config(holder.address), holder.layout, num_slots=16)
    yield harness
    harness.close()


def test_lookup_then_load_is_byte_exact(harness: TierHarness, holder: PeerProcess) -> None:
    assert [harness.lookup(k) for k in holder.keys] == [Lookup.HIT] * 4
    loaded = harness.load(holder.keys, [4, 5, 6, 7])
    assert loaded.success and loaded.succeeded == frozenset(holder.keys)
    assert loaded.nbytes == 4 * holder.layout.slot_bytes
    np.testing.assert_array_equal(harness.buffer.array[4:8], holder.data)


def test_load_without_a_lookup_first_asks_the_peers(
    harness: TierHarness, holder: PeerProcess
) -> None:
    assert harness.load(holder.keys[:1], [0]).success
    np.testing.assert_array_equal(harness.buffer.array[0], holder.data[0])


def test_unknown_key_is_a_miss(harness: TierHarness) -> None:
    assert harness.lookup(harness.keys(1)[0]) is Lookup.MISS


def test_partial_load_reports_the_keys_that_made_it(
    harness: TierHarness, holder: PeerProcess
) -> None:
    absent = harness.keys(1)[0]
    result = harness.load([holder.keys[0], absent], [1, 2])
    assert not result.success
    assert result.succeeded == frozenset([holder.keys[0]])
    assert result.nbytes == holder.layout.slot_bytes
    np.testing.assert_array_equal(harness.buffer.array[1], holder.data[0])
    assert harness.tier.stats.corrupt_chunks == 0


def test_stores_succeed_and_send_nothing(harness: TierHarness, holder: PeerProcess) -> None:
    keys = harness.keys(2)
    harness.fill([0, 1])
    stored = harness.store(keys, [0, 1])
    assert stored.success and stored.succeeded == frozenset(keys) and stored.nbytes == 0
    # Nothing was pushed: neither the holder nor this tier can serve them.
    assert [harness.lookup(k) for k in keys] == [Lookup.MISS] * 2


def test_each_result_is_reported_once(harness: TierHarness, holder: PeerProcess) -> None:
    harness.tier.submit_load(TransferJob(tuple(holder.keys), tuple(range(4))))
    harness.tier.drain()
    results = harness.tier.get_finished_jobs()
    assert len(results) == 1 and results[0].success
    assert harness.tier.get_finished_jobs() == []


def test_rejects_unknown_options() -> None:
    with pytest.raises(ConfigError, match="no_such_option_xyz"):
        load_config({"secondary_tiers": [{**client_config(), "no_such_option_xyz": 1}]})


def test_shutdown_is_idempotent(holder: PeerProcess) -> None:
    harness = TierHarness(client_config(holder.address), holder.layout)
    harness.tier.shutdown()
    harness.tier.shutdown()
    harness.buffer.close()


def test_a_peer_with_another_layout_shares_nothing(holder: PeerProcess) -> None:
    other = layout_of(32)  # half the holder's chunk size: another namespace
    harness = TierHarness(client_config(holder.address), other)
    try:
        assert harness.lookup(harness.keys(1)[0]) is Lookup.MISS
        assert not harness.load(harness.keys(1), [0]).success
    finally:
        harness.close()


def test_shutdown_stops_the_peer_service(holder: PeerProcess) -> None:
    with node([holder.address]) as c:
        address = c.manager.tiers[0].describe()["listen"]
        assert isinstance(address, str)
        assert c.cached_prefix(holder.tokens) == len(holder.tokens)
    harness = TierHarness(client_config(address), holder.layout)
    try:
        assert harness.lookup(holder.keys[0]) is Lookup.MISS  # nobody listens any more
    finally:
        harness.close()


def test_a_corrupt_chunk_from_a_peer_is_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = layout_of(64)
    buffer = SlotBuffer(2, layout.slot_bytes)
    primary = PrimaryTier(buffer, LRUCachePolicy(2))
    harness = TierHarness(client_config(), layout)  # only for its keys and random bytes
    key = harness.keys(1)[0]
    slot = primary.prepare_store([key])
    assert slot is not None
    buffer.array[slot[key]] = np.arange(layout.slot_bytes) % 251
    primary.complete_store([key])
    # A peer whose headers describe other bytes than the ones it sends.
    monkeypatch.setattr(
        server_module,
        "pack_header",
        lambda namespace, k, payload: pack_header(namespace, k, bytes(len(payload))),
    )
    flat = buffer.view.cast("B")
    server = PeerServer(
        address=("127.0.0.1", 0),
        slot_view=lambda i: flat[i * layout.slot_bytes : (i + 1) * layout.slot_bytes],
        slot_bytes=layout.slot_bytes,
        namespace=layout.namespace,
        secret=SECRET.encode(),
        handshake_timeout=5.0,
        request_timeout=5.0,
        max_message_bytes=4096,
        max_inflight_bytes=1 << 20,
        max_connections=4,
    )
    server.start(primary)
    harness.close()
    harness = TierHarness(client_config(format_address(*server.address)), layout)
    try:
        assert harness.lookup(key) is Lookup.HIT
        result = harness.load([key], [0])
        assert not result.success and result.succeeded == frozenset()
        assert harness.tier.stats.corrupt_chunks == 1
        wait_until(lambda: server.counters.chunks_served == 1, "the send to be counted")
    finally:
        harness.close()
        server.close()
        flat.release()
        buffer.close()


def test_a_taken_listen_address_stops_the_node_from_starting(holder: PeerProcess) -> None:
    with pytest.raises(OSError, match=f"cannot listen on {holder.address}"):
        TierHarness({**client_config(), "listen": holder.address}, holder.layout)


def test_a_peer_service_never_attached_is_closed_with_its_tier(holder: PeerProcess) -> None:
    harness = TierHarness({**client_config(), "listen": "127.0.0.1:0"}, holder.layout)
    address = harness.tier.describe()["listen"]
    harness.close()
    assert isinstance(address, str)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(protocol.parse_address(address), timeout=5).close()
