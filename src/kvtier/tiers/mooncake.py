"""``mooncake``: chunks in a Mooncake Store, the distributed DRAM pool of a
cluster; this process is one of its clients. Values move through one
registered buffer per worker, so no Mooncake call ever touches a primary slot.

See docs/mooncake.md, 'How it behaves'.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import ByteSize, Field, field_validator

from kvtier.errors import (
    CorruptChunkError,
    MissingDependencyError,
    describe_error,
)
from kvtier.primary.buffer import populate_now
from kvtier.tiers.addresses import parse_host_port
from kvtier.tiers.backend import (
    Backend,
    BackendRuntime,
    Exists,
    Fetched,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.remote import RemoteTier

logger = logging.getLogger(__name__)

#: Mooncake's error codes the tier tells apart (``mooncake-store/include/types.h``).
OBJECT_NOT_FOUND = -704
BUFFER_OVERFLOW = -600


class MooncakeError(ConnectionError):
    """A Mooncake call answered an error code."""

    def __init__(self, call: str, code: int) -> None:
        self.code = code
        super().__init__(f"{call} failed with Mooncake error code {code}")


class MooncakeTierOptions(RemoteTierOptions):
    master_server_address: str
    """``host:port`` of ``mooncake_master``'s RPC service."""

    metadata_server: str = "P2PHANDSHAKE"
    """Where transfer engines find each other: ``P2PHANDSHAKE`` (no metadata
    service: clients handshake directly), or an ``etcd://`` / ``http://`` URL."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transport between clients: ``tcp`` everywhere, ``rdma`` with RDMA NICs."""

    local_hostname: str = "127.0.0.1"
    """Address other clients reach this one at (this machine's address in the
    cluster network; loopback serves one machine only)."""

    device_name: str = ""
    """RDMA devices to use, comma-separated (``mlx5_0,mlx5_1``); empty with ``tcp``."""

    global_segment_size: ByteSize = Field(default=ByteSize(3355443200), ge=0)
    """Memory this process lends the pool (Mooncake's default: 3.125 GiB). Its
    chunks vanish from the pool when the process exits; 0 lends nothing and
    relies on other clients (standalone ``mooncake_client`` processes). Any
    other size must hold one stored value, or the tier fails at start."""

    local_buffer_size: ByteSize = Field(default=ByteSize(16 << 20), ge=0)
    """Mooncake's staging buffer for calls that copy; kvtier moves chunks from
    its own registered buffers, so a small one does."""

    key_prefix: str = "kvtier:"
    """Prepended to every key, before the namespace and chunk digests."""

    io_threads: int = Field(default=4, ge=1, le=64)
    """Worker threads, each running one batched call at a time (each keeps a
    registered buffer of 8 chunks). Mooncake's client polls while a transfer
    runs, keeping a core busy per thread in a call: keep this at or below the
    cores the tier can have."""

    @field_validator("master_server_address")
    @classmethod
    def _check_master(cls, address: str) -> str:
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise ValueError(
                f"not host:port ({exc}); write the master's RPC address as host:port, "
                "e.g. 10.0.0.5:50051 or [fd00::5]:50051"
            ) from None
        return address

    @field_validator("protocol", mode="before")
    @classmethod
    def _lower_protocol(cls, protocol: object) -> object:
        return protocol.lower() if isinstance(protocol, str) else protocol

    def store_location(self) -> str | None:
        return f"mooncake master {self.master_server_address}, key prefix {self.key_prefix!r}"


class MooncakeBackend(Backend[MooncakeTierOptions]):
    """Chunks as values in a Mooncake Store, moved from registered buffers."""

    Options: ClassVar[type[RemoteTierOptions]] = MooncakeTierOptions
    #: Chunks per batched call, and per worker's registered buffer.
    io_batch: ClassVar[int] = 8
    #: A value is put with its own length and read into a buffer of the
    #: largest, which reports the length it got: any shorter one fits.
    variable_payloads: ClassVar[bool] = True

    def __init__(self, options: MooncakeTierOptions, runtime: BackendRuntime) -> None:
        super().__init__(options, runtime)
        self._target = f"mooncake master {options.master_server_address}"
        master_host, _ = parse_host_port(options.master_server_address)
        if _loopback(options.local_hostname) and not _loopback(master_host):
            logger.warning(
                "tier %s: local_hostname=%s while the master is at %s: clients on other "
                "machines cannot reach this one; set local_hostname to this machine's "
                "address in the cluster",
                runtime.tier_type,
                options.local_hostname,
                master_host,
            )
        if options.global_segment_size:  # 0 lends nothing: values go to others' segments
            runtime.require_room(int(options.global_segment_size), "global_segment_size")
        #: Registered memory: (mapping, address), unregistered at close.
        self.registered: list[tuple[mmap.mmap, int]] = []
        self._registered_lock = threading.Lock()
        self._client: Any = None
        self._client = self.start_client(
            lambda: _connected(options), lambda store: store.close(), self._target
        )

    @classmethod
    def name_prefix(cls, options: MooncakeTierOptions) -> str:
        return options.key_prefix

    # Registered value buffers --------------------------------------------

    def allocate_values(self, count: int) -> list[ValueBuffer]:
        # One page-aligned mapping per worker, for a whole batch, registered
        # once: the transfer engine moves values straight out of it and into it.
        value_bytes = self.runtime.value_bytes
        count = max(count, self.io_batch)
        size = count * value_bytes
        mapping = mmap.mmap(-1, size)
        # Mapped before it is registered: left to the first reads, a fresh
        # worker's pages were faulted in as the transfer engine wrote them,
        # and a new client's first 2 MiB loads took 1.6x as long.
        populate_now(mapping)
        address = _address(memoryview(mapping))
        code = self._client.register_buffer(address, size)
        if code != 0:
            mapping.close()
            raise MooncakeError("register_buffer", code)
        with self._registered_lock:
            self.registered.append((mapping, address))
        whole = memoryview(mapping)
        return [whole[i * value_bytes : (i + 1) * value_bytes] for i in range(count)]

    # Batched calls ----------------------------------------------------------

    def exists_many(self, names: Sequence[str]) -> list[Exists]:
        codes = self._client.batch_is_exist(list(names))
        return [code == 1 if code >= 0 else MooncakeError("batch_is_exist", code) for code in codes]

    def put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        if not names:
            return []
        codes = self._client.batch_put_from(
            list(names), [_address(v) for v in values], [len(v) for v in values]
        )
        # 0 also for a name the pool holds already: chunk names are content hashes.
        return [None if code == 0 else MooncakeError("batch_put_from", code) for code in codes]

    def get_many(self, names: Sequence[str]) -> list[Fetched]:
        buffers = self.runtime.scratch_values(len(names))[: len(names)]
        sizes = [len(b) for b in buffers]
        codes = self._client.batch_get_into(list(names), [_address(b) for b in buffers], sizes)
        fetched: list[Fetched] = []
        for buffer, code in zip(buffers, codes, strict=True):
            if code >= 0:
                # Verified by the caller before a byte reaches a slot; a short
                # value (torn, or not a chunk) fails that check.
                fetched.append(memoryview(buffer)[:code])
            elif code == OBJECT_NOT_FOUND:
                fetched.append(None)
            elif code == BUFFER_OVERFLOW:
                fetched.append(CorruptChunkError("the value is larger than a framed chunk"))
            else:
                fetched.append(MooncakeError("batch_get_into", code))
        return fetched

    def delete(self, name: str) -> None:
        # force: a value read in the last seconds holds a lease that would
        # otherwise keep it (and keep serving it as corrupt) until it expires.
        codes = self._client.batch_remove([name], True)
        if codes and codes[0] not in (0, OBJECT_NOT_FOUND):
            raise MooncakeError("batch_remove", codes[0])

    def ping(self) -> None:
        # health_check() answers 0 with the master gone; an RPC to it does not.
        [code] = self._client.batch_is_exist([self.runtime.names_prefix + "ping"])
        if code < 0:
            raise MooncakeError("batch_is_exist", code)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        stuck = self.runtime.threads_in_calls()
        if stuck:
            # Closing the client under a call still in it (a frozen master)
            # could crash the process: it is left open for the process to end.
            logger.warning(
                "tier %s: %d threads still in a Mooncake call at shutdown; leaving its client open",
                self.runtime.tier_type,
                len(stuck),
            )
            return
        with self._registered_lock:
            registered, self.registered = self.registered, []
        for _, address in registered:
            client.unregister_buffer(address)
        client.close()
        # The mappings are left to the collector: a worker stuck past the
        # deadline in a call may still hold views of them.

    def describe(self) -> dict[str, object]:
        options = self.options
        return {
            "target": self._target,
            "protocol": options.protocol,
            "global_segment_size": int(options.global_segment_size),
            "key_prefix": options.key_prefix,
        }


class MooncakeTier(RemoteTier[MooncakeTierOptions]):
    """The ``mooncake`` tier: the remote-tier runtime over :class:`MooncakeBackend`."""

    backend_class = MooncakeBackend


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: where it points is not ours to resolve here


def _address(buffer: ValueBuffer) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


#: A request of coro_rpc, the master's RPC framework: magic, version,
#: serialization, message type, sequence number, function id, payload and
#: attachment lengths; and the header of its answer: magic, version, error
#: code, message type, sequence number, payload and attachment lengths.
_RPC_REQUEST = struct.Struct("<BBBBIIII")
_RPC_ANSWER = struct.Struct("<BBBBIII")
_RPC_MAGIC = 21
#: Function ids are hashes of registered names: none is 0.
_NO_FUNCTION = 0


def _master_answers(address: str, timeout_s: float) -> None:
    """Raise unless ``mooncake_master``'s RPC service answers at ``address``
    within ``timeout_s``.

    Mooncake's ``setup`` holds the interpreter lock for as long as it waits
    for a master (20 tries of 30 s against one that accepts connections but
    does not answer): no thread could give up on it, so the master must be
    known to answer first. This asks it for a function no service has, which
    a serving master answers at once with an error of the same sequence
    number; a frozen one, or another server on that port, does not.
    """
    give_up = time.monotonic() + timeout_s
    try:
        conn = socket.create_connection(parse_host_port(address), timeout=timeout_s)
    except OSError as exc:
        raise ConnectionError(
            f"mooncake_master does not listen there ({describe_error(exc)})"
        ) from exc
    sequence = int.from_bytes(os.urandom(4), "little")
    answer = b""
    with conn:
        try:
            conn.sendall(_RPC_REQUEST.pack(_RPC_MAGIC, 0, 0, 0, sequence, _NO_FUNCTION, 0, 0))
            while len(answer) < _RPC_ANSWER.size:
                conn.settimeout(max(give_up - time.monotonic(), 1e-3))
                part = conn.recv(_RPC_ANSWER.size - len(answer))
                if not part:
                    break
                answer += part
        except TimeoutError as exc:
            raise ConnectionError(
                f"mooncake_master accepts connections there but does not answer within "
                f"{timeout_s}s (frozen or overloaded, or another service on that port)"
            ) from exc
        except OSError as exc:
            raise ConnectionError(
                f"mooncake_master did not answer there ({describe_error(exc)})"
            ) from exc
    if len(answer) < _RPC_ANSWER.size:
        raise ConnectionError("the service there closed the connection without answering")
    magic, *_, echoed, _, _ = _RPC_ANSWER.unpack(answer)
    if magic != _RPC_MAGIC or echoed != sequence:
        raise ConnectionError("the service there does not answer as mooncake_master does")


def _connected(options: MooncakeTierOptions) -> Any:
    """A ``MooncakeDistributedStore`` set up for ``options`` whose master answered."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MissingDependencyError("mooncake-transfer-engine", "mooncake") from exc
    _master_answers(options.master_server_address, options.startup_timeout_s)
    store = MooncakeDistributedStore()
    code = store.setup(
        {
            "local_hostname": options.local_hostname,
            "metadata_server": options.metadata_server,
            "global_segment_size": str(int(options.global_segment_size)),
            "local_buffer_size": str(int(options.local_buffer_size)),
            "protocol": options.protocol,
            "rdma_devices": options.device_name,
            "master_server_addr": options.master_server_address,
        }
    )
    if code != 0:
        raise ConnectionError(
            f"setup failed with Mooncake error code {code}; check that mooncake_master "
            "runs there and that local_hostname is this machine's address"
        )
    try:
        [answer] = store.batch_is_exist(["kvtier:connect"])
        if answer < 0:
            raise MooncakeError("batch_is_exist", answer)
    except BaseException:
        store.close()
        raise
    return store
