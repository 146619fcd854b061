"""Raw access to what a built-in tier stores, for damage tests.

A contract test damages a stored chunk the way a crash or a faulty store
would (cut short, a length changed) and checks that the tier never serves
it. These read and replace one key's stored value exactly as the tier's
backend holds it: the framed value of ``memory`` and the remote tiers, the
chunk file of ``fs`` (payload, then the trailer that holds the header).
Out-of-tree tiers override :meth:`TierContractTests.read_stored` and
:meth:`~TierContractTests.write_stored` instead.
"""

from __future__ import annotations

import os

from kvtier.integrity import HEADER_BYTES
from kvtier.keys import ChunkKey
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.fs.io import TRAILER_BLOCK
from kvtier.tiers.fs.tier import FilesystemTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.remote import RemoteTier

#: Where a stored value's payload length sits in its integrity header.
LENGTH_OFFSET = 8


def knows(tier: SecondaryTier) -> bool:
    """Whether these functions reach ``tier``'s stored values."""
    return isinstance(tier, MemoryTier | FilesystemTier | RemoteTier)


def read_stored(tier: SecondaryTier, key: ChunkKey) -> bytes:
    """The bytes ``tier`` holds for ``key``, as its backend holds them."""
    if isinstance(tier, MemoryTier):
        with tier.backend._chunks_lock:
            return tier.backend._chunks[key]
    if isinstance(tier, FilesystemTier):
        with open(tier.dir.chunk_path(key), "rb") as handle:
            return handle.read()
    if isinstance(tier, RemoteTier):
        [value] = tier.backend.get_many([tier.store_name(key)])
        if not isinstance(value, bytes | bytearray | memoryview):
            raise LookupError(f"{tier.tier_type}: no value for {key.hex()}: {value!r}")
        return bytes(value)
    raise NotImplementedError(f"no raw access to {type(tier).__name__}'s stored values")


def write_stored(tier: SecondaryTier, key: ChunkKey, value: bytes) -> None:
    """Make ``tier``'s backend hold ``value`` for ``key``, whatever it is."""
    if isinstance(tier, MemoryTier):
        with tier.backend._chunks_lock:
            tier.backend._chunks[key] = value
        return
    if isinstance(tier, FilesystemTier):
        path = tier.dir.chunk_path(key)
        temp = tier.dir.temp_path(path)
        with open(temp, "wb") as handle:
            handle.write(value)
        os.replace(temp, path)
        return
    if isinstance(tier, RemoteTier):
        name = tier.store_name(key)
        tier.backend.delete(name)  # some stores keep the first value put under a name
        # The tier's own buffers: a store moving values from registered
        # memory takes no other.
        buffer = memoryview(tier.store.scratch_values(1)[0])
        buffer[: len(value)] = value
        [error] = tier.backend.put_many([name], [buffer[: len(value)]])
        if error is not None:
            raise error
        return
    raise NotImplementedError(f"no raw access to {type(tier).__name__}'s stored values")


def length_offset(tier: SecondaryTier, value: bytes) -> int:
    """Where the payload length of stored ``value`` sits in it."""
    if isinstance(tier, FilesystemTier):  # the header opens the trailer, after the payload
        return len(value) - TRAILER_BLOCK + LENGTH_OFFSET
    return LENGTH_OFFSET


def payload_offset(tier: SecondaryTier) -> int:
    """Where a stored value's payload starts in it."""
    return 0 if isinstance(tier, FilesystemTier) else HEADER_BYTES
