"""Replaying a trace through a cache policy, and through Belady's MIN.

Hit ratio = leading resident chunks / all chunks: a request reuses the
chunks of its prefix that are resident, up to the first that is not.
"""

from __future__ import annotations

import functools
import heapq
from array import array
from collections.abc import Callable, Collection, Sequence
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
    """

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.slots = policy.capacity
        self.resident: set[int] = set()

    def request(self, blocks: Sequence[int]) -> int:
        """Replay one request; returns its leading resident chunks."""
        policy, resident = self.policy, self.resident
        keys: list[ChunkKey] = blocks  # type: ignore[assignment]  # any hashable will do
        hits = 0
        for block in blocks:
            if block not in resident:
                break
            hits += 1
        if hits:
            leading = keys[:hits]
            policy.touch(leading)  # the lookup; a load pins without touching
        self.store(blocks)
        return hits

    def store(self, blocks: Sequence[int]) -> list[int]:
        """``KVCache.store`` of a request: returns the chunks written (none if no room)."""
        policy, resident = self.policy, self.resident
        stored = blocks[: self.slots]

        def make_room(shortfall: int) -> bool:
            victims = policy.evict(shortfall, set(stored))  # type: ignore[arg-type]
            if victims is None:  # the request alone fills the tier: it stores nothing
                return False
            resident.difference_update(victims)
            return True

        new = store_step(stored, resident, self.slots, make_room)
        if new is None:
            return []
        for block in new:
            resident.add(block)
            policy.insert(block)  # type: ignore[arg-type]
        return new


def replay(
    requests: Sequence[Request], policy: CachePolicy, name: str, advance: Advance | None = None
) -> CellResult:
    """Hit count of ``policy`` (fresh, at its own capacity) over ``requests``."""
    primary = PrimaryReplay(policy)
    hits = chunks = 0
    for request in requests:
        hits += primary.request(request.blocks)
        chunks += len(request.blocks)
        if advance is not None:
            advance()
    return CellResult(name, policy.capacity, hits, chunks)


def _evict_furthest(
    heap: list[tuple[int, int, int]],
    resident: dict[int, int],
    depth_of: dict[int, int],
    own: set[int],
    shortfall: int,
) -> bool:
    """MIN's victims: the chunks, none in ``own``, whose next use is furthest away.

    Never short of them: a request's own chunks fit the capacity.
    """
    kept: list[tuple[int, int, int]] = []
    while shortfall > 0:
        entry = heapq.heappop(heap)
        _, _, block = entry
        if resident.get(block) != -entry[0]:
            continue  # stale: the block was used again or evicted since
        if block in own:
            kept.append(entry)
            continue
        del resident[block]
        del depth_of[block]
        shortfall -= 1
    for entry in kept:
        heapq.heappush(heap, entry)
    return True


def belady_min(
    requests: Sequence[Request], capacity: int, advance: Advance | None = None
) -> CellResult:
    """Belady's MIN: evict the chunk whose next use is furthest away.

    Same admissions as :class:`PrimaryReplay` (every chunk of a request is
    stored, none of them is a victim for it); only the choice of victim knows
    the future. Among chunks never used again, the deepest goes first.
    O(log n) a chunk with a lazily pruned heap.
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
    for request in requests:
        blocks = request.blocks
        start = chunks
        chunks += len(blocks)
        for block in blocks:
            if block not in resident:
                break
            hits += 1
        stored = blocks[:capacity]

        evict = functools.partial(_evict_furthest, heap, resident, depth_of, set(stored))
        store_step(stored, resident, capacity, evict)
        # Every stored chunk, new or not, gets its next use (MIN's "touch").
        for depth, block in enumerate(stored):
            upcoming_use = next_use[start + depth]
            if resident.get(block) != upcoming_use:
                resident[block] = upcoming_use
                depth_of[block] = depth
                heapq.heappush(heap, (-upcoming_use, -depth, block))
        if len(heap) > 2 * len(resident) + 1024:
            # Mostly stale entries: rebuild, so the heap stays bounded by the capacity.
            heap = [(-use, -depth_of[block], block) for block, use in resident.items()]
            heapq.heapify(heap)
        if advance is not None:
            advance()
    return CellResult("min", capacity, hits, chunks)
