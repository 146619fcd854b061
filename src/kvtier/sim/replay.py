"""Replaying a trace through a cache policy, and through Belady's MIN.

Hit ratio = leading resident chunks / all chunks: a request reuses the
chunks of its prefix that are resident, up to the first that is not.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.policies.base import CachePolicy
from kvtier.sim.trace import Request

#: Called after each replayed request, for a progress bar.
Advance = Callable[[], None]
#: Evicts the given number of chunks, none of the request being stored;
#: whether it could (see :func:`store_step`).
MakeRoom = Callable[[int], bool]


def store_step(
    blocks: Sequence[int], held: Collection[int], capacity: int, make_room: MakeRoom
) -> list[int] | None:
    """The store step every replayed tier shares: which of ``blocks`` a tier
    holding ``held`` (of ``capacity`` chunks) must insert, after making room.

    Returns the chunks it lacks, each once, in prefix order, for the caller to
    insert; before that, ``make_room(n)`` was asked to evict ``n`` chunks, none
    of ``blocks``, when they would not fit otherwise. ``None``, and nothing
    inserted, when it could not: a tier's store is all or nothing. (Lacking
    more than ``capacity`` chunks, ``n`` exceeds what the tier holds: the
    primary tier stores at most ``capacity`` chunks of a request.)
    """
    new = [block for block in dict.fromkeys(blocks) if block not in held]
    shortfall = len(held) + len(new) - capacity
    if shortfall > 0 and not make_room(shortfall):
        return None
    return new


@dataclass(frozen=True)
class CellResult:
    """One policy at one capacity over one trace."""

    policy: str
    capacity: int
    hits: int
    chunks: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.chunks if self.chunks else 0.0


class PrimaryReplay:
    """Drives a policy with exactly the calls ``KVCache`` makes on a primary tier alone.

    Per request: ``cached_prefix`` touches the leading resident chunks once
    (``load`` pins them without another touch), and ``store`` evicts what the chunks it lacks
    need (never a chunk of the request itself), then inserts them in order.
    A test replays traces through a real ``KVCache`` to hold this to it.

    :meth:`step` replays a batch as vLLM's scheduler drives the manager in one
    engine step: every request's lookup first (each pins its hits until the
    step ends), then every request's store, whose chunks are written during
    the step and handed to the policy only when it ends. A request therefore
    never hits what another request of its step stores, and no eviction of
    the step takes a chunk the step loads or writes.
    """

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.slots = policy.capacity
        self.resident: set[int] = set()

    def request(self, blocks: Sequence[int]) -> int:
        """Replay one request; returns its leading resident chunks."""
        return self.step([blocks])[0]

    def step(self, batch: Sequence[Sequence[int]]) -> list[int]:
        """Replay one engine step of requests; returns each one's leading resident chunks."""
        policy, resident = self.policy, self.resident
        hits_of: list[int] = []
        pinned: set[int] = set()
        for blocks in batch:
            hits = 0
            for block in blocks:
                if block not in resident:
                    break
                hits += 1
            if hits:
                leading: list[ChunkKey] = blocks[:hits]  # type: ignore[assignment]  # any hashable
                policy.touch(leading)  # the lookup; a load pins without touching
                if len(batch) > 1:
                    pinned.update(blocks[:hits])
            hits_of.append(hits)
        writing: dict[int, None] = {}
        for blocks in batch:
            self._reserve(blocks, pinned, writing)
        for block in writing:
            resident.add(block)
            policy.insert(block)  # type: ignore[arg-type]
        return hits_of

    def store(self, blocks: Sequence[int]) -> list[int]:
        """``KVCache.store`` of a request: returns the chunks written (none if no room)."""
        writing: dict[int, None] = {}
        self._reserve(blocks, set(), writing)
        for block in writing:
            self.resident.add(block)
            self.policy.insert(block)  # type: ignore[arg-type]
        return list(writing)

    def _reserve(self, blocks: Sequence[int], pinned: set[int], writing: dict[int, None]) -> None:
        """``prepare_store`` of one request: adds the chunks it writes to ``writing``.

        Chunks being written are not yet the policy's; pinned ones and the
        request's own are never its victims.
        """
        policy, resident = self.policy, self.resident
        stored = blocks[: self.slots]

        def make_room(shortfall: int) -> bool:
            spared = pinned.union(stored) if pinned else set(stored)
            victims = policy.evict(shortfall, spared)  # type: ignore[arg-type]
            if victims is None:  # the request alone fills the tier: it stores nothing
                return False
            resident.difference_update(victims)
            return True

        held = _Held(resident, writing) if writing else resident
        new = store_step(stored, held, self.slots, make_room)
        for block in new or ():
            writing[block] = None


class _Held(Collection[int]):
    """The chunks a tier holds mid-step: the ready ones and those being written."""

    def __init__(self, ready: set[int], writing: dict[int, None]) -> None:
        self.ready, self.writing = ready, writing

    def __contains__(self, block: object) -> bool:
        return block in self.ready or block in self.writing

    def __len__(self) -> int:
        return len(self.ready) + len(self.writing)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.ready, self.writing)


def batches(requests: Sequence[Request], size: int) -> Iterator[Sequence[Request]]:
    """``requests`` in engine steps of ``size`` (the last one maybe smaller)."""
    if size < 1:
        raise ValueError(f"batch size must be positive, got {size}")
    for start in range(0, len(requests), size):
        yield requests[start : start + size]


def replay(
    requests: Sequence[Request],
    policy: CachePolicy,
    name: str,
    advance: Advance | None = None,
    *,
    batch: int = 1,
) -> CellResult:
    """Hit count of ``policy`` (fresh, at its own capacity) over ``requests``,
    replayed in engine steps of ``batch`` requests (see :meth:`PrimaryReplay.step`)."""
    primary = PrimaryReplay(policy)
    hits = chunks = 0
    for step in batches(requests, batch):
        hits += sum(primary.step([request.blocks for request in step]))
        chunks += sum(len(request.blocks) for request in step)
        if advance is not None:
            for _ in step:
                advance()
    return CellResult(name, policy.capacity, hits, chunks)


def _evict_furthest(
    heap: list[tuple[int, int, int]],
    resident: dict[int, int],
    depth_of: dict[int, int],
    own: Collection[int],
    shortfall: int,
) -> bool:
    """MIN's victims: the chunks, none in ``own``, whose next use is furthest away.

    ``False``, and nothing evicted, when fewer than ``shortfall`` lie outside
    ``own`` (a step that pins and writes nearly the whole tier).
    """
    kept: list[tuple[int, int, int]] = []
    victims: list[tuple[int, int, int]] = []
    while len(victims) < shortfall and heap:
        entry = heapq.heappop(heap)
        if resident.get(entry[2]) != -entry[0]:
            continue  # stale: the block was used again or evicted since
        (kept if entry[2] in own else victims).append(entry)
    enough = len(victims) == shortfall
    for entry in kept if enough else kept + victims:
        heapq.heappush(heap, entry)
    if not enough:
        return False
    for _, _, block in victims:
        del resident[block]
        del depth_of[block]
    return True


def belady_min(
    requests: Sequence[Request], capacity: int, advance: Advance | None = None, *, batch: int = 1
) -> CellResult:
    """Belady's MIN: evict the chunk whose next use is furthest away.

    Same admissions as :class:`PrimaryReplay` (every chunk of a request is
    stored, none of them is a victim for it; in steps of ``batch`` requests,
    every lookup of a step before its stores, and no chunk the step loads or
    writes a victim); only the choice of victim knows the future. Among
    chunks never used again, the deepest goes first. O(log n) a chunk with a
    lazily pruned heap.
    """
    never = len(requests) + 1
    # next_use[offset[r] + i]: the request after r that next holds requests[r].blocks[i].
    # One flat array of machine ints: 8 bytes a chunk, whatever the trace's length.
    total = sum(len(request.blocks) for request in requests)
    next_use = array("q", bytes(8 * total))
    upcoming: dict[int, int] = {}
    end = total
    for index in range(len(requests) - 1, -1, -1):
        blocks = requests[index].blocks
        end -= len(blocks)
        for position, block in enumerate(blocks, end):
            next_use[position] = upcoming.get(block, never)
        for block in blocks:
            upcoming[block] = index
    del upcoming
    resident: dict[int, int] = {}  # block -> its next use
    depth_of: dict[int, int] = {}  # block -> its depth when last stored, to rebuild the heap
    # Max-heap on (next use, depth) as negated tuples; stale entries are skipped.
    heap: list[tuple[int, int, int]] = []
    hits = chunks = 0
    for step in batches(requests, batch):
        starts = []
        busy: set[int] = set()  # loaded or written in this step: no victims
        for request in step:
            blocks = request.blocks
            starts.append(chunks)
            chunks += len(blocks)
            for block in blocks:
                if block not in resident:
                    break
                hits += 1
                if batch > 1:
                    busy.add(block)
        for request, start in zip(step, starts, strict=True):
            stored = request.blocks[:capacity]
            own = busy.union(stored) if busy else set(stored)
            evict = functools.partial(_evict_furthest, heap, resident, depth_of, own)
            if store_step(stored, resident, capacity, evict) is None:
                stored = tuple(block for block in stored if block in resident)
            # Every stored chunk, new or not, gets its next use (MIN's "touch").
            for depth, block in enumerate(stored):
                upcoming_use = next_use[start + depth]
                if resident.get(block) != upcoming_use:
                    resident[block] = upcoming_use
                    depth_of[block] = depth
                    heapq.heappush(heap, (-upcoming_use, -depth, block))
            if batch > 1:
                busy.update(stored)
        if len(heap) > 2 * len(resident) + 1024:
            # Mostly stale entries: rebuild, so the heap stays bounded by the capacity.
            heap = [(-use, -depth_of[block], block) for block, use in resident.items()]
            heapq.heapify(heap)
        if advance is not None:
            for _ in step:
                advance()
    return CellResult("min", capacity, hits, chunks)
