"""Prefix-chained chunk keys.

``key_i = H(key_{i-1}, tokens_i, extra_i)`` with ``key_{-1}`` the layout's
namespace digest, so equal keys mean equal whole prefixes under equal layouts.
BLAKE2b over little-endian token ids makes keys identical across processes and
machines, whatever ``PYTHONHASHSEED`` says.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import NewType

import numpy as np

from kvtier.layout import KEY_BYTES

#: A chunk key: ``KEY_BYTES`` bytes of BLAKE2b digest.
ChunkKey = NewType("ChunkKey", bytes)

_TOKEN_DTYPE = np.dtype("<i8")


#: BLAKE2b set up once with kvtier's parameters; each key hashes a copy.
_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-chunk")


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> ChunkKey:
    """The key of one chunk given the key of the chunk before it."""
    return _chain_key(parent, np.asarray(tokens, dtype=_TOKEN_DTYPE).tobytes(), extra)


def _chain_key(parent: bytes, token_bytes: bytes | memoryview, extra: bytes) -> ChunkKey:
    digest = _HASHER.copy()
    digest.update(parent)
    digest.update(token_bytes)
    if extra:
        # Length-prefixed so that (tokens, extra) pairs can never alias.
        digest.update(len(extra).to_bytes(8, "little"))
        digest.update(extra)
    return ChunkKey(digest.digest())


def iter_chunk_keys(
    namespace: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> Iterator[ChunkKey]:
    """Yield the key of every *full* chunk of ``tokens``; a partial tail has no key.

    ``extras[i]``, when given, mixes per-chunk data into the key (LoRA id,
    multimodal hashes, a tenant salt) without changing the token ids.
    """
    array = np.asarray(tokens, dtype=_TOKEN_DTYPE)
    chunks = len(array) // chunk_tokens
    # One conversion for the whole prompt; each chunk hashes a slice of it.
    data = memoryview(np.ascontiguousarray(array[: chunks * chunk_tokens]).tobytes())
    step = chunk_tokens * _TOKEN_DTYPE.itemsize
    parent: bytes = namespace
    for index in range(chunks):
        extra = extras[index] if extras else b""
        parent = _chain_key(parent, data[index * step : (index + 1) * step], extra)
        yield ChunkKey(parent)


def chunk_keys(
    namespace: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[ChunkKey]:
    """The keys of every full chunk of ``tokens``, in order."""
    return list(iter_chunk_keys(namespace, tokens, chunk_tokens, extras))
