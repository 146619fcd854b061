"""Real backend servers on loopback, for tests and benchmarks of shared tiers.

Each server runs as a child process on ``127.0.0.1`` on free ports, in a
temporary directory, without persistence, and is stopped by :meth:`stop`
(or leaving its ``with`` block). Nothing here reaches beyond loopback.

* :class:`RedisServer`: Debian's ``redis-server`` binary (``apt-get install redis-server``);
* :class:`RedisClusterServers`: three such servers joined into a Redis Cluster
  with ``redis-cli --cluster create``;
* :class:`S3Server`: moto's standalone S3 server (``pip install 'moto[server]'``),
  spoken to over HTTP exactly like S3;
* :class:`MooncakeMaster`: ``mooncake_master`` from the Mooncake wheel
  (``pip install 'kvtier[mooncake]'``), optionally with a standalone storage
  process (``mooncake_client``) lending the pool memory of its own.

:meth:`stop` then :meth:`start` again keeps the port, to test outages;
:meth:`pause` and :meth:`resume` freeze the process, to test a hung server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A test server could not be started."""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


class _ExitedWhileStarting(ServerError):
    """The server process ended before it was ready (often: its port was taken)."""


def _wait(ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise _ExitedWhileStarting(
                f"{what} exited with {process.returncode} while starting; "
                f"the end of its output:\n{_tail(log)}"
            )
        with contextlib.suppress(OSError):
            if ready():
                return
        time.sleep(0.05)
    raise ServerError(f"{what} not ready after 30 s; the end of its output:\n{_tail(log)}")


def _tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])
    except OSError as exc:
        return f"(no output: {exc.strerror})"


def _redis_command(port: int, *args: str) -> bytes:
    """One command over a raw socket (no client library needed); the raw reply."""
    request = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args
    )
    with socket.create_connection((LOOPBACK, port), timeout=2) as conn:
        conn.sendall(request)
        return conn.recv(65536)


class _Process:
    """A child process that can be stopped, restarted on the same ports, frozen."""

    name = "server"

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self._started = False
        self.workdir = tempfile.mkdtemp(prefix=f"kvtier-{self.name}-")

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    #: Tries of a first start, each on fresh ports: a port found free can be
    #: taken (by a client's ephemeral port, say) before the server binds it.
    start_attempts = 5

    def _pick_ports(self) -> None:
        """Choose new ports (servers that listen override this)."""

    def start(self) -> Self:
        if self.process is not None and self.process.poll() is None:
            return self
        attempts = 1 if self._started else self.start_attempts  # a restart keeps its ports
        for attempt in range(1, attempts + 1):
            try:
                self._launch()
                break
            except _ExitedWhileStarting:
                if attempt == attempts:
                    raise
                self._pick_ports()
        self._started = True
        return self

    def pids(self) -> list[int]:
        """The processes serving clients now (benchmarks count their CPU time)."""
        return [] if self.process is None else [self.process.pid]

    def _launch(self) -> None:
        log_path = os.path.join(self.workdir, "output.log")
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                self._command(), cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT
            )
        _wait(self._ready, self.process, self.name, log_path)

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)  # a paused process cannot die
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def pause(self) -> None:
        """Freeze the server: connections stay open but nothing answers."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def redis_server_binary() -> str | None:
    """Path of ``redis-server``, or ``None`` when it is not installed."""
    return shutil.which("redis-server")


class RedisServer(_Process):
    """One ``redis-server`` without persistence; ``cluster=True`` makes it a cluster node."""

    name = "redis"

    def __init__(
        self, *, cluster: bool = False, maxmemory: str | None = None, options: Sequence[str] = ()
    ) -> None:
        """``options``: more of ``redis-server``'s, as ``--name value`` arguments."""
        binary = redis_server_binary()
        if binary is None:
            raise ServerError(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        super().__init__()
        self.binary = binary
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.options = list(options)
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.cluster_port = free_port() if self.cluster else None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """The same server through its unix socket (private to this user)."""
        return f"unix://{self.unix_socket}?db=0"

    @property
    def unix_socket(self) -> str:
        return os.path.join(self.workdir, "redis.sock")

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "--bind", LOOPBACK,
            "--port", str(self.port),
            "--unixsocket", self.unix_socket,
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.workdir,
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.maxmemory:
            command += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        command += self.options
        if self.cluster:
            command += [
                "--cluster-enabled", "yes",
                "--cluster-port", str(self.cluster_port),
                "--cluster-config-file", os.path.join(self.workdir, "nodes.conf"),
            ]  # fmt: skip
        return command

    def _ready(self) -> bool:
        return _redis_command(self.port, "PING").startswith(b"+PONG")

    def command(self, *args: str) -> bytes:
        """Run one command on this server; the raw reply."""
        return _redis_command(self.port, *args)


class RedisClusterServers:
    """A three-master Redis Cluster on loopback (no replicas)."""

    def __init__(self, nodes: int = 3) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise ServerError("redis-cli is not installed (Debian: apt-get install redis-server)")
        self.cli = cli
        self.nodes = [RedisServer(cluster=True) for _ in range(nodes)]

    @property
    def startup_nodes(self) -> list[str]:
        return [f"{LOOPBACK}:{node.port}" for node in self.nodes]

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        self._cluster("create", *self.startup_nodes, "--cluster-replicas", "0")
        self._wait_ok()
        return self

    def add_node(self, slots: int) -> RedisServer:
        """Start one more master, join it to the cluster and move ``slots``
        hash slots (their keys with them) to it from the first node."""
        node = RedisServer(cluster=True)
        self.nodes.append(node)
        node.start()
        self._cluster("add-node", f"{LOOPBACK}:{node.port}", self.startup_nodes[0])
        self._wait_ok()
        source, target = (self._id(n) for n in (self.nodes[0], node))
        self._cluster(
            "reshard",
            self.startup_nodes[0],
            *("--cluster-from", source, "--cluster-to", target),
            *("--cluster-slots", str(slots)),
        )
        self._wait_ok()
        return node

    def remove_node(self, node: RedisServer) -> None:
        """Move every hash slot of ``node`` to the others, and take it out of
        the cluster (which shuts it down)."""
        self._cluster("rebalance", self.startup_nodes[0], "--cluster-weight", f"{self._id(node)}=0")
        self.nodes.remove(node)
        self._cluster("del-node", self.startup_nodes[0], self._id(node))
        node.close()
        self._wait_ok()

    def bring_back(self, node: RedisServer) -> None:
        """Start a stopped ``node`` again (on its port, with its cluster
        configuration) or let a paused one go on, and wait until the cluster
        agrees it is back."""
        if node.process is None:
            node.start()
        else:
            node.resume()
        self._wait_ok()

    def _id(self, node: RedisServer) -> str:
        return node.command("CLUSTER", "MYID").split(b"\r\n")[1].decode()  # $40, the id

    def _cluster(self, *args: str) -> None:
        subprocess.run(
            [self.cli, "--cluster", *args, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def _wait_ok(self) -> None:
        """Until every node says the cluster is ok and agrees on its members."""

        def agreed() -> bool:
            infos = [n.command("CLUSTER", "INFO") for n in self.nodes]
            known = f"cluster_known_nodes:{len(self.nodes)}".encode()
            return all(b"cluster_state:ok" in i and known in i for i in infos)

        deadline = time.monotonic() + 30
        while not agreed():
            if time.monotonic() > deadline:
                raise ServerError("redis cluster not ok after 30 s")
            time.sleep(0.1)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3Server(_Process):
    """moto's S3 server in a child process; :meth:`create_bucket` makes buckets."""

    name = "s3"
    access_key_id = "kvtier-test"
    secret_access_key = "kvtier-test-secret"
    region = "us-east-1"

    def __init__(self) -> None:
        super().__init__()
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)]

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2) as reply:
            return bool(reply.status == 200)

    def client(self, config: Any = None) -> Any:
        """A plain boto3 S3 client for this server (``config``: a botocore ``Config``)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            config=config,
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def tier_options(self, bucket: str) -> dict[str, Any]:
        """Options of an ``obj`` tier on ``bucket`` of this server.

        The deadline is generous: moto is a Python server, slow on a loaded
        machine, and a test of anything else must not see jobs cut short.
        Tests of the deadline set their own.
        """
        return {
            "bucket": bucket,
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "addressing_style": "path",
            "deadline_s": 10,
        }


def mooncake_binary(name: str) -> str | None:
    """Path of a program the Mooncake wheel installs (``mooncake_master``,
    ``mooncake_client``): beside this Python, on ``PATH``, or in the package."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    packaged = os.path.join(os.path.dirname(mooncake.__file__), name)
    return packaged if os.access(packaged, os.X_OK) else None


class _MooncakeStorage(_Process):
    """``mooncake_client`` lending the pool ``segment_size`` bytes of its memory."""

    name = "mooncake-storage"

    def __init__(self, binary: str, master_address: str, segment_size: int) -> None:
        super().__init__()
        self.binary = binary
        self.master_address = master_address
        self.segment_size = segment_size
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()

    def _command(self) -> list[str]:
        return [
            self.binary,
            "-host", LOOPBACK,
            "-port", str(self.port),
            "-master_server_address", self.master_address,
            "-metadata_server", "P2PHANDSHAKE",
            "-protocol", "tcp",
            "-global_segment_size", str(self.segment_size),
        ]  # fmt: skip

    def _ready(self) -> bool:
        with socket.create_connection((LOOPBACK, self.port), timeout=2):
            return True


class MooncakeMaster(_Process):
    """``mooncake_master`` on loopback, its metadata in memory (P2P handshake).

    ``storage_bytes`` starts a ``mooncake_client`` lending the pool that much
    memory, so that chunks outlive the tiers that stored them (a tier lends
    its own ``global_segment_size`` otherwise). Stopping the master leaves the
    storage process running: it mounts its segment again on a restarted one.
    """

    name = "mooncake-master"

    def __init__(self, *, storage_bytes: int = 0) -> None:
        master = mooncake_binary("mooncake_master")
        storage = mooncake_binary("mooncake_client")
        if master is None or (storage_bytes and storage is None):
            raise ServerError(
                "mooncake_master/mooncake_client not found: pip install 'kvtier[mooncake]' "
                "(and, on Debian, apt-get install libibverbs1)"
            )
        super().__init__()
        self.binary = master
        self._storage_bytes = storage_bytes
        self._storage = _MooncakeStorage(str(storage), "", storage_bytes) if storage_bytes else None
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service: a tier's ``master_server_address``."""
        return f"{LOOPBACK}:{self.port}"

    def _command(self) -> list[str]:
        return [
            self.binary,
            "-rpc_address", LOOPBACK,
            "-rpc_port", str(self.port),
            "-metrics_host", LOOPBACK,
            "-metrics_port", str(self.metrics_port),
            "-enable_http_metadata_server=false",
        ]  # fmt: skip

    def _ready(self) -> bool:
        with socket.create_connection((LOOPBACK, self.port), timeout=2):
            return True

    def pids(self) -> list[int]:
        """The master's and, with storage, the process lending the pool memory."""
        return super().pids() + (self._storage.pids() if self._storage is not None else [])

    def start(self) -> Self:
        """Start (or restart) the master; with storage, return once the pool
        has its memory again (the storage process mounts it on a new master
        by itself, within a few heartbeats)."""
        super().start()
        if self._storage is None:
            return self
        try:
            self._storage.master_address = self.address
            self._storage.start()
            process = self.process
            if process is None:
                raise ServerError("mooncake_master is not running")
            _wait(
                lambda: self.capacity_bytes() >= self._storage_bytes,
                process,
                "mooncake storage mounting its segment",
                os.path.join(self._storage.workdir, "output.log"),
            )
        except BaseException:
            # Outside any ``with`` block yet: leave no process behind.
            self._storage.stop()
            self.stop()
            raise
        return self

    def kill_storage(self) -> None:
        """Kill the storage process (SIGKILL): its segment and chunks are lost."""
        if self._storage is not None and self._storage.process is not None:
            self._storage.process.kill()
            self._storage.stop()

    def capacity_bytes(self) -> int:
        """Memory the pool has: the segments its clients lend, mounted now."""
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("master_total_capacity_bytes "):
                    return int(float(line.split()[1]))
        return 0

    def close(self) -> None:
        if self._storage is not None:
            self._storage.close()
        super().close()

    def tier_options(self, key_prefix: str = "kvtier:") -> dict[str, Any]:
        """Options of a ``mooncake`` tier on this master, lending a small segment.

        The deadline is generous: a test of anything else must not see jobs
        cut short on a loaded machine. Tests of the deadline set their own.
        """
        return {
            "type": "mooncake",
            "master_server_address": self.address,
            "global_segment_size": "32MiB",
            "local_buffer_size": "4MiB",
            "key_prefix": key_prefix,
            "deadline_s": 10,
        }
