"""Fixtures shared by kvtier's tests.

The shared-tier tests talk to real servers (redis-server, a Redis Cluster,
moto's S3 server, a Mooncake master) on loopback, started and stopped here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.testing import restore_registries
from kvtier.tiers.fs import io as fs_io
from tests.support.needs import need_mooncake, need_redis_server, need_s3_server
from tests.support.servers import MooncakeMaster, RedisClusterServers, RedisServer, S3Server


@pytest.fixture(params=sorted(fs_io.IMPLEMENTATIONS))
def chunk_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once per implementation of the fs tier's chunk-file I/O
    (compiled where kvtier was built with a C compiler, and Python)."""
    implementation = fs_io.IMPLEMENTATIONS[request.param]
    monkeypatch.setattr(fs_io, "_store_file", implementation.store)
    monkeypatch.setattr(fs_io, "_load_file", implementation.load)
    monkeypatch.setattr(fs_io, "_complete_files", implementation.complete)
    monkeypatch.setattr(fs_io, "_load_files", implementation.load_all)
    return str(request.param)


@pytest.fixture
def registries() -> Iterator[None]:
    """Let a test register plugins (and trip once-per-process warnings) in isolation."""
    with restore_registries():
        yield


#: Memory the standalone storage process of the shared Mooncake pool lends it.
MOONCAKE_POOL_BYTES = 256 << 20


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A Mooncake master with a storage process of its own: chunks outlive tiers."""
    need_mooncake()
    with MooncakeMaster(storage_bytes=MOONCAKE_POOL_BYTES) as master:
        yield master


@pytest.fixture
def own_mooncake_master() -> Iterator[MooncakeMaster]:
    """A Mooncake master (and storage process) of this test's own, free to
    stop, restart or freeze."""
    need_mooncake()
    with MooncakeMaster(storage_bytes=64 << 20) as master:
        yield master


@pytest.fixture
def raw_store(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client of the shared pool, lending it nothing."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": "0",
            "local_buffer_size": str(16 << 20),
            "protocol": "tcp",
            "rdma_devices": "",
            "master_server_addr": mooncake_master.address,
        }
    )
    assert code == 0
    yield store
    store.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    need_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    need_redis_server()
    with RedisClusterServers() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    need_s3_server()
    with S3Server() as server:
        yield server


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A server of this test's own, free to stop, restart or freeze."""
    need_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_s3_server() -> Iterator[S3Server]:
    """An S3 server of this test's own, free to stop, restart or freeze."""
    need_s3_server()
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new empty bucket on the shared S3 server."""
    return s3_server.create_bucket(f"kvtier-{uuid.uuid4().hex[:16]}")


@pytest.fixture
def key_prefix() -> str:
    """A prefix of its own per test, so tests sharing a server never see each other's chunks."""
    return f"t{uuid.uuid4().hex[:12]}:"
