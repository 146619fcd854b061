from collections import OrderedDict, deque
from collections.abc import Collection, Sequence

from kvtier.keys import ChunkKey

Entries = OrderedDict[ChunkKey, None]

def arc_insert_all(
    t1: Entries,
    t2: Entries,
    b1: Entries,
    b2: Entries,
    keys: Sequence[ChunkKey],
    p: int,
    capacity: int,
) -> int: ...
def arc_demote(
    t1: Entries,
    t2: Entries,
    b1: Entries,
    b2: Entries,
    from_t1: Sequence[ChunkKey],
    from_t2: Sequence[ChunkKey],
    capacity: int,
) -> None: ...
def s3fifo_evict_small(
    small: deque[ChunkKey],
    main: deque[ChunkKey],
    ghost: Entries,
    counts: dict[ChunkKey, int],
    protected: Collection[ChunkKey],
    held: list[ChunkKey],
    victims: list[ChunkKey],
    wanted: int,
    small_capacity: int,
    capacity: int,
    main_count: int,
) -> bool: ...
