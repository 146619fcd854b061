"""vLLM KV events for one kvtier tier inside vLLM's tiering: the chunks it
stored, and the removal of those it no longer serves, with vLLM's own keys."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier.keys import ChunkKey

#: Chunks announced as stored whose removal kvtier still reports (a bound on memory).
_ANNOUNCED_LIMIT = 1 << 20


class TierAnnouncements:
    """The events of one tier, until vLLM takes them. ``chunk_key`` maps
    vLLM's key to kvtier's; ``medium`` and ``locality`` go into every event."""

    def __init__(
        self,
        chunk_key: Callable[[OffloadKey], ChunkKey],
        medium: Medium,
        locality: Locality | None,
    ) -> None:
        self._chunk_key = chunk_key
        self._medium = medium
        self._locality = locality
        self._events: list[OffloadingEvent] = []
        #: Chunks announced as stored (kvtier's key to vLLM's), so that their
        #: removal is announced too.
        self._announced: collections.OrderedDict[ChunkKey, OffloadKey] = collections.OrderedDict()
        #: Chunks the tier dropped itself (evicted, deleted as corrupt), reported
        #: from its workers; announced at the next :meth:`take`.
        self._dropped: collections.deque[Sequence[ChunkKey]] = collections.deque()

    def stored(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        for key in keys:
            own = self._chunk_key(key)
            self._announced[own] = key
            self._announced.move_to_end(own)
        while len(self._announced) > _ANNOUNCED_LIMIT:
            self._announced.popitem(last=False)
        self._events.append(self._event(list(keys), removed=False))

    def gone(self, keys: Sequence[OffloadKey]) -> None:
        """Announce as removed the chunks announced as stored that the tier no
        longer serves (found missing, or gone at their load)."""
        self._gone_own([self._chunk_key(key) for key in keys])

    def dropped(self, own_keys: Sequence[ChunkKey]) -> None:
        """The tier dropped these chunks; called from its workers, so only queued."""
        self._dropped.append(own_keys)

    def take(self) -> list[OffloadingEvent]:
        """Every event since the last call."""
        while self._dropped:
            self._gone_own(self._dropped.popleft())
        events, self._events = self._events, []
        return events

    def _gone_own(self, own_keys: Sequence[ChunkKey]) -> None:
        gone = [self._announced.pop(own) for own in own_keys if own in self._announced]
        if gone:
            self._events.append(self._event(gone, removed=True))

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=self._medium, removed=removed, locality=self._locality
        )
