"""The ``mooncake`` tier against real ``mooncake_master`` processes on loopback."""

from __future__ import annotations

import json
import mmap
import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from kvtier import KVCache
from kvtier.cli import cli
from kvtier.config import load_config
from kvtier.errors import BackendUnavailableError, ConfigError, MissingDependencyError
from kvtier.integrity import frame
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.testing.outages import recover, wait_until
from kvtier.tiers import mooncake as mooncake_module
from kvtier.tiers.base import Lookup
from kvtier.tiers.mooncake import MooncakeBackend, MooncakeTier, MooncakeTierOptions
from tests.support.cache_tiers import backend_of
from tests.support.needs import need_mooncake
from tests.support.round_trip import assert_served_after_primary_reset
from tests.support.servers import MooncakeMaster, free_port
from tests.tiers.remote.outage import on_fake_clock, outage_harness
from tests.tiers.remote.test_shared_engines import run_engine


def pool_tier(master: MooncakeMaster, key_prefix: str, **options: Any) -> dict[str, Any]:
    """A tier that lends no memory: its chunks live in the master's storage process."""
    return {**master.tier_options(key_prefix), "global_segment_size": 0, **options}


@pytest.fixture(scope="module")
def lending_master() -> Iterator[MooncakeMaster]:
    """A master with no storage of its own: the pool is what tiers lend it."""
    need_mooncake()
    with MooncakeMaster() as master:
        yield master


class TestMooncakeTierContract(TierContractTests[MooncakeTier]):
    persistent = True

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_master: MooncakeMaster, key_prefix: str) -> None:
        self.config = pool_tier(mooncake_master, key_prefix)

    def make_config(self) -> dict[str, Any]:
        return dict(self.config)


class TestMooncakeLendingTierContract(TierContractTests[MooncakeTier]):
    """Each tier lends the pool its own segment, which leaves the pool with it."""

    persistent = False

    @pytest.fixture(autouse=True)
    def _master(self, lending_master: MooncakeMaster, key_prefix: str) -> None:
        self.config = lending_master.tier_options(key_prefix)

    def make_config(self) -> dict[str, Any]:
        return dict(self.config)


def test_workers_reuse_one_registered_buffer_each(
    mooncake_master: MooncakeMaster, key_prefix: str
) -> None:
    harness = TierHarness(pool_tier(mooncake_master, key_prefix, io_threads=2), small_layout())
    tier = harness.tier
    assert isinstance(tier, MooncakeTier)
    try:
        for round_ in range(4):
            keys = harness.keys(16)
            data = harness.fill(range(16))
            assert harness.store(keys, list(range(16))).success
            harness.buffer.array[16:32] = 0
            assert harness.load(keys, list(range(16, 32))).success
            np.testing.assert_array_equal(harness.buffer.array[16:32], data, err_msg=str(round_))
        # Registered once per worker, however many jobs: no registration per call.
        assert 1 <= len(backend_of(tier, MooncakeBackend).registered) <= 2
    finally:
        harness.close()


def test_workers_map_their_buffers_before_registering_them(
    mooncake_master: MooncakeMaster, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    populated: list[mmap.mmap] = []

    def populate(region: mmap.mmap) -> bool:
        populated.append(region)
        return True

    monkeypatch.setattr(mooncake_module, "populate_now", populate)
    harness = TierHarness(pool_tier(mooncake_master, key_prefix, io_threads=2), small_layout())
    tier = harness.tier
    assert isinstance(tier, MooncakeTier)
    try:
        keys = harness.keys(8)
        harness.fill(range(8))
        assert harness.store(keys, list(range(8))).success
        backend = backend_of(tier, MooncakeBackend)
        assert backend.registered
        # Each registered mapping was populated first: a fresh worker's first
        # reads then write pages already mapped (see populate_now).
        assert {id(m) for m, _ in backend.registered} <= {id(r) for r in populated}
    finally:
        harness.close()


def test_corrupt_torn_foreign_and_oversized_values_are_never_served(
    mooncake_master: MooncakeMaster, raw_store: Any, key_prefix: str
) -> None:
    harness = TierHarness(pool_tier(mooncake_master, key_prefix), small_layout())
    tier = harness.tier
    assert isinstance(tier, MooncakeTier)
    try:
        keys = harness.keys(5)
        harness.fill(range(5))
        assert harness.store(keys, list(range(5))).success
        names = [tier.store_name(k) for k in keys]
        value = raw_store.get(names[0])
        assert len(value) == tier.value_bytes
        flipped = bytearray(value)
        flipped[-100] ^= 0x01
        foreign = small_layout(model_id="another-model")
        replacements = [
            bytes(flipped),
            raw_store.get(names[1])[:-1000],  # torn
            frame(foreign.namespace, keys[2], harness.buffer.array[2].tobytes()),
            raw_store.get(names[3]) + b"tail",  # larger than any framed chunk
        ]
        for name, replacement in zip(names, replacements, strict=False):
            assert raw_store.batch_remove([name], True) == [0]
            assert raw_store.put(name, replacement) == 0
        harness.buffer.array[8:13] = 7
        result = harness.load(keys, list(range(8, 13)))
        assert not result.success
        assert result.succeeded == frozenset([keys[4]])
        # Bad values never reached their slots, and were removed and counted.
        assert (harness.buffer.array[8:12] == 7).all()
        np.testing.assert_array_equal(harness.buffer.array[12], harness.buffer.array[4])
        assert tier.stats.corrupt_chunks == 4
        assert raw_store.batch_is_exist(names) == [0, 0, 0, 0, 1]
        assert [harness.lookup(k) for k in keys] == [Lookup.MISS] * 4 + [Lookup.HIT]
        assert tier.stats.backend_errors == 0  # corrupt values are no outage
    finally:
        harness.close()


def test_chunks_stored_by_one_engine_load_byte_exact_in_another(
    mooncake_master: MooncakeMaster, key_prefix: str, tmp_path: Path
) -> None:
    config = tmp_path / "kvtier.json"
    tier = pool_tier(mooncake_master, key_prefix)
    config.write_text(
        json.dumps({"chunk_tokens": 8, "cpu_bytes_to_use": "4MiB", "secondary_tiers": [tier]})
    )
    first = run_engine(config, "store", tmp_path / "stored.npy")
    assert first["chunks_stored"] == 6 and first["store_failures"] == 0
    second = run_engine(config, "load", tmp_path / "loaded.npy")
    assert second["chunks_loaded"] == 6 and second["hits"] >= 6
    stored = np.load(tmp_path / "stored.npy")
    loaded = np.load(tmp_path / "loaded.npy")
    assert loaded.shape == stored.shape
    np.testing.assert_array_equal(loaded, stored)


def test_master_killed_and_restarted_costs_hits_then_recovers(
    own_mooncake_master: MooncakeMaster, key_prefix: str
) -> None:
    master = own_mooncake_master
    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 16 * layout.slot_bytes,
        "secondary_tiers": [pool_tier(master, key_prefix, breaker_failures=1)],
    }
    rng = np.random.default_rng(3)
    before, during, after = (list(range(n, n + 16)) for n in (0, 100, 200))
    data = rng.integers(0, 256, (4, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        tier, clock = on_fake_clock(cache.manager.tiers[0], MooncakeTier)
        assert cache.store(before, data) == 4
        cache.drain()
        assert tier.stats.chunks_stored == 4

        master.stop()
        assert cache.store(during, data) == 4  # the primary tier takes them
        cache.drain()
        assert tier.stats.store_failures == 4 and tier.stats.backend_errors >= 1
        assert tier.backend_down and tier.stats.backend_outages == 1
        assert [m.value for m in tier.metrics() if m.name == "backend_up"] == [0.0]
        cache.manager.reset()
        assert cache.cached_prefix(before) == 0  # a miss, not an error nor a hang
        assert tier.stats.outage_skipped_lookups >= 1
        assert [check.ok for check in tier.health()] == [False]

        master.start()  # same port, empty; returns once storage is mounted again
        assert recover(tier, clock)
        assert [m.value for m in tier.metrics() if m.name == "backend_up"] == [1.0]
        cache.manager.reset()
        assert cache.cached_prefix(before) == 0  # a restarted master knows no chunk
        assert_served_after_primary_reset(cache, after, data)


def test_a_frozen_master_costs_a_deadline_then_recovers(
    own_mooncake_master: MooncakeMaster, key_prefix: str
) -> None:
    master = own_mooncake_master
    layout = small_layout()
    # Stored by a tier of its own, so the short deadline under test never cuts the setup.
    setup = TierHarness(pool_tier(master, key_prefix), layout)
    keys = setup.keys(3)
    data = setup.fill(range(3))
    assert setup.store(keys, [0, 1, 2]).success
    setup.close()
    with outage_harness(
        pool_tier(master, key_prefix, deadline_s=2.0, startup_timeout_s=1.0), MooncakeTier
    ) as (harness, tier, clock):
        try:
            master.pause()
            # Mooncake's client waits for its own RPC timeout (30 s); the job ends at the deadline.
            result = harness.load(keys, [3, 4, 5])
            assert not result.success
            assert tier.stats.deadline_misses >= 1 and tier.backend_down
            assert harness.lookup(keys[0]) is Lookup.MISS
            assert [check.ok for check in tier.health()] == [False]
            master.resume()
            assert recover(tier, clock)
            result = harness.load(keys, [3, 4, 5])
            assert result.success
            np.testing.assert_array_equal(harness.buffer.array[3:6], data)
            fresh = harness.keys(2)
            harness.fill([6, 7])
            assert harness.store(fresh, [6, 7]).success
        finally:
            master.resume()


def test_a_dead_storage_process_costs_its_chunks_never_an_outage(
    own_mooncake_master: MooncakeMaster, key_prefix: str
) -> None:
    master = own_mooncake_master
    harness = TierHarness(pool_tier(master, key_prefix), small_layout())
    tier = harness.tier
    assert isinstance(tier, MooncakeTier)
    try:
        keys = harness.keys(4)
        harness.fill(range(4))
        assert harness.store(keys, [0, 1, 2, 3]).success
        master.kill_storage()
        harness.buffer.array[4:8] = 7
        result = harness.load(keys, [4, 5, 6, 7])
        assert not result.success and not result.succeeded
        assert (harness.buffer.array[4:8] == 7).all()
        assert tier.stats.backend_errors >= 1
        # The master still answers: the tier stays in service, and the chunks
        # turn into misses once the master drops the dead client's segment.
        assert not tier.backend_down
        wait_until(
            lambda: harness.lookup(keys[0]) is Lookup.MISS,
            timeout=120,
            what="the master dropping the dead segment",
        )
        assert tier.stats.backend_outages == 0
    finally:
        harness.close()


def test_unreachable_master_fails_at_start_naming_it() -> None:
    need_mooncake()
    address = f"127.0.0.1:{free_port()}"
    options = {
        "type": "mooncake",
        "master_server_address": address,
        "global_segment_size": 0,
        "startup_timeout_s": 1.0,
    }
    with pytest.raises(BackendUnavailableError, match=address.replace(".", r"\.")) as caught:
        TierHarness(options, small_layout())
    assert "does not listen" in str(caught.value)


@pytest.mark.parametrize("segment", ["one byte", "one slot"])
def test_a_segment_below_one_value_fails_at_start_naming_it(segment: str) -> None:
    """Memory lent to the pool that cannot hold one value (a chunk and its
    header) would fail every store placed there: refused before connecting."""
    layout = small_layout()
    options = {
        "type": "mooncake",
        "master_server_address": f"127.0.0.1:{free_port()}",  # never reached
        "global_segment_size": 1 if segment == "one byte" else layout.slot_bytes,
    }
    with pytest.raises(
        ValueError, match=r"mooncake: global_segment_size=\d+ cannot hold one value"
    ):
        KVCache({"chunk_tokens": layout.chunk_tokens, "secondary_tiers": [options]}, layout)


def test_a_frozen_master_at_start_fails_it_without_holding_the_interpreter() -> None:
    """Mooncake's setup holds the interpreter lock for minutes against a master
    that accepts but never answers: the tier must find out before calling it."""
    need_mooncake()
    with MooncakeMaster() as master:
        master.pause()
        try:
            options = {**master.tier_options(), "startup_timeout_s": 0.5}
            with pytest.raises(BackendUnavailableError, match=re.escape(master.address)):
                TierHarness(options, small_layout())
        finally:
            master.resume()
        # Thawed, it serves again.
        harness = TierHarness({**master.tier_options(), "startup_timeout_s": 5.0}, small_layout())
        try:
            keys = harness.keys(2)
            harness.fill([0, 1])
            assert harness.store(keys, [0, 1]).success
        finally:
            harness.close()


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_another_service_on_the_master_port_fails_at_start(answer: bytes | None) -> None:
    """A port that accepts but stays silent, or answers in another protocol."""
    need_mooncake()
    listener = socket.create_server(("127.0.0.1", 0))
    served = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)
            if answer is not None:
                conn.sendall(answer)
            served.wait(10)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    options = {
        "type": "mooncake",
        "master_server_address": address,
        "global_segment_size": 0,
        "startup_timeout_s": 0.5,
    }
    try:
        with pytest.raises(BackendUnavailableError, match=re.escape(address)) as caught:
            TierHarness(options, small_layout())
        if answer is not None:
            assert "does not answer as mooncake_master" in str(caught.value)
    finally:
        served.set()
        server.join(10)
        listener.close()


def test_check_and_bench_run_on_the_tier(
    mooncake_master: MooncakeMaster, key_prefix: str, tmp_path: Path
) -> None:
    config = tmp_path / "kvtier.json"
    tier = pool_tier(mooncake_master, key_prefix)
    config.write_text(
        json.dumps({"chunk_tokens": 16, "cpu_bytes_to_use": "8MiB", "secondary_tiers": [tier]})
    )
    checked = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "64"])
    assert checked.exit_code == 0, checked.output
    assert "byte-exact" in checked.output
    benched = CliRunner().invoke(
        cli, ["bench", str(config), "--chunks", "8", "--chunk-kib", "64", "--json"]
    )
    assert benched.exit_code == 0, benched.output
    [entry] = json.loads(benched.output)["tiers"]
    assert entry["tier_type"] == "mooncake"
    assert entry["store"]["bytes"] == entry["load"]["bytes"] == 8 * 64 * 1024


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "master_server_address"),
        ({"master_server_address": "localhost"}, "not host:port"),
        ({"master_server_address": "http://h:50051"}, "not host:port"),
        ({"master_server_address": "h:0"}, "not host:port"),
        ({"master_server_address": "h:70000"}, "not host:port"),
        ({"master_server_address": "::1:50051"}, "IPv6 address in brackets"),
        ({"master_server_address": "bad_host!:50051"}, "not a host name"),
        ({"master_server_address": "h:1", "protocol": "udp"}, "'tcp' or 'rdma'"),
        ({"master_server_address": "h:1", "global_segment_size": "lots"}, "global_segment_size"),
        ({"master_server_address": "h:1", "local_buffer_size": -1}, "local_buffer_size"),
        ({"master_server_address": "h:1", "metadata_servr": "x"}, "'metadata_server'"),
    ],
)
def test_bad_options_fail_validation_with_the_path(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_config({"secondary_tiers": [{"type": "mooncake", **options}]})
    assert "secondary_tiers[0]" in str(caught.value)


def test_sizes_and_protocol_are_read_like_mooncakes() -> None:
    config = load_config(
        {
            "secondary_tiers": [
                {
                    "type": "mooncake",
                    "master_server_address": "10.0.0.5:50051",
                    "protocol": "RDMA",
                    "device_name": "mlx5_0",
                    "global_segment_size": "4GiB",
                    "local_buffer_size": "512MiB",
                }
            ]
        }
    )
    options = config.secondary_tiers[0].options
    assert isinstance(options, MooncakeTierOptions)
    assert options.protocol == "rdma"
    assert options.global_segment_size == 4 << 30
    assert options.local_buffer_size == 512 << 20
    assert options.metadata_server == "P2PHANDSHAKE"


def test_missing_client_library_raises_missing_dependency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(MissingDependencyError, match=r"kvtier\[mooncake\]"):
        TierHarness({"type": "mooncake", "master_server_address": "127.0.0.1:1"}, small_layout())


def test_the_example_configuration_loads() -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "mooncake.yaml"
    [tier] = load_config(example).secondary_tiers
    assert tier.tier_class is MooncakeTier
    assert isinstance(tier.options, MooncakeTierOptions)
    assert tier.options.global_segment_size == 16 << 30


def test_a_loopback_local_hostname_with_a_remote_master_is_warned_about(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.tiers.mooncake as mooncake_tier

    need_mooncake()

    def unreachable(address: str, timeout_s: float) -> None:
        raise ConnectionError(f"not dialled in tests: {address}")  # nothing leaves loopback

    monkeypatch.setattr(mooncake_tier, "_master_answers", unreachable)
    for master, warned in (("10.0.0.5", True), ("127.0.0.1", False)):
        caplog.clear()
        options = {"type": "mooncake", "master_server_address": f"{master}:50051"}
        with pytest.raises(BackendUnavailableError, match="not dialled"):
            TierHarness(options, small_layout())
        assert ("cannot reach this one" in caplog.text) is warned
