"""A warm start: after a restart, the chunks the secondary tiers used most
recently come back into free slots of the CPU tier on a background thread,
so that the engine's first requests find their prefixes in memory instead of
waiting for a promotion from disk.

One small job at a time, each waited for before the next: the engine's own
promotions never queue behind more than one batch of a warm start.

The chunks chosen (the most recently used, as many as fit the free slots)
come back least recently used first: each job enters the cache policy as
newer than the ones before it, so the order they were used in carries
over, and a CPU tier that fills up later evicts the older ones first,
whatever the policy. A request for a chunk still to come promotes it itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvtier.keys import ChunkKey
from kvtier.manager import TieringManager
from kvtier.tiers.base import TierMetric, TransferJob

__all__ = ["WarmStart"]

logger = logging.getLogger(__name__)

#: Chunks per job: small, so a request's own promotion waits behind little.
BATCH = 16
#: How long to sleep between looks at a job of a tier that announces nothing.
POLL_S = 0.002
#: Longest sleep between looks at a job (closing the cache announces, too).
_LOOK_S = 0.5


class WarmStart:
    """Promotes up to ``max_chunks`` of the tiers' most recently used chunks,
    tier by tier in configuration order; attached to the manager, which
    closes it at shutdown."""

    name = "warm_start"

    def __init__(self, manager: TieringManager, max_chunks: int, batch: int = BATCH) -> None:
        self.manager = manager
        self.max_chunks = max_chunks
        self.batch = batch
        #: Chunks promoted so far, and the seconds the warm start took once done.
        self.chunks = 0
        self.seconds: float | None = None
        self.done = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-warm-start", daemon=True)

    @classmethod
    def attach(cls, manager: TieringManager, max_chunks: int) -> WarmStart:
        warm = cls(manager, max_chunks)
        manager.attachments.append(warm)
        warm._thread.start()
        return warm

    def close(self) -> None:
        # Not joined: shutdown holds the manager's lock, which the thread may
        # be waiting for; once it has the lock the manager is closed, and it ends.
        self._stopping.set()
        self.manager.progress.announce()

    def metrics(self) -> Sequence[TierMetric]:
        return [
            TierMetric("chunks", self.chunks, "Chunks promoted by the warm start", counter=True),
            TierMetric("seconds", self.seconds or 0.0, "Seconds the warm start took (0: running)"),
        ]

    def _run(self) -> None:
        started = time.monotonic()
        try:
            left = self.max_chunks
            for index, tier in enumerate(self.manager.tiers):
                if left <= 0 or self._stopping.is_set():
                    break
                if not tier.knows_recent_use:
                    continue
                try:
                    keys = list(tier.recent_keys(left))
                except Exception:
                    logger.exception("tier %s: recent_keys raised; not warmed", tier.tier_type)
                    continue
                left -= self._promote(index, keys[::-1])
        except Exception:
            logger.exception("warm start failed; the cache starts cold instead")
        finally:
            self.seconds = time.monotonic() - started
            self.done.set()
        logger.info("kvtier: warm start promoted %d chunks in %.3f s", self.chunks, self.seconds)

    def _promote(self, index: int, keys: list[ChunkKey]) -> int:
        """Promote ``keys`` (least recently used first) from tier ``index``
        batch by batch; the chunks promoted. When fewer slots are free than
        keys are left (the engine stores meanwhile), the older ones are skipped."""
        manager, primary, promoted = self.manager, self.manager.primary, 0
        keys = [key for key in keys if primary.slot_of(key) is None]  # those need no slot
        start = 0
        while start < len(keys) and not self._stopping.is_set():
            free = primary.free_count
            if free <= 0:
                break
            start = max(start, len(keys) - free)
            batch = keys[start : start + self.batch]
            start += len(batch)
            job = manager.promote_into_free(index, batch)
            if job is None:
                continue  # all resident already
            self._wait(index, job)
            ready = sum(map(manager.primary.is_ready, job.keys))
            promoted += ready
            self.chunks += ready
        return promoted

    def _wait(self, index: int, job: TransferJob) -> None:
        """Until the job's result is applied (collected here: an idle engine
        collects nothing), or the warm start stops."""
        manager = self.manager
        while not self._stopping.is_set():
            mark = manager.progress.mark
            manager.collect()
            if not manager.running(index, job):
                return
            manager.progress.sleep(mark, _LOOK_S, POLL_S)
