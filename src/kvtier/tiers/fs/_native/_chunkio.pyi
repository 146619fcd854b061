# The compiled chunk-file I/O (_chunkio.c); see kvtier.tiers.fs.io for the contract.
from collections.abc import Sequence

from typing_extensions import Buffer

def store(
    temp_path: str,
    final_path: str,
    payload: Buffer,
    trailer: Buffer,
    direct: bool,
    fsync: bool,
    digest_at: int,
    /,
) -> bool: ...
def load(
    path: str,
    out: Buffer,
    trailer: Buffer,
    direct: bool,
    stamp_after_s: float,
    digest: Buffer | None,
    /,
) -> int: ...
def complete(paths: Sequence[str], size: int, /) -> list[bool]: ...
def bind_xxh3(module_path: str, /) -> bool: ...
def checksum(data: Buffer, /) -> bytes: ...
def load_all(
    paths: Sequence[str],
    outs: Sequence[Buffer],
    trailers: Sequence[Buffer],
    direct: bool,
    stamp_after_s: float,
    digests: Sequence[Buffer] | None,
    /,
) -> list[int | OSError]: ...
