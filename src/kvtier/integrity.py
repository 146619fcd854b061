"""The header every stored chunk carries outside the primary tier.

Each tier that keeps chunk bytes somewhere else (a file, a Redis value, an
object, a peer's reply) frames them with this header, so one check decides
whether bytes may enter a primary slot: right magic and version, right
namespace, right key, full length, matching checksum. Anything else is a
:class:`~kvtier.errors.CorruptChunkError`, never data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.errors import CorruptChunkError
from kvtier.layout import FORMAT_VERSION, KEY_BYTES

MAGIC = b"KVTC"
# magic, format version, flags, payload length, xxh3-128 checksum, namespace, key
_HEADER = struct.Struct(f"<4sHHQ16s{KEY_BYTES}s{KEY_BYTES}s")
#: Header length in bytes; padded so the payload after it stays 8-byte aligned.
HEADER_BYTES = (_HEADER.size + 7) // 8 * 8
_PADDING = b"\0" * (HEADER_BYTES - _HEADER.size)
#: Where the 16-byte checksum sits in a packed header (after magic, version,
#: flags and length), for writers that fill it in later (see ``digest``).
DIGEST_OFFSET = struct.calcsize("<4sHHQ")
DIGEST_BYTES = 16


def checksum(payload: bytes | memoryview) -> bytes:
    """A fast 128-bit non-cryptographic checksum of ``payload``."""
    return xxhash.xxh3_128_digest(payload)


def pack_header(
    namespace: bytes, key: bytes, payload: bytes | memoryview, digest: bytes | None = None
) -> bytes:
    """The header for ``payload`` stored under ``key`` in ``namespace``.

    ``digest`` stands in for ``checksum(payload)`` when the caller has it or
    fills it in at :data:`DIGEST_OFFSET` later, in the same pass as the write.
    """
    if digest is None:
        digest = checksum(payload)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(payload), digest, namespace, key) + _PADDING


@dataclass(frozen=True)
class ChunkHeader:
    """A parsed header; :meth:`verify` checks a payload against it."""

    version: int
    payload_bytes: int
    digest: bytes
    namespace: bytes
    key: bytes

    def verify(self, payload: bytes | memoryview) -> None:
        """Raise :class:`CorruptChunkError` unless ``payload`` is the stored one."""
        if len(payload) != self.payload_bytes:
            raise CorruptChunkError(
                f"chunk payload is {len(payload)} bytes, header says {self.payload_bytes}"
            )
        self.check_digest(checksum(payload))

    def check_digest(self, digest: bytes | None) -> None:
        """Raise :class:`CorruptChunkError` unless ``digest``, the checksum of
        the payload as read, is the stored one."""
        if digest != self.digest:
            raise CorruptChunkError("chunk checksum mismatch")


def unpack_header(
    raw: bytes | memoryview,
    *,
    namespace: bytes,
    key: bytes,
    payload_bytes: int,
    exact_size: bool = True,
) -> ChunkHeader:
    """Parse and check a header against what the reader expects: a payload of
    ``payload_bytes`` (at most, with ``exact_size`` false: a variable-size codec)."""
    if len(raw) < HEADER_BYTES:
        raise CorruptChunkError(f"chunk header truncated to {len(raw)} bytes")
    magic, version, _flags, length, digest, stored_ns, stored_key = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptChunkError("not a kvtier chunk (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(f"chunk format version {version}, expected {FORMAT_VERSION}")
    if stored_ns != namespace:
        raise CorruptChunkError("chunk belongs to another namespace")
    if stored_key != key:
        raise CorruptChunkError("chunk stored under another key")
    if length > payload_bytes or (exact_size and length != payload_bytes):
        raise CorruptChunkError(f"chunk holds {length} bytes, a slot holds {payload_bytes}")
    return ChunkHeader(version, length, digest, stored_ns, stored_key)


def frame(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """Header and payload as one bytes object (for stores that take a value)."""
    # One allocation and one copy: ``header + bytes(payload)`` makes two of
    # each, and fresh multi-MiB allocations cost page faults on every call.
    return b"".join((pack_header(namespace, key, payload), payload))


def frame_into(
    out: bytearray | memoryview, namespace: bytes, key: bytes, payload: bytes | memoryview
) -> None:
    """Frame ``payload`` into ``out``, a reusable buffer of exactly its framed size.

    For tiers that send many chunks: one buffer per worker, reused, spares the
    fresh multi-MiB allocation (and its page faults) :func:`frame` pays per chunk.
    The checksum is taken over the copy in ``out``, still in cache, and so
    covers exactly the bytes that are sent.
    """
    size = HEADER_BYTES + len(payload)
    if len(out) != size:
        raise ValueError(f"a {len(out)}-byte buffer cannot hold a {size}-byte framed chunk")
    view = memoryview(out).cast("B")
    framed = view[HEADER_BYTES:]
    copy_bytes(framed, payload)
    view[:HEADER_BYTES] = pack_header(namespace, key, framed)


def unframe_into(
    value: bytes | bytearray | memoryview,
    out: memoryview,
    *,
    namespace: bytes,
    key: bytes,
    exact_size: bool = True,
) -> None:
    """Verify a framed value, then copy its payload into ``out``: a corrupt
    value never touches it. A shorter payload (``exact_size`` false) goes to
    its start, the rest zeroed: ``out`` holds only this chunk's verified bytes."""
    view = memoryview(value)
    header = unpack_header(
        view, namespace=namespace, key=key, payload_bytes=len(out), exact_size=exact_size
    )
    payload = view[HEADER_BYTES:]
    header.verify(payload)
    copy_bytes(out[: len(payload)], payload)
    if len(payload) < len(out):
        np.frombuffer(out, np.uint8)[len(payload) :] = 0


def verify_in_place(
    header: bytes | memoryview, payload: memoryview, *, namespace: bytes, key: bytes
) -> None:
    """Verify a fixed-size value received in two parts: ``header``, then
    ``payload`` where it is to stay."""
    unpack_header(header, namespace=namespace, key=key, payload_bytes=len(payload)).verify(payload)


def copy_bytes(out: memoryview, data: bytes | bytearray | memoryview) -> None:
    """``out[:] = data`` for byte buffers of equal length, without the interpreter lock.

    A memoryview assignment holds the lock for the whole copy, so the other
    workers of a tier could not even enter or leave their backend calls
    meanwhile; numpy's copy lets them.
    """
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(data, np.uint8))
