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


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> ChunkKey:
    """The key of one chunk given the key of the chunk before it."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kvtier-chunk")
    digest.update(np.asarray(tokens, dtype=_TOKEN_DTYPE).tobytes())
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
    parent: bytes = namespace
    for index in range(len(array) // chunk_tokens):
        chunk = array[index * chunk_tokens : (index + 1) * chunk_tokens]
        parent = chain_key(parent, chunk, extras[index] if extras else b"")
        yield ChunkKey(parent)


def chunk_keys(
    namespace: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[ChunkKey]:
    """The keys of every full chunk of ``tokens``, in order."""
    return list(iter_chunk_keys(namespace, tokens, chunk_tokens, extras))
