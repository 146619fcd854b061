"""The chunk keys of the token ids handed to :class:`~kvtier.KVCache`: a
request's lookup, load and store check and hash its tokens once.

Those calls most often hand over the same list: it is found again by
identity and compared with a copy taken when it was keyed (a list changed in
place is keyed afresh), one pointer comparison per token. Another list or
tuple is checked and hashed: a memo by content would cost every new prompt
more than it saves the rare equal one. Arrays, checked every time, are found
by content (:class:`KeyMemo`).
"""

from __future__ import annotations

import threading
from typing import Any

from kvtier.inputs import TokenIds, token_array, token_list_bytes
from kvtier.keys import ChunkKey, KeyedTokens, KeyMemo, keys_of_token_bytes

#: The keys of a sequence's full chunks, and its length in tokens.
Keyed = tuple[tuple[ChunkKey, ...], int]


class RequestKeys:
    """Chunk keys of token id sequences, each checked and hashed once while
    among the last ``entries`` keyed. Thread-safe; bounded in entries and in
    the tokens whose copies it keeps."""

    def __init__(
        self, namespace: bytes, chunk_tokens: int, *, entries: int = 32, max_tokens: int = 1 << 21
    ) -> None:
        self.memo = KeyMemo(namespace, chunk_tokens, entries=entries)
        self.chunk_tokens = chunk_tokens
        self.entries = entries
        self.max_tokens = max_tokens
        # id(tokens) -> (tokens, its copy when keyed, keys). Holding the
        # sequence keeps its id from going to another object meanwhile.
        self._known: dict[int, tuple[Any, Any, tuple[ChunkKey, ...]]] = {}
        self._tokens = 0
        self._lock = threading.Lock()

    def keys(self, tokens: TokenIds | KeyedTokens) -> Keyed:
        """The keys of the full chunks of ``tokens`` and its length.

        ``TypeError`` or ``ValueError`` naming the token id that is not an
        int (see :func:`~kvtier.inputs.token_array`). Tokens keyed already
        (:class:`~kvtier.keys.KeyedTokens`) hand over their keys, if keyed
        in this namespace.
        """
        if type(tokens) is list or type(tokens) is tuple:
            known = self._known.get(id(tokens))  # a dict read: atomic, no lock
            if known is not None and known[0] is tokens and known[1] == tokens:
                return known[2], len(tokens)
            # Checked and keyed from a copy, so that a change made meanwhile
            # by another thread can never pair these keys with other tokens.
            copy = tokens if type(tokens) is tuple else list(tokens)
            keys = tuple(
                keys_of_token_bytes(self.memo.namespace, token_list_bytes(copy), self.chunk_tokens)
            )
            self._remember(tokens, copy, keys)
            return keys, len(copy)
        if isinstance(tokens, KeyedTokens):
            if tokens.namespace != self.memo.namespace:
                raise ValueError("tokens: keyed by a cache of another layout (namespace)")
            return tokens.keys, tokens.num_tokens
        array = token_array(tokens)
        return tuple(self.memo.keys(array)), len(array)

    def _remember(self, tokens: Any, copy: Any, keys: tuple[ChunkKey, ...]) -> None:
        size = len(copy)
        if size > self.max_tokens:
            return
        known, ident = self._known, id(tokens)
        with self._lock:
            # Counted in a local, written back once: this runs for every new prompt.
            held = self._tokens + size
            replaced = known.pop(ident, None)
            if replaced is not None:
                held -= len(replaced[1])
            known[ident] = (tokens, copy, keys)
            while len(known) > self.entries or held > self.max_tokens:
                held -= len(known.pop(next(iter(known)))[1])
            self._tokens = held
