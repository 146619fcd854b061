"""Publishing what a node holds to the cluster index, off the request path.

The manager's residency feed reports changes (chunks made ready, evicted,
stored in or dropped by a secondary tier) to :class:`IndexPublisher`, which only records
them under a lock of its own: nothing on an engine's path waits for the
index. Its thread sends them in batches, renews the node's lease with every
batch (and at least every third of the lease), and while the index fails it
keeps the changes, pausing longer each time (up to ``max_backoff_s``). Past
``max_pending`` changes it drops them and, once the index answers again,
publishes the primary tier's chunks anew from what the node holds.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtier.fleet.base import INCARNATION_CHARS, PRIMARY_MEDIUM, ClusterIndex, NodeLease
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierMetric

logger = logging.getLogger(__name__)


class IndexPublisher:
    """Sends one node's chunk changes to a :class:`ClusterIndex` on its own thread."""

    name = "index"

    def __init__(
        self,
        index: ClusterIndex,
        *,
        held: Callable[[], Iterable[ChunkKey]],
        p2p_address: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``held``: the keys the primary tier holds now (for republishing)."""
        options = index.options
        self.index = index
        self.incarnation = secrets.token_hex(INCARNATION_CHARS // 2)
        self.lease = NodeLease(options.node_name(), options.p2p_address or p2p_address)
        self._media = frozenset(options.media)
        self._held = held
        self._clock = clock
        self._lock = threading.Lock()
        # (key, medium) -> True to add, False to remove; the latest change wins.
        self._pending: dict[tuple[ChunkKey, str], bool] = {}
        self._republish = PRIMARY_MEDIUM in self._media  # the first publish names them all
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.added = 0
        self.removed = 0
        self.batches = 0
        self.failures = 0
        self.dropped = 0
        self.republished = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-index", daemon=True)
        self._thread.start()

    # Reported changes (any thread, under others' locks: record only) ------------

    def residency_changed(self, tier: str, keys: Sequence[ChunkKey], stored: bool) -> None:
        """A :attr:`~kvtier.residency.ResidencyFeed.listeners` callback: ``tier``
        (``cpu``, or a secondary tier's name) took ``keys`` in or dropped them.
        A secondary tier's medium is its type (``fs:2`` publishes as ``fs``)."""
        medium = tier.partition(":")[0]
        if medium in self._media:
            self._record(keys if stored else (), () if stored else keys, medium)

    def _record(self, added: Iterable[ChunkKey], removed: Iterable[ChunkKey], medium: str) -> None:
        with self._lock:
            pending = self._pending
            pending.update(((key, medium), False) for key in removed)
            pending.update(((key, medium), True) for key in added)
            if len(pending) > self.index.options.max_pending:
                # The index has been away long: republish from what the node holds.
                self.dropped += len(pending)
                pending.clear()
                self._republish = PRIMARY_MEDIUM in self._media
        if len(pending) >= self.index.options.batch_size:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # The publishing thread -----------------------------------------------------

    def _run(self) -> None:
        options = self.index.options
        renew_every = options.lease_s / 3
        refresh_every = options.entry_ttl_s / 2
        backoff = options.flush_interval_s
        last_renewal = last_refresh = -float("inf")
        while not self._stop.is_set():
            now = self._clock()
            if now - last_refresh >= refresh_every:
                last_refresh = now
                with self._lock:
                    self._republish = self._republish or PRIMARY_MEDIUM in self._media
            batch = self._take_batch(options.batch_size)
            if batch or now - last_renewal >= renew_every:
                if self._send(batch):
                    last_renewal = now
                    backoff = options.flush_interval_s
                else:
                    backoff = min(backoff * 2, options.max_backoff_s)
                    self._wake.wait(backoff)
                    continue
            if self.pending < options.batch_size:
                self._wake.wait(options.flush_interval_s)
            self._wake.clear()

    def _take_batch(self, size: int) -> list[tuple[tuple[ChunkKey, str], bool]]:
        with self._lock:
            republish, self._republish = self._republish, False
        if republish:
            # Read outside this lock: the primary tier reports changes under its own.
            held = list(self._held())
            self.republished += 1
        with self._lock:
            if republish:
                # A change recorded since the snapshot is newer: it stays.
                for key in held:
                    self._pending.setdefault((key, PRIMARY_MEDIUM), True)
            batch = list(itertools.islice(self._pending.items(), size))
            for change, _ in batch:
                del self._pending[change]
        return batch

    def _send(self, batch: list[tuple[tuple[ChunkKey, str], bool]]) -> bool:
        added = [change for change, add in batch if add]
        removed = [change for change, add in batch if not add]
        try:
            self.index.publish(self.incarnation, self.lease, added, removed)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                logger.warning(
                    "cluster index: publishing failed (%d times so far); retrying: %r",
                    self.failures,
                    exc,
                )
            with self._lock:  # back, unless a newer change came meanwhile
                for change, add in batch:
                    self._pending.setdefault(change, add)
            return False
        self.batches += 1
        self.added += len(added)
        self.removed += len(removed)
        return True

    # Lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stop publishing and end the lease, so the node leaves the answers now."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        try:
            self.index.withdraw(self.incarnation)
        except Exception as exc:
            logger.info("cluster index: lease not withdrawn (it expires by itself): %r", exc)
        self.index.close()

    def metrics(self) -> list[TierMetric]:
        counters = self.index.counters
        return [
            TierMetric("published_adds", self.added, "Entries added to the index.", counter=True),
            TierMetric(
                "published_removes", self.removed, "Entries removed from the index.", counter=True
            ),
            TierMetric("publish_batches", self.batches, "Batches sent to the index.", counter=True),
            TierMetric(
                "publish_failures", self.failures, "Batches the index refused or missed.", True
            ),
            TierMetric(
                "dropped_changes",
                self.dropped,
                "Changes dropped while the index was away too long (then republished).",
                counter=True,
            ),
            TierMetric(
                "republished",
                self.republished,
                "Times the primary tier's chunks were published anew.",
                counter=True,
            ),
            TierMetric("pending_changes", self.pending, "Changes waiting to be sent."),
            TierMetric("queries", counters.queries, "Index queries answered.", counter=True),
            TierMetric(
                "query_failures", counters.query_failures, "Index queries that failed.", True
            ),
            TierMetric(
                "malformed_entries",
                counters.malformed_entries,
                "Index entries and leases ignored as malformed.",
                counter=True,
            ),
        ]
