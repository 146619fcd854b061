"""Which tier holds which chunk, told to observers as it changes.

The manager feeds :class:`ResidencyFeed` from the primary tier (chunks made
ready, evicted, cleared), from secondary tiers' store results and from the
removals tiers report (their evictions, corrupt chunks deleted, loads that
found a chunk gone). Observers (KV events for routers) see one ordered stream.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import suppress

from kvtier.keys import ChunkKey

logger = logging.getLogger(__name__)

#: Called with ``(tier_name, keys, stored)`` when a tier takes chunks in
#: (``True``) or drops them (``False``).
ResidencyListener = Callable[[str, Sequence[ChunkKey], bool], None]
#: A :attr:`PrimaryTier.watchers` callback: ``(added, removed)``.
PrimaryWatcher = Callable[[Sequence[ChunkKey], Sequence[ChunkKey]], None]

#: The primary tier's name in the feed.
PRIMARY_TIER_NAME = "cpu"


def tier_names(tier_types: Sequence[str]) -> list[str]:
    """A distinct name per secondary tier: its type, numbered from 1 in
    configuration order where the type repeats (``fs:1``, ``fs:2``)."""
    repeats = Counter(tier_types)
    numbers: Counter[str] = Counter()
    names = []
    for tier_type in tier_types:
        numbers[tier_type] += 1
        repeated = repeats[tier_type] > 1
        names.append(f"{tier_type}:{numbers[tier_type]}" if repeated else tier_type)
    return names


class ResidencyFeed:
    """Fans residency changes out to its listeners (:meth:`add_listener`), in one order.

    Changes come from any thread (tiers report evictions on their workers);
    listeners are called under one lock, so a chunk's changes reach them in
    the order they were made. They must be quick and thread-safe and must not
    call back into kvtier; one that raises is logged.

    A job's result tells which chunks the tier holds: those a store wrote,
    and those a load read (chunks the tier held before this process started
    included). It arrives after the I/O: a tier that evicts one of them
    meanwhile (a tier smaller than a few jobs) reports the removal first, so
    the feed leaves that chunk out of the job's result.
    """

    def __init__(
        self,
        secondary_types: Sequence[str],
        primary_watchers: list[PrimaryWatcher] | None = None,
    ) -> None:
        """``primary_watchers``: the primary tier's :attr:`PrimaryTier.watchers`,
        which the feed joins while anyone listens (so that, unheard, a store
        or an eviction makes no call to it)."""
        #: Each secondary tier's name, in configuration order.
        self.names = tier_names(secondary_types)
        self._listeners: list[ResidencyListener] = []
        self._primary_watchers = primary_watchers
        self._lock = threading.Lock()
        # Per secondary tier: keys of its jobs in flight (how many jobs
        # each), and those it reported dropped while in flight.
        self._storing: list[Counter[ChunkKey]] = [Counter() for _ in self.names]
        self._dropped: list[set[ChunkKey]] = [set() for _ in self.names]

    @property
    def listeners(self) -> tuple[ResidencyListener, ...]:
        """The observers now, in the order they are called."""
        return tuple(self._listeners)

    def add_listener(self, listener: ResidencyListener) -> None:
        """Call ``listener(tier_name, keys, stored)`` on every change from now on."""
        with self._lock:
            self._listeners.append(listener)
            watchers = self._primary_watchers
            if watchers is not None and self.primary_changed not in watchers:
                watchers.append(self.primary_changed)

    def remove_listener(self, listener: ResidencyListener) -> None:
        """Stop calling ``listener``; ``ValueError`` if it was not listening."""
        with self._lock:
            self._listeners.remove(listener)
            if not self._listeners and self._primary_watchers is not None:
                with suppress(ValueError):
                    self._primary_watchers.remove(self.primary_changed)

    def primary_changed(self, added: Sequence[ChunkKey], removed: Sequence[ChunkKey]) -> None:
        """The primary tier made ``added`` ready and dropped ``removed`` (a
        :attr:`PrimaryTier.watchers` callback)."""
        if self._listeners and (added or removed):
            with self._lock:
                if removed:
                    self._tell(PRIMARY_TIER_NAME, removed, False)
                if added:
                    self._tell(PRIMARY_TIER_NAME, added, True)

    def job_started(self, tier: int, keys: Sequence[ChunkKey]) -> bool:
        """A job of ``keys`` goes to secondary tier ``tier``; ``True`` if it is
        followed (end it with :meth:`job_ended`), ``False`` when nobody listens."""
        if not self._listeners:
            return False
        with self._lock:
            self._storing[tier].update(keys)
        return True

    def job_ended(self, tier: int, keys: Sequence[ChunkKey], held: Sequence[ChunkKey]) -> None:
        """A followed job of ``keys`` ended; the tier holds ``held`` (stored or read)."""
        with self._lock:
            storing, dropped = self._storing[tier], self._dropped[tier]
            kept = [key for key in held if key not in dropped] if dropped else held
            for key in keys:
                storing[key] -= 1
                if storing[key] <= 0:
                    del storing[key]
                    dropped.discard(key)
            if kept:
                self._tell(self.names[tier], kept, True)

    def removed(self, tier: int, keys: Sequence[ChunkKey]) -> None:
        """Secondary tier ``tier`` no longer holds ``keys``."""
        if not keys or not self._listeners:
            return
        with self._lock:
            storing = self._storing[tier]
            if storing:
                self._dropped[tier].update(key for key in keys if key in storing)
            self._tell(self.names[tier], keys, False)

    def _tell(self, name: str, keys: Sequence[ChunkKey], stored: bool) -> None:
        for listener in self._listeners:
            try:
                listener(name, keys, stored)
            except Exception:
                logger.exception("residency listener %r raised", listener)
