"""The ``p2p`` tier's backend: asks peers which chunks they hold, fetches
them straight into primary slots, and runs this node's peer service.

A :class:`~kvtier.tiers.local.LocalBackend` run by
:class:`~kvtier.tiers.p2p.tier.PeerTier`. Stores send nothing: peers pull.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, ClassVar

from kvtier.errors import CorruptChunkError, KVTierError
from kvtier.keys import ChunkKey
from kvtier.tiers.addresses import is_loopback
from kvtier.tiers.base import HealthCheck, HolderIndex, TierMetric
from kvtier.tiers.local import ItemErrors, LocalBackend, LocalRuntime
from kvtier.tiers.options import ThreadedTierOptions
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.client import CONNECT_ATTEMPTS, PeerClient
from kvtier.tiers.p2p.counters import ClientCounters
from kvtier.tiers.p2p.flow import ByteBudget
from kvtier.tiers.p2p.options import PeerTierOptions
from kvtier.tiers.p2p.server import PeerServer

if TYPE_CHECKING:
    from kvtier.primary import PrimaryTier

logger = logging.getLogger(__name__)

#: Keys whose holders are remembered between a lookup and its load.
_HOLDERS_REMEMBERED = 65536


class PeerBackend(LocalBackend[PeerTierOptions]):
    """Clients of the configured peers, and the service serving this node's chunks."""

    Options: ClassVar[type[ThreadedTierOptions]] = PeerTierOptions

    def __init__(self, options: PeerTierOptions, runtime: LocalRuntime) -> None:
        super().__init__(options, runtime)
        self._secret = options.secret.get_secret_value().encode()
        tls = options.tls_settings()
        self._client_counters = ClientCounters()
        client_tls = tls.client_context() if tls else None
        self._server_tls = tls.server_context() if tls and options.listen is not None else None
        self._clients = [
            PeerClient(
                protocol.parse_address(peer),
                secret=self._secret,
                namespace=runtime.namespace,
                slot_bytes=runtime.slot_bytes,
                connect_timeout=options.connect_timeout_s,
                request_timeout=options.request_timeout_s,
                retry_after=options.retry_after_s,
                max_message_bytes=int(options.max_message_bytes),
                idle_timeout=options.idle_timeout_s,
                tls=client_tls,
                counters=self._client_counters,
            )
            for peer in options.peers
        ]
        # Lookups of one batch reach every peer at once.
        self._fanout = ThreadPoolExecutor(
            max_workers=max(1, len(self._clients)) * options.io_threads,
            thread_name_prefix=f"kvtier-{runtime.tier_type}-query",
        )
        self._budget = ByteBudget(int(options.max_inflight_bytes))
        self._holders: OrderedDict[ChunkKey, list[PeerClient]] = OrderedDict()
        self._holders_lock = threading.Lock()
        self._index: HolderIndex | None = None
        #: Lookup batches; queries sent to peers; batches the index steered; batches it failed.
        self.query_batches = 0
        self.peer_queries = 0
        self.index_batches = 0
        self.index_fallbacks = 0
        # Bound now, so a bad or taken address stops the node's startup; serving
        # starts when the manager attaches the node's primary tier (serve()).
        self._server: PeerServer | None = None
        if options.listen is not None:
            self._server = self._bind(options.listen)

    def _bind(self, listen: str) -> PeerServer:
        host, port = protocol.parse_address(listen, allow_port_zero=True)
        options = self.options
        server = PeerServer(
            address=(host, port),
            slot_view=self.runtime.slot,
            slot_bytes=self.runtime.slot_bytes,
            namespace=self.runtime.namespace,
            secret=self._secret,
            handshake_timeout=options.handshake_timeout_s,
            request_timeout=options.request_timeout_s,
            idle_timeout=options.idle_timeout_s,
            max_message_bytes=int(options.max_message_bytes),
            max_inflight_bytes=int(options.max_inflight_bytes),
            max_connections=options.max_connections,
            max_handshakes=options.max_handshakes,
            max_handshakes_per_source=options.handshakes_per_source,
            max_send_rate=float(options.max_send_rate or 0) or None,
            tls=self._server_tls,
        )
        where = protocol.format_address(*server.address)
        if is_loopback(host) or self._server_tls is not None:
            logger.info(
                "p2p: peer service bound to %s%s", where, " (TLS)" if self._server_tls else ""
            )
        else:
            logger.warning(
                "p2p: peer service bound to %s, reachable beyond this machine; "
                "connections are authenticated but not encrypted (see the tls option)",
                where,
            )
        return server

    # The node's own service ---------------------------------------------------

    @property
    def address(self) -> tuple[str, int] | None:
        """Where this node's peer service listens, once bound."""
        return self._server.address if self._server else None

    def advertised_address(self) -> str | None:
        """The bound listen address, unless it is a wildcard (then the index's
        ``p2p_address`` must say where peers reach this node)."""
        if self._server is None:
            return None
        host, port = self._server.address
        if ipaddress.ip_address(host).is_unspecified:
            return None
        return protocol.format_address(host, port)

    def serve(self, primary: PrimaryTier) -> None:
        """Start serving ``primary`` on the bound listen address (once)."""
        if self._server is not None and not self._server.serving:
            self._server.start(primary)

    def use_holder_index(self, index: HolderIndex) -> None:
        """Ask only the peers ``index`` names as holders (see :meth:`_steered`)."""
        self._index = index

    # Lookups and loads ----------------------------------------------------------

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        holders = self._ask_peers(keys)
        with self._holders_lock:
            for key, peers in zip(keys, holders, strict=True):
                if peers:
                    self._holders[key] = peers
                    self._holders.move_to_end(key)
            while len(self._holders) > _HOLDERS_REMEMBERED:
                self._holders.popitem(last=False)
        return [bool(peers) for peers in holders]

    def _ask_peers(self, keys: Sequence[ChunkKey]) -> list[list[PeerClient]]:
        """For each key, the reachable peers that say they hold it."""
        holders: list[list[PeerClient]] = [[] for _ in keys]
        live = [client for client in self._clients if client.available()]
        if not live or not keys:
            return holders
        live = self._steered(keys, live)
        self.query_batches += 1
        self.peer_queries += len(live)
        futures = {self._fanout.submit(client.query, keys): client for client in live}
        connecting = CONNECT_ATTEMPTS * self.options.connect_timeout_s
        done, _ = wait(futures, timeout=connecting + self.options.request_timeout_s)
        for future in done:
            if future.exception() is not None:
                continue  # the client logged it and sits the peer out
            for index, held in enumerate(future.result()):
                if held:
                    holders[index].append(futures[future])
        return holders

    def _steered(self, keys: Sequence[ChunkKey], live: list[PeerClient]) -> list[PeerClient]:
        """The peers worth asking about ``keys``: with an index, the
        ``index_fanout`` configured peers it names as holding most of them
        (none if it names none); without one, or when it fails, all of ``live``.

        Only configured peers are ever asked: an entry naming another address,
        forged or stale, is ignored. What an asked peer says still decides.
        """
        if self._index is None:
            return live
        try:
            named = self._index.peers_holding(keys)
        except Exception as exc:
            self.index_fallbacks += 1
            logger.debug("p2p: the cluster index did not answer (%r); asking every peer", exc)
            return live
        self.index_batches += 1
        reachable = {client.name: client for client in live}
        votes: Counter[str] = Counter()
        for addresses in named:
            for address in addresses:
                name = _normalized(address)
                if name in reachable:
                    votes[name] += 1
        return [reachable[name] for name, _ in votes.most_common(self.options.index_fanout)]

    def load_many(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> ItemErrors:
        return self.each(self._fetch, keys, outs)

    def _fetch(self, key: ChunkKey, out: memoryview) -> None:
        """Fetch ``key`` from a peer that holds it, straight into ``out``.

        ``out`` is a slot reserved for this load: bytes that fail
        verification may be left in it, but the key is then reported failed
        and the manager frees the slot unread. A corrupt answer is the
        sending peer's fault, not a stored chunk's: counted here, and the
        next holder is asked.
        """
        with self._holders_lock:
            holders = self._holders.pop(key, None)
        if holders is None:  # loaded without a lookup first
            holders = self._ask_peers([key])[0]
        length = protocol.chunk_length(self.runtime.slot_bytes)
        for client in holders:
            if not client.available():
                continue
            try:
                with self._budget.hold(length, timeout=self.options.request_timeout_s):
                    if client.fetch_into(key, out):
                        return
            except CorruptChunkError as exc:
                logger.warning(
                    "p2p: peer %s sent a corrupt chunk %s: %s", client.name, key.hex()[:16], exc
                )
                self.runtime.count(corrupt_chunks=1)
            except (OSError, KVTierError) as exc:
                logger.debug("p2p: %s from %s failed: %r", key.hex()[:16], client.name, exc)
        raise LookupError(f"no peer delivered chunk {key.hex()[:16]}")

    def store_many(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> ItemErrors:
        """Never called: the tier finishes store jobs without I/O (peers pull).
        Were it called, each chunk fails rather than claim a store that did not happen."""
        return [NotImplementedError("p2p stores nothing: peers pull chunks")] * len(keys)

    # Lifecycle and reports --------------------------------------------------------

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._fanout.shutdown(wait=False, cancel_futures=True)
        for client in self._clients:
            client.close()

    def health(self) -> Sequence[HealthCheck]:
        """Whether the service listens, and whether each peer answers and authenticates."""
        if self._server is None:
            checks = [HealthCheck("listen", True, "serves nothing (listen: null)")]
        else:
            where = protocol.format_address(*self._server.address)
            state = "serving" if self._server.serving else "bound, not serving yet"
            checks = [HealthCheck("listen", True, f"{state} on {where}")]
        for client in self._clients:
            try:
                client.probe()
            except (OSError, KVTierError) as exc:
                checks.append(HealthCheck(f"peer {client.name}", False, str(exc)))
            else:
                checks.append(HealthCheck(f"peer {client.name}", True, "answers, authenticated"))
        return checks

    def metrics(self) -> Sequence[TierMetric]:
        reachable = sum(client.available() for client in self._clients)
        values = [
            TierMetric("peers", len(self._clients), "Peers this node fetches from."),
            TierMetric("peers_reachable", reachable, "Peers not sitting out a failure."),
            TierMetric(
                "peer_query_batches",
                self.query_batches,
                "Lookup batches that asked peers.",
                counter=True,
            ),
            TierMetric(
                "peer_queries", self.peer_queries, "Lookup queries sent to peers.", counter=True
            ),
            TierMetric(
                "peer_index_batches",
                self.index_batches,
                "Lookup batches whose peers the cluster index chose.",
                counter=True,
            ),
            TierMetric(
                "peer_index_fallbacks",
                self.index_fallbacks,
                "Lookup batches that asked every peer because the cluster index failed.",
                counter=True,
            ),
        ]
        if self._server is not None:
            served = self._server.counters.as_dict()
            values += [
                TierMetric(
                    "peer_connections_open",
                    self._server.open_connections,
                    "Authenticated connections the peer service holds open.",
                ),
                TierMetric(
                    "peer_chunks_served",
                    served["chunks_served"],
                    "Chunks sent to peers.",
                    counter=True,
                ),
                TierMetric(
                    "peer_bytes_served",
                    served["bytes_served"],
                    "Bytes of chunks (with headers) sent to peers.",
                    counter=True,
                ),
                TierMetric(
                    "peer_handshakes_open",
                    self._server.open_handshakes,
                    "Incoming connections accepted and not authenticated yet.",
                ),
                TierMetric(
                    "peer_refused",
                    served["refused"],
                    "Incoming connections refused: failed authentication or TLS, "
                    "displaced from a full handshake budget, no room among the sessions.",
                    counter=True,
                ),
                TierMetric(
                    "peer_timed_out",
                    served["timed_out"],
                    "Incoming connections ended because a handshake or a request "
                    "outlived its timeout.",
                    counter=True,
                ),
                TierMetric(
                    "peer_idle_closed",
                    served["idle_closed"],
                    "Authenticated incoming connections closed idle (idle timeout, "
                    "or to make room for a newcomer).",
                    counter=True,
                ),
                TierMetric(
                    "peer_dropped",
                    served["dropped"],
                    "Authenticated connections dropped for a malformed message.",
                    counter=True,
                ),
            ]
        client = self._client_counters.as_dict()
        values += [
            TierMetric(
                "peer_client_connects",
                client["connects"],
                "Connections this node opened to its peers.",
                counter=True,
            ),
            TierMetric(
                "peer_client_idle_closed",
                client["idle_closed"],
                "Pooled connections to peers closed unused after half the idle timeout.",
                counter=True,
            ),
            TierMetric(
                "peer_client_reconnects",
                client["reconnects"],
                "Requests repeated on a new connection because a peer had closed the pooled one.",
                counter=True,
            ),
        ]
        return values

    def describe(self) -> dict[str, object]:
        facts: dict[str, object] = {
            "listen": protocol.format_address(*self.address) if self.address else None,
            "peers": list(self.options.peers),
            "peers_reachable": sum(client.available() for client in self._clients),
            "tls": self.options.tls,
            **{f"client_{name}": n for name, n in self._client_counters.as_dict().items()},
        }
        if self._server is not None:
            facts.update(self._server.counters.as_dict())
        return facts


def _normalized(address: str) -> str | None:
    """``address`` as peer clients name theirs, or ``None`` if it is not ``host:port``."""
    try:
        return protocol.format_address(*protocol.parse_address(address))
    except (ValueError, KVTierError):
        return None
