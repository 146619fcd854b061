"""The primary tier: which key lives in which slot, and who is using it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import takewhile

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
        # Ready keys and their readers; keys being written. A key is in at most one.
        # Kept apart so that "ready?" is one C-level membership test.
        self._readers: dict[ChunkKey, int] = {}
        self._writing: set[ChunkKey] = set()
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
        return key in self._readers

    def is_writing(self, key: ChunkKey) -> bool:
        return key in self._writing

    def refcount(self, key: ChunkKey) -> int | None:
        """Readers of a ready chunk, :data:`WRITING` while written, ``None`` if absent."""
        readers = self._readers.get(key)
        if readers is None and key in self._writing:
            return WRITING
        return readers

    def refcounts(self) -> dict[ChunkKey, int]:
        """:meth:`refcount` of every resident key (a snapshot)."""
        with self._lock:
            return {**dict.fromkeys(self._writing, WRITING), **self._readers}

    def slot_of(self, key: ChunkKey) -> int | None:
        return self._slot_of.get(key)

    def prepare_store(
        self, keys: Sequence[ChunkKey], protect: Collection[ChunkKey] = ()
    ) -> dict[ChunkKey, int] | None:
        """Reserve a slot for every key not yet resident, evicting idle chunks.

        Atomic: returns ``{key: slot}`` for the new keys (marked writing), or
        ``None`` with nothing changed when not enough idle chunks can go.
        Neither ``keys`` nor ``protect`` are ever chosen as victims. Pass
        ``protect`` as a set when calling once per chunk of a long chain:
        it is consulted, never copied.
        """
        with self._lock:
            slot_of = self._slot_of
            new = [key for key in dict.fromkeys(keys) if key not in slot_of]
            shortfall = len(new) - len(self._free)
            if shortfall > 0:
                # Chunks being written are not yet known to the policy; chunks of
                # this very request stay: evicting them would break its prefix.
                # Only its resident idle ones need naming: the pinned are in _pinned.
                readers = self._readers
                own = {key for key in keys if readers.get(key) == 0} if len(new) < len(keys) else ()
                protected: Collection[ChunkKey] = self._pinned
                if own or protect:
                    protected = _Protected(self._pinned, own, protect)
                victims = self.policy.evict(shortfall, protected)
                if victims is None:
                    return None
                free = self._free
                for victim in victims:
                    free.append(slot_of.pop(victim))
                    del readers[victim]
                self.evictions += len(victims)
            free, writing = self._free, self._writing
            reserved = {}
            for key in new:
                reserved[key] = slot_of[key] = free.pop()
                writing.add(key)
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
        with self._lock:
            writing = self._writing
            written = []
            for key in keys:
                if key in writing:  # else not being written, or a repeat
                    writing.remove(key)
                    written.append(key)
            ready = self._track(written) if success and written else []
            slot_of, readers = self._slot_of, self._readers
            if len(ready) < len(written):  # failed writes, or chunks the policy refused
                kept = set(ready)
                for key in written:
                    if key not in kept:
                        self._free.append(slot_of.pop(key))
            completed = {}
            for key in ready:
                readers[key] = pins
                completed[key] = slot_of[key]
            if pins:
                self._pinned.update(ready)
            return completed

    def _track(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Hand newly ready keys to the policy; returns those it now tracks.

        A policy that raises loses the chunk, never the slot (a chunk the policy
        does not know could never be evicted): the keys are then offered one
        by one, and those it still refuses are dropped.
        """
        policy = self.policy
        try:
            policy.insert_all(keys)
            return keys
        except Exception:
            logger.exception("cache policy %s: insert raised; retrying key by key", policy)
        tracked = []
        for key in keys:
            try:
                if key not in policy:
                    policy.insert(key)
            except Exception:
                logger.exception("cache policy %s: insert raised; chunk dropped", policy)
                continue
            tracked.append(key)
        return tracked

    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin ready chunks for reading and return their slots, in order.

        Atomic: raises ``KeyError`` naming the first key that is not ready,
        pinning nothing. An access for the policy, unlike :meth:`pin_prefix`.
        """
        with self._lock:
            ready = self._ready_prefix(keys)
            if len(ready) < len(keys):
                missing = keys[len(ready)]
                raise KeyError(f"chunk {missing.hex()[:16]} is not ready in the primary tier")
            self.policy.touch(keys)
            return self._pin(keys)

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin the leading ready chunks of ``keys``; returns their slots, in order.

        Stops at the first chunk that is not ready (absent, evicted, or being
        written): never raises for a missing chunk, unlike :meth:`prepare_load`.
        Unpin with :meth:`complete_load` of ``keys[:len(slots)]``. Not an
        access for the policy: the lookup that found the chunks counted it.
        """
        with self._lock:
            return self._pin(self._ready_prefix(keys))

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading chunks of ``keys`` are ready; those are touched (see
        :meth:`touch`) in the same pass. The manager's lookup of a request."""
        with self._lock:
            ready = self._ready_prefix(keys)
            if ready:
                self.hits += len(ready)
                self.policy.touch(ready)
            return len(ready)

    def _ready_prefix(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """The leading ready keys; under the lock."""
        return list(takewhile(self._readers.__contains__, keys))

    def _pin(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Add a reader to each of the ready ``keys``; under the lock."""
        readers = self._readers
        for key in keys:
            readers[key] += 1
        self._pinned.update(keys)
        return list(map(self._slot_of.__getitem__, keys))

    def complete_load(self, keys: Iterable[ChunkKey]) -> None:
        """Unpin chunks pinned by :meth:`prepare_load`.

        Atomic: raises ``ValueError`` naming the first key that is not pinned
        (as often as it appears), unpinning nothing.
        """
        keys = list(keys)
        with self._lock:
            readers, pinned = self._readers, self._pinned
            for done, key in enumerate(keys):
                count = readers.get(key, 0)
                if count <= 0:
                    for undone in keys[:done]:  # put back what this call took
                        readers[undone] += 1
                        pinned.add(undone)
                    raise ValueError(f"chunk {key.hex()[:16]} is not pinned")
                readers[key] = count - 1
                if count == 1:
                    pinned.discard(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Record that readers found these chunks: the policy's recency, and :attr:`hits`.

        The manager's :meth:`lookup` touches the leading chunks each lookup
        finds ready, so ``hits`` counts the chunks lookups found in the primary tier.
        """
        keys = list(keys)
        with self._lock:
            self.hits += sum(map(self._readers.__contains__, keys))
            self.policy.touch(keys)

    def remove_idle(self, keys: Iterable[ChunkKey]) -> int:
        """Drop idle chunks (e.g. found stale); busy ones stay. Returns how many."""
        removed = 0
        with self._lock:
            for key in keys:
                if self._readers.get(key) == 0:
                    del self._readers[key]
                    self._free.append(self._slot_of.pop(key))
                    self.policy.remove(key)
                    removed += 1
        return removed

    def clear(self) -> None:
        """Forget every chunk. Call only when nothing is pinned or writing."""
        with self._lock:
            busy = len(self._writing) + len(self._pinned)
            if busy:
                raise RuntimeError(f"cannot clear the primary tier: {busy} slots busy")
            self._slot_of.clear()
            self._readers.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
            self.policy.clear()

    def busy_counts(self) -> Mapping[str, int]:
        """Slots by state, for metrics."""
        with self._lock:
            return {
                "free": len(self._free),
                "idle": len(self._readers) - len(self._pinned),
                "pinned": len(self._pinned),
                "writing": len(self._writing),
            }


class _Protected(Collection[ChunkKey]):
    """The keys an eviction must spare: pinned ones, the request's own, and
    those the caller protects. A view: a membership test is at most three set
    lookups and nothing is copied, however long the protected chain."""

    __slots__ = ("_own", "_pinned", "_protect")

    def __init__(
        self, pinned: set[ChunkKey], own: Collection[ChunkKey], protect: Collection[ChunkKey]
    ) -> None:
        self._pinned = pinned
        self._own = own
        # A sequence would cost a scan per test: make it a set once.
        self._protect = protect if isinstance(protect, AbstractSet | Mapping) else set(protect)

    def __contains__(self, key: object) -> bool:
        return key in self._pinned or key in self._own or key in self._protect

    def _union(self) -> set[ChunkKey]:
        return self._pinned.union(self._own, self._protect)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(self._union())

    def __len__(self) -> int:
        return len(self._union())
