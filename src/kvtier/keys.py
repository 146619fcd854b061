"""Prefix-chained chunk keys.

``key_i = H(key_{i-1}, tokens_i, extra_i)`` with ``key_{-1}`` the layout's
namespace digest, so equal keys mean equal whole prefixes under equal layouts.
BLAKE2b over little-endian token ids makes keys identical across processes and
machines, whatever ``PYTHONHASHSEED`` says.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np

from kvtier.inputs import count, token_array, token_bytes
from kvtier.layout import KEY_BYTES

#: A chunk key: ``KEY_BYTES`` bytes of BLAKE2b digest.
ChunkKey = NewType("ChunkKey", bytes)

_TOKEN_DTYPE = np.dtype("<i8")


#: BLAKE2b set up once with kvtier's parameters; each key hashes a copy.
_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-chunk")


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> ChunkKey:
    """The key of one chunk given the key of the chunk before it (or the
    layout's namespace, for the first). Token ids must be integers."""
    _check_bytes(parent, "parent")
    _check_bytes(extra, "extra")
    return _chain_key(parent, token_bytes(tokens), extra)


def _chain_key(parent: bytes, token_bytes: bytes | memoryview, extra: bytes) -> ChunkKey:
    digest = _HASHER.copy()
    digest.update(parent)
    digest.update(token_bytes)
    if extra:
        # Length-prefixed so that (tokens, extra) pairs can never alias.
        digest.update(len(extra).to_bytes(8, "little"))
        digest.update(extra)
    return ChunkKey(digest.digest())


def chunk_keys(
    namespace: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[ChunkKey]:
    """The keys of every *full* chunk of ``tokens``, in order; a partial tail has no key.

    ``extras[i]``, when given, mixes per-chunk data into the key (LoRA id,
    multimodal hashes, a tenant salt) without changing the token ids.
    """
    _check_bytes(namespace, "namespace")
    step = count(chunk_tokens, "chunk_tokens", minimum=1)
    data, chunks = _full_chunk_bytes(token_array(tokens), step)
    if extras is not None:
        _check_extras(extras, chunks)
    return _keys_of_bytes(namespace, data, chunks, extras)


def _full_chunk_bytes(tokens: Sequence[int] | np.ndarray, chunk_tokens: int) -> tuple[bytes, int]:
    """The little-endian bytes of the full chunks of ``tokens``, checked
    already (:func:`~kvtier.inputs.token_array`), and how many there are."""
    array = np.asarray(tokens, dtype=_TOKEN_DTYPE)
    chunks = len(array) // chunk_tokens
    return array[: chunks * chunk_tokens].tobytes(), chunks


def _check_bytes(value: object, where: str) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{where}: expected bytes, got {type(value).__name__}")


def _check_extras(extras: Sequence[bytes], chunks: int) -> None:
    """One bytes value per full chunk, at least."""
    if isinstance(extras, str | bytes) or not hasattr(extras, "__len__"):
        raise TypeError(f"extras: expected a sequence of bytes, got {type(extras).__name__}")
    if len(extras) < chunks:
        raise ValueError(f"extras: {len(extras)} given for {chunks} full chunks; give one each")
    for index in range(chunks):
        _check_bytes(extras[index], f"extras[{index}]")


def _keys_of_bytes(
    namespace: bytes, data: bytes, chunks: int, extras: Sequence[bytes] | None = None
) -> list[ChunkKey]:
    # One conversion for the whole prompt; each chunk hashes a slice of it.
    view = memoryview(data)
    step = len(data) // chunks if chunks else 0
    parent: bytes = namespace
    if extras:
        keys: list[ChunkKey] = []
        for index in range(chunks):
            parent = _chain_key(parent, view[index * step : (index + 1) * step], extras[index])
            keys.append(ChunkKey(parent))
        return keys
    return _hash_chain(parent, view, step, chunks)


def keys_of_token_bytes(
    namespace: bytes, data: bytes, chunk_tokens: int, extras: Sequence[bytes] | None = None
) -> list[ChunkKey]:
    """The keys of the full chunks of the tokens whose little-endian int64 ids
    are ``data`` (a partial tail has none): :func:`chunk_keys` of checked tokens."""
    step = chunk_tokens * _TOKEN_DTYPE.itemsize
    chunks = len(data) // step
    if extras:
        return _keys_of_bytes(namespace, data[: chunks * step], chunks, extras)
    return _hash_chain(namespace, memoryview(data), step, chunks)


def _hash_chain(parent: bytes, view: memoryview, step: int, chunks: int) -> list[ChunkKey]:
    """The chained keys of ``chunks`` slices of ``step`` bytes of ``view``."""
    # Hashing is most of a request's work: :func:`_chain_key` inlined, no call per chunk.
    copy = _HASHER.copy
    # Typed as the keys they become: ``cast`` would be a Python call per request.
    digests: list[Any] = []
    append = digests.append
    for start in range(0, chunks * step, step or 1):
        digest = copy()
        digest.update(parent)
        digest.update(view[start : start + step])
        parent = digest.digest()
        append(parent)
    return digests


def checked_keys(keys: Any) -> tuple[ChunkKey, ...]:
    """``keys`` as a tuple, each checked by :func:`check_keys`."""
    _refuse_non_sequence(keys)
    keys = tuple(keys)
    check_keys(keys)
    return keys


def check_keys(keys: Sequence[Any], start: int = 0, stop: int | None = None) -> None:
    """Raise ``TypeError`` naming the first of ``keys[start:stop]`` that is not
    a chunk key (``KEY_BYTES`` bytes, as :func:`chain_key` makes), or ``keys``
    itself where it is no sequence of them: a key of another type would fail
    every secondary tier's batch it rode in, and could open a remote tier's
    breaker for every request."""
    # One C pass, a microsecond for a long prompt's keys. It lets through only
    # wrong lengths that add up to right ones, which every tier still takes
    # as the opaque bytes they are.
    try:
        part = keys[start:stop] if start or stop is not None else keys
        if len(b"".join(part)) == KEY_BYTES * len(part):
            return
    except TypeError:
        pass  # named below
    _refuse_non_sequence(keys)
    for index, key in enumerate(keys[start:stop], start):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
            raise TypeError(
                f"keys[{index}]: expected a chunk key of {KEY_BYTES} bytes "
                f"(a digest from chain_key), got {got}"
            )


def _refuse_non_sequence(keys: Any) -> None:
    """A ``TypeError`` unless ``keys`` may be a sequence of keys: a string or
    one key alone would be read as keys of a character or a byte each."""
    if isinstance(keys, str | bytes | bytearray | memoryview) or not hasattr(keys, "__iter__"):
        raise TypeError(
            f"keys: expected a sequence of chunk keys ({KEY_BYTES}-byte digests), "
            f"got {type(keys).__name__}"
        )


@dataclass(frozen=True, slots=True)
class KeyedTokens:
    """A token sequence keyed once: what one request's lookup, load and store share.

    Made by :meth:`kvtier.KVCache.keyed`; those calls take it in place of the
    token ids and then neither check nor hash them again.
    """

    #: The namespace digest the keys chain from (that of the cache which made them).
    namespace: bytes
    #: The key of each full chunk, in order.
    keys: tuple[ChunkKey, ...]
    #: Tokens in the sequence, the partial tail included.
    num_tokens: int

    def __len__(self) -> int:
        return self.num_tokens


class KeyMemo:
    """The chunk keys of the last few token sequences keyed, by their content.

    A request keys its prompt for its lookup, its load and its store; with
    the memo it is hashed once. Bounded in entries and in token bytes held;
    thread-safe. Returns a new list on every call.
    """

    def __init__(
        self, namespace: bytes, chunk_tokens: int, *, entries: int = 32, max_bytes: int = 16 << 20
    ) -> None:
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.entries = entries
        self.max_bytes = max_bytes
        self._memo: OrderedDict[bytes, list[ChunkKey]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keys(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> list[ChunkKey]:
        """The keys of the full chunks of ``tokens``, checked already (the
        first ``limit`` of them, if given)."""
        return self._keys(*_full_chunk_bytes(tokens, self.chunk_tokens), limit)

    def keys_of_bytes(self, data: bytes, limit: int | None = None) -> list[ChunkKey]:
        """:meth:`keys` of the tokens whose little-endian int64 ids are ``data``."""
        step = self.chunk_tokens * _TOKEN_DTYPE.itemsize
        chunks = len(data) // step
        tail = len(data) - chunks * step
        return self._keys(data[:-tail] if tail else data, chunks, limit)

    def _keys(self, data: bytes, chunks: int, limit: int | None) -> list[ChunkKey]:
        """``data``: the bytes of ``chunks`` full chunks."""
        with self._lock:
            known = self._memo.get(data)
            if known is not None:
                self._memo.move_to_end(data)
                return known[:limit]
        if limit is not None and limit < chunks:
            # Only a prefix wanted: hash just that, and keep nothing partial.
            prefix = data[: len(data) // chunks * limit] if chunks else data
            return _keys_of_bytes(self.namespace, prefix, limit)
        keys = _keys_of_bytes(self.namespace, data, chunks)
        if len(data) <= self.max_bytes:
            with self._lock:
                if data not in self._memo:
                    self._memo[data] = keys
                    self._bytes += len(data)
                while len(self._memo) > self.entries or self._bytes > self.max_bytes:
                    self._bytes -= len(self._memo.popitem(last=False)[0])
        return keys[:limit]
