"""The primary tier: which key lives in which slot, and who is using it."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy
from kvtier.primary.buffer import SlotBuffer

logger = logging.getLogger(__name__)

#: Reference count of a slot whose bytes are being written.
WRITING = -1


class PrimaryTier:
    """Slots of a :class:`SlotBuffer`, reference-counted, evicted by a policy.

    A slot's count is ``-1`` while a write into it is in flight, ``0`` while
    idle (and evictable), ``n > 0`` while pinned by ``n`` readers: an engine
    load, a cascade to a secondary tier, a peer sending it. Chunks being
    written are unknown to the cache policy and pinned ones are protected
    from it, so it can never pick a busy victim. All methods are thread-safe.
    """

    def __init__(self, buffer: SlotBuffer, policy: CachePolicy) -> None:
        self.buffer = buffer
        self.policy = policy
        self._lock = threading.Lock()
        self._slot_of: dict[ChunkKey, int] = {}
        self._refs: dict[ChunkKey, int] = {}
        # Keys with readers (count > 0): the resident keys the policy must not pick.
        # Kept as a set so an eviction never scans every slot to find them.
        self._pinned: set[ChunkKey] = set()
        # Pop from the end: low slot numbers are handed out first.
        self._free: list[int] = list(range(buffer.num_slots - 1, -1, -1))
        self.evictions = 0
        #: Chunks that readers found ready here (see :meth:`touch`).
        self.hits = 0

    @property
    def num_slots(self) -> int:
        return self.buffer.num_slots

    @property
    def view(self) -> memoryview:
        """The ``(num_slots, slot_bytes)`` view handed to secondary tiers."""
        return self.buffer.view

    def __len__(self) -> int:
        """Slots holding a chunk or a write in flight."""
        return len(self._slot_of)

    def is_ready(self, key: ChunkKey) -> bool:
        """Resident with its bytes complete."""
        refs = self._refs.get(key)
        return refs is not None and refs >= 0

    def is_writing(self, key: ChunkKey) -> bool:
        return self._refs.get(key) == WRITING

    def refcount(self, key: ChunkKey) -> int | None:
        return self._refs.get(key)

    def slot_of(self, key: ChunkKey) -> int | None:
        return self._slot_of.get(key)

    def prepare_store(
        self, keys: Sequence[ChunkKey], protect: Iterable[ChunkKey] = ()
    ) -> dict[ChunkKey, int] | None:
        """Reserve a slot for every key not yet resident, evicting idle chunks.

        Atomic: returns ``{key: slot}`` for the new keys (marked writing), or
        ``None`` with nothing changed when not enough idle chunks can go.
        Neither ``keys`` nor ``protect`` are ever chosen as victims.
        """
        with self._lock:
            new = list(dict.fromkeys(k for k in keys if k not in self._slot_of))
            shortfall = len(new) - len(self._free)
            if shortfall > 0:
                # Chunks being written are not yet known to the policy; chunks of
                # this very request stay: evicting them would break its prefix.
                protected = self._pinned.union(keys, protect)
                victims = self.policy.evict(shortfall, protected)
                if victims is None:
                    return None
                for victim in victims:
                    self._free.append(self._slot_of.pop(victim))
                    del self._refs[victim]
                self.evictions += len(victims)
            reserved = {}
            for key in new:
                slot = self._free.pop()
                self._slot_of[key] = slot
                self._refs[key] = WRITING
                reserved[key] = slot
            return reserved

    def complete_store(
        self, keys: Iterable[ChunkKey], success: bool = True, *, pins: int = 0
    ) -> dict[ChunkKey, int]:
        """End writes: on success the chunks become ready, else their slots are freed.

        A ready chunk starts with ``pins`` readers (``0``: idle and evictable),
        so a caller that reads it next (a cascade) holds it from the very
        moment it is ready: no other thread's eviction can come in between.
        Keys not being written are skipped. Returns ``{key: slot}`` of the keys made ready.
        """
        if pins < 0:
            raise ValueError(f"pins must be >= 0, got {pins}")
        completed = {}
        with self._lock:
            for key in dict.fromkeys(keys):
                if self._refs.get(key) != WRITING:
                    continue
                if success and self._track(key):
                    self._refs[key] = pins
                    if pins:
                        self._pinned.add(key)
                    completed[key] = self._slot_of[key]
                else:
                    del self._refs[key]
                    self._free.append(self._slot_of.pop(key))
        return completed

    def _track(self, key: ChunkKey) -> bool:
        """Hand a newly ready key to the policy; a policy that raises loses the chunk,
        never the slot (a chunk the policy does not know could never be evicted)."""
        try:
            self.policy.insert(key)
        except Exception:
            logger.exception("cache policy %s: insert raised; chunk dropped", self.policy)
            return False
        return True

    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin ready chunks for reading and return their slots, in order.

        Atomic: raises ``KeyError`` naming the first key that is not ready,
        pinning nothing.
        """
        with self._lock:
            for key in keys:
                refs = self._refs.get(key)
                if refs is None or refs < 0:
                    raise KeyError(f"chunk {key.hex()[:16]} is not ready in the primary tier")
            for key in keys:
                self._refs[key] += 1
            self._pinned.update(keys)
            self.policy.touch(keys)
            return [self._slot_of[key] for key in keys]

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin the leading ready chunks of ``keys``; returns their slots, in order.

        Stops at the first chunk that is not ready (absent, evicted, or being
        written): never raises for a missing chunk, unlike :meth:`prepare_load`.
        Unpin with :meth:`complete_load` of ``keys[:len(slots)]``. Not an
        access for the policy: the lookup that found the chunks counted it.
        """
        with self._lock:
            ready = []
            for key in keys:
                refs = self._refs.get(key)
                if refs is None or refs < 0:
                    break
                ready.append(key)
            for key in ready:
                self._refs[key] += 1
            self._pinned.update(ready)
            return [self._slot_of[key] for key in ready]

    def complete_load(self, keys: Iterable[ChunkKey]) -> None:
        """Unpin chunks pinned by :meth:`prepare_load`.

        Atomic: raises ``ValueError`` naming the first key that is not pinned
        (as often as it appears), unpinning nothing.
        """
        keys = list(keys)
        with self._lock:
            for key, times in Counter(keys).items():
                if self._refs.get(key, 0) < times:
                    raise ValueError(f"chunk {key.hex()[:16]} is not pinned")
            for key in keys:
                self._refs[key] -= 1
                if self._refs[key] == 0:
                    self._pinned.discard(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Record that readers found these chunks: the policy's recency, and :attr:`hits`.

        The manager touches the leading chunks each lookup finds ready, so
        ``hits`` counts the chunks lookups found in the primary tier.
        """
        keys = list(keys)
        with self._lock:
            self.hits += sum(1 for key in keys if self._refs.get(key, WRITING) >= 0)
            self.policy.touch(keys)

    def remove_idle(self, keys: Iterable[ChunkKey]) -> int:
        """Drop idle chunks (e.g. found stale); busy ones stay. Returns how many."""
        removed = 0
        with self._lock:
            for key in keys:
                if self._refs.get(key) == 0:
                    del self._refs[key]
                    self._free.append(self._slot_of.pop(key))
                    self.policy.remove(key)
                    removed += 1
        return removed

    def clear(self) -> None:
        """Forget every chunk. Call only when nothing is pinned or writing."""
        with self._lock:
            busy = [k for k, r in self._refs.items() if r != 0]
            if busy:
                raise RuntimeError(f"cannot clear the primary tier: {len(busy)} slots busy")
            self._slot_of.clear()
            self._refs.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
            self.policy.clear()

    def busy_counts(self) -> Mapping[str, int]:
        """Slots by state, for metrics."""
        with self._lock:
            writing = sum(1 for r in self._refs.values() if r < 0)
            pinned = sum(1 for r in self._refs.values() if r > 0)
            return {
                "free": len(self._free),
                "idle": len(self._refs) - writing - pinned,
                "pinned": pinned,
                "writing": writing,
            }
