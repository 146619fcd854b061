"""The primary tier: which key lives in which slot, and who is using it."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet

from kvtier.keys import ChunkKey, check_keys, checked_keys
from kvtier.policies.base import CachePolicy
from kvtier.primary import loops
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
        # Every resident key is in exactly one of _ready and _writing, with its
        # slot; _pins holds the readers of the pinned ready keys (never 0).
        # Laid out so that the calls made for every request do one dict
        # operation per chunk each: "ready?" and "pinned?" are one C-level
        # membership test, and an eviction skips pinned keys without a scan.
        self._ready: dict[ChunkKey, int] = {}
        self._writing: dict[ChunkKey, int] = {}
        self._pins: dict[ChunkKey, int] = {}
        # Pop from the end: low slot numbers are handed out first.
        self._free: list[int] = list(range(buffer.num_slots - 1, -1, -1))
        #: Slots never handed out again: the buffer has no memory for them.
        self._retired: set[int] = set()
        self.evictions = 0
        #: Chunks that readers found ready here (see :meth:`touch`).
        self.hits = 0
        #: Called as ``watcher(added, removed)`` when chunks become ready or
        #: leave (evicted, removed, cleared), under this tier's lock: a watcher
        #: records and returns, and never calls back into the tier.
        self.watchers: list[Callable[[Sequence[ChunkKey], Sequence[ChunkKey]], None]] = []
        buffer.when_unbacked(self.retire)

    @property
    def num_slots(self) -> int:
        return self.buffer.num_slots

    @property
    def view(self) -> memoryview:
        """The ``(num_slots, slot_bytes)`` view handed to secondary tiers."""
        return self.buffer.view

    def __len__(self) -> int:
        """Slots holding a chunk or a write in flight."""
        return len(self._ready) + len(self._writing)

    def is_ready(self, key: ChunkKey) -> bool:
        """Resident with its bytes complete."""
        return key in self._ready

    def is_writing(self, key: ChunkKey) -> bool:
        return key in self._writing

    def absent(self, keys: Sequence[ChunkKey]) -> list[int]:
        """The positions in ``keys`` of those neither ready nor being written."""
        ready, writing = self._ready, self._writing
        return [i for i, key in enumerate(keys) if key not in ready and key not in writing]

    @property
    def has_writes(self) -> bool:
        """Whether any write is in flight."""
        return bool(self._writing)

    def refcount(self, key: ChunkKey) -> int | None:
        """Readers of a ready chunk, :data:`WRITING` while written, ``None`` if absent."""
        if key in self._ready:
            return self._pins.get(key, 0)
        return WRITING if key in self._writing else None

    def refcounts(self) -> dict[ChunkKey, int]:
        """:meth:`refcount` of every resident key (a snapshot)."""
        with self._lock:
            pins = self._pins
            return {
                **dict.fromkeys(self._writing, WRITING),
                **{key: pins.get(key, 0) for key in self._ready},
            }

    def ready_keys(self) -> list[ChunkKey]:
        """Every ready key (a snapshot)."""
        with self._lock:
            return list(self._ready)

    def _notify(self, added: Sequence[ChunkKey], removed: Sequence[ChunkKey]) -> None:
        for watcher in self.watchers:
            try:
                watcher(added, removed)
            except Exception:
                logger.exception("primary tier watcher %r raised", watcher)

    def slot_of(self, key: ChunkKey) -> int | None:
        slot = self._ready.get(key)
        return slot if slot is not None else self._writing.get(key)

    def slots(self) -> dict[ChunkKey, int]:
        """The slot of every resident key, ready or being written (a snapshot)."""
        with self._lock:
            return {**self._writing, **self._ready}

    @property
    def usable_slots(self) -> int:
        """The most chunks the tier can hold: its slots but the retired ones."""
        return self.buffer.num_slots - len(self._retired)

    @property
    def free_count(self) -> int:
        """How many slots hold nothing now, and may."""
        return self.usable_slots - len(self)

    def free_slots(self) -> list[int]:
        """Slots holding nothing (a snapshot)."""
        with self._lock:
            return list(self._free)

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
        walk = loops.active
        with self._lock:
            ready, writing, free = self._ready, self._writing, self._free
            # The new keys, each once, in order: the answer, its slots still to come.
            reserved = walk.new_keys(ready, writing, keys)
            shortfall = len(reserved) - len(free)
            if shortfall > 0:
                pins = self._pins
                all_new = len(reserved) == len(keys)
                if protect or (pins and not all_new):
                    victims = self._evict(shortfall, keys, protect)
                elif all_new:  # only the pinned chunks to spare
                    victims = self.policy.evict(shortfall, pins)
                else:
                    # Nothing pinned (a single engine between its requests):
                    # all keys to spare, as one set; those the policy does
                    # not track are never asked about.
                    victims = self.policy.evict(shortfall, set(keys))
                if victims is None:
                    return None
                walk.free_victims(ready, free, victims)
                self.evictions += len(victims)
                if self.watchers:
                    self._notify((), victims)
            walk.take_slots(reserved, free, writing)
            return reserved

    def _evict(
        self, n: int, keys: Sequence[ChunkKey], protect: Collection[ChunkKey]
    ) -> list[ChunkKey] | None:
        """Have the policy give up ``n`` idle chunks, none of ``keys`` or ``protect``.

        Under the lock. Chunks being written are not yet known to the policy,
        and pinned ones are in :attr:`_pins`. Of the request's own chunks
        (evicting them would break its prefix) only the resident idle ones
        need naming.
        """
        # The pinned keys go to the policy as the dict itself, a collection of
        # them whose membership test is a fast C method (a keys view's, which
        # filterfalse and map call once per key, is a slower slot wrapper).
        pins = self._pins
        own = loops.active.idle_resident(self._ready, pins, keys)
        if protect:
            return self.policy.evict(n, _Protected(pins, set(own), protect))
        if not own:
            return self.policy.evict(n, pins)
        # Idle, so not pinned: lent to the pinned keys for this one call, which
        # keeps each membership test the policy makes a single dict lookup.
        # Lent and taken back by C-level passes (a store after a lookup lends
        # the whole prefix it found), each key once.
        lent = dict.fromkeys(own, 0)
        pins.update(lent)
        try:
            return self.policy.evict(n, pins)
        finally:
            deque(map(pins.pop, lent), maxlen=0)

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
            # Each key once, in order; keys not being written (or repeats) skipped.
            written = loops.active.finish_writes(self._writing, keys)
            if not success or not written:
                self._free.extend(written.values())
                return {}
            tracked = list(written)
            try:
                self.policy.insert_all(tracked)
            except Exception:
                tracked = self._track_one_by_one(tracked)
            if len(tracked) < len(written):  # chunks the policy refused
                refused = dict(written)
                written = {key: refused.pop(key) for key in tracked}
                self._free.extend(refused.values())
            self._ready.update(written)
            if pins:
                self._pins.update(dict.fromkeys(written, pins))
            if self.watchers:
                self._notify(list(written), ())
            return written

    def _track_one_by_one(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """After the policy's ``insert_all`` raised (called in its handler):
        offer the keys one by one; returns those the policy now tracks.

        A policy that raises loses the chunk, never the slot (a chunk the policy
        does not know could never be evicted): those it still refuses are dropped.
        """
        policy = self.policy
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
            found = loops.active.ready_count(self._ready, keys)
            if found < len(keys):
                check_keys(keys, found, found + 1)  # not ready, or not a key at all
                raise KeyError(f"chunk {keys[found].hex()[:16]} is not ready in the primary tier")
            self.policy.touch(keys)
            return loops.active.pin_prefix(self._ready, self._pins, keys)

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin the leading ready chunks of ``keys``; returns their slots, in order.

        Stops at the first chunk that is not ready (absent, evicted, or being
        written): never raises for a missing chunk, unlike :meth:`prepare_load`.
        Unpin with :meth:`complete_load` of ``keys[:len(slots)]``. Not an
        access for the policy: the lookup that found the chunks counted it.
        """
        with self._lock:
            return loops.active.pin_prefix(self._ready, self._pins, keys)

    def lookup_pinned(self, keys: Sequence[ChunkKey], *, count_hits: bool = True) -> list[int]:
        """:meth:`lookup` and :meth:`pin_prefix` in one step: the leading ready
        chunks of ``keys`` are found, touched and pinned under one hold of the
        lock, so none can be evicted between being found and being pinned.
        Returns their slots, in order; unpin with :meth:`complete_load`."""
        with self._lock:
            slots = loops.active.pin_prefix(self._ready, self._pins, keys)
            if slots:
                try:
                    self.policy.touch(keys[: len(slots)])
                except BaseException:
                    loops.active.unpin(self._pins, keys[: len(slots)])
                    raise
                if count_hits:
                    self.hits += len(slots)
            return slots

    def lookup(self, keys: Sequence[ChunkKey], *, count_hits: bool = True) -> int:
        """How many leading chunks of ``keys`` are ready; those are touched (see
        :meth:`touch`) in the same pass, and added to :attr:`hits` unless
        ``count_hits`` is false (a request asking again). The manager's lookup
        of a request."""
        with self._lock:
            found = loops.active.ready_count(self._ready, keys)
            if found:
                if count_hits:
                    self.hits += found
                self.policy.touch(keys[:found])
            return found

    def complete_load(self, keys: Iterable[ChunkKey]) -> None:
        """Unpin chunks pinned by :meth:`prepare_load`.

        Atomic: raises ``ValueError`` naming the first key that is not pinned
        (as often as it appears), unpinning nothing.
        """
        keys = keys if isinstance(keys, (list, tuple)) else checked_keys(keys)
        with self._lock:
            missing = loops.active.unpin(self._pins, keys)
        if missing >= 0:
            check_keys(keys, missing, missing + 1)  # not pinned, or not a key
            raise ValueError(f"chunk {keys[missing].hex()[:16]} is not pinned")

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Record that readers found these chunks: the policy's recency, and :attr:`hits`.

        The manager's :meth:`lookup` touches the leading chunks each lookup
        finds ready, so ``hits`` counts the chunks lookups found in the primary tier.
        """
        keys = list(keys)
        with self._lock:
            self.hits += sum(map(self._ready.__contains__, keys))
            self.policy.touch(keys)

    def remove_idle(self, keys: Iterable[ChunkKey]) -> int:
        """Drop idle chunks (e.g. found stale); busy ones stay. Returns how many."""
        removed = []
        with self._lock:
            ready, pins = self._ready, self._pins
            for key in keys:
                if key in ready and key not in pins:
                    self._free.append(ready.pop(key))
                    self.policy.remove(key)
                    removed.append(key)
            if removed and self.watchers:
                self._notify((), removed)
        return len(removed)

    def retire(self, slots: Iterable[int]) -> None:
        """Never hand the free ones of ``slots`` out again: the buffer could
        not give them memory, and a first write there would kill the process
        (see :meth:`SlotBuffer.when_unbacked`). Those in use stay: written,
        they have their memory."""
        with self._lock:
            gone = set(slots).intersection(self._free)
            if gone:
                self._free[:] = [slot for slot in self._free if slot not in gone]
                self._retired |= gone

    def clear(self) -> None:
        """Forget every chunk. Call only when nothing is pinned or writing."""
        with self._lock:
            busy = len(self._writing) + len(self._pins)
            if busy:
                raise RuntimeError(f"cannot clear the primary tier: {busy} slots busy")
            if self.watchers:
                self._notify((), list(self._ready))
            self._ready.clear()
            retired = self._retired
            self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in retired]
            self.policy.clear()

    def busy_counts(self) -> Mapping[str, int]:
        """Slots by state, for metrics."""
        with self._lock:
            return {
                "free": len(self._free),
                "idle": len(self._ready) - len(self._pins),
                "pinned": len(self._pins),
                "writing": len(self._writing),
                "retired": len(self._retired),
            }


class _Protected(Collection[ChunkKey]):
    """The keys an eviction must spare: pinned ones, the request's own, and
    those the caller protects. A view: a membership test is at most three set
    lookups and nothing is copied, however long the protected chain. Its
    exact length is a union of the parts: a policy asks :meth:`size_bound`."""

    __slots__ = ("_own", "_pinned", "_protect")

    def __init__(
        self,
        pinned: Collection[ChunkKey],
        own: Collection[ChunkKey],
        protect: Collection[ChunkKey],
    ) -> None:
        self._pinned = pinned
        self._own = own
        # A sequence would cost a scan per test: make it a set once.
        self._protect = protect if isinstance(protect, AbstractSet | Mapping) else set(protect)

    def __contains__(self, key: object) -> bool:
        return key in self._pinned or key in self._own or key in self._protect

    def _union(self) -> set[ChunkKey]:
        return {*self._pinned, *self._own, *self._protect}

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(self._union())

    def __len__(self) -> int:
        return len(self._union())

    def size_bound(self) -> int:
        """At least :func:`len`, without building the union (see
        :func:`kvtier.policies.base.size_bound`)."""
        return len(self._pinned) + len(self._own) + len(self._protect)
