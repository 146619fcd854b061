from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.keys import ChunkKey

def ready_count(ready: dict[ChunkKey, int], keys: Sequence[ChunkKey]) -> int: ...
def pin_prefix(
    ready: dict[ChunkKey, int], pins: dict[ChunkKey, int], keys: Iterable[ChunkKey]
) -> list[int]: ...
def unpin(pins: dict[ChunkKey, int], keys: Sequence[ChunkKey]) -> int: ...
def new_keys(
    ready: dict[ChunkKey, int], writing: dict[ChunkKey, int], keys: Iterable[ChunkKey]
) -> dict[ChunkKey, int]: ...
def idle_resident(
    ready: dict[ChunkKey, int], pins: dict[ChunkKey, int], keys: Iterable[ChunkKey]
) -> list[ChunkKey]: ...
def take_slots(
    reserved: dict[ChunkKey, int], free: list[int], writing: dict[ChunkKey, int]
) -> None: ...
def free_victims(
    ready: dict[ChunkKey, int], free: list[int], victims: Iterable[ChunkKey]
) -> None: ...
def finish_writes(
    writing: dict[ChunkKey, int], keys: Iterable[ChunkKey]
) -> dict[ChunkKey, int]: ...
def copy_rows(
    target: np.ndarray, target_rows: Sequence[int], source: np.ndarray, source_rows: Sequence[int]
) -> None: ...
def touch_pages(
    buffer: memoryview | np.ndarray,
    piece: int,
    stop: bytearray | np.ndarray | None = None,
    fd: int = -1,
) -> None: ...
