"""``HeldPrefix``: the cached prefix a lookup found, held until released.

    with cache.lookup(tokens) as found:
        found.num_tokens        # tokens held, whole chunks
        found.load(out)         # copy them into the engine: nothing can evict them

Its chunks stay pinned in the primary tier until the block ends, the
holder calls :meth:`HeldPrefix.release`, or the cache closes.
"""

from __future__ import annotations

import _thread
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvtier.errors import ClosedError
from kvtier.inputs import chunk_rows, chunks_of
from kvtier.keys import ChunkKey
from kvtier.primary.rows import copy_rows

if TYPE_CHECKING:
    from kvtier.layout import KVLayout
    from kvtier.lifecycle import Lifecycle
    from kvtier.manager import TieringManager


class Holder(Protocol):
    """What a held prefix uses of the :class:`~kvtier.KVCache` that made it
    (a protocol, so that this module does not import the facade)."""

    layout: KVLayout
    manager: TieringManager
    lifecycle: Lifecycle

    @property
    def _running(self) -> AbstractContextManager[None]:
        """``lifecycle.running()``, fetched once by the cache."""

    @property
    def chunk_tokens(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def _unpin(self, keys: Sequence[ChunkKey]) -> None: ...


#: Fills (for stores) or reads (for loads) one chunk: ``fn(chunk_index, slot_bytes_array)``.
ChunkCopier = Callable[[int, np.ndarray], None]


def copy_out(
    cache: Holder, slots: Sequence[int], out: np.ndarray | ChunkCopier, *, start: int = 0
) -> None:
    """Copy pinned ``slots``, in order, into ``out``'s rows from row ``start`` on
    (or hand them to a copier as chunks ``start``, ``start + 1``, ...)."""
    slot_rows = cache.manager.primary.buffer.array
    if callable(out):
        for index, slot in enumerate(slots, start):
            out(index, slot_rows[slot])
        return
    rows = chunk_rows(out, start + len(slots), cache.layout, "out", writable=True)
    copy_rows(rows, range(start, start + len(slots)), slot_rows, slots)  # pinned: in range


class HeldPrefix:
    """Leading chunks of a token sequence, pinned in the primary tier.

    Made by :meth:`kvtier.KVCache.lookup`. While held, no eviction can take
    them: :meth:`load` copies exactly :attr:`num_tokens` tokens' chunks.
    Holding chunks keeps their slots from other uses, so hold briefly.
    A holder may be used from any thread; release is idempotent.
    """

    # One a lookup: slots make it cheaper to build and to read.
    __slots__ = ("_cache", "_keys", "_loading", "_lock", "_released", "_slots", "pending")

    def __init__(
        self, cache: Holder, keys: Sequence[ChunkKey], slots: Sequence[int], pending: bool
    ) -> None:
        self._cache = cache
        # Its own sequences: made for it by the lookup, never changed.
        self._keys = keys
        self._slots = slots
        self._released = False
        # A load and a release of the same holder exclude each other: the
        # chunks must stay pinned while they are copied. Re-entrant: a copier
        # may release its own holder (the unpin then waits for the copy's end).
        # The C class itself: threading.RLock is a Python function around it.
        self._lock = _thread.RLock()
        self._loading = 0
        #: Whether more chunks were still on their way when the lookup stopped
        #: waiting (its timeout ran out): a later lookup may find more.
        self.pending = pending

    @property
    def num_chunks(self) -> int:
        return len(self._slots)

    @property
    def num_tokens(self) -> int:
        """Tokens held: whole chunks from the start of the sequence."""
        return len(self._slots) * self._cache.chunk_tokens

    @property
    def keys(self) -> list[ChunkKey]:
        return list(self._keys)

    @property
    def released(self) -> bool:
        """Released by the holder, or by the cache closing."""
        return self._released or self._cache.closed

    def load(self, out: np.ndarray | ChunkCopier, num_tokens: int | None = None) -> int:
        """Copy the first ``num_tokens`` held tokens (default: all) into ``out``.

        ``out`` is an array of at least that many chunk rows (see
        :meth:`kvtier.KVCache.load`) or a copier called as ``out(index, chunk)``.
        Asking for more than is held is a ``ValueError``. Returns the tokens loaded.
        """
        # Entered first: closed or released, it says so before it looks at the arguments.
        with self._cache._running, self._lock:
            if self._released:
                self._refuse_released()
            slots = self._slots
            if num_tokens is None:
                chunks = len(slots)
            else:
                chunks = chunks_of(
                    num_tokens, self._cache.chunk_tokens, self.num_tokens, "num_tokens"
                )
            self._loading += 1
            try:
                copy_out(self._cache, slots if chunks == len(slots) else slots[:chunks], out)
            finally:
                self._loading -= 1
                if self._released and not self._loading:
                    self._cache._unpin(self._keys)  # released by the copier: held until now
        return chunks * self._cache.layout.chunk_tokens

    def release(self) -> None:
        """Unpin the chunks. Idempotent; nothing to do once the cache is closed.

        Called from inside one of this holder's own loads (by its copier),
        the chunks stay pinned until that load ends."""
        self.__exit__()

    def _refuse_released(self) -> None:
        raise ClosedError(f"this lookup of {self.num_chunks} chunks was released; look up again")

    def __enter__(self) -> HeldPrefix:
        return self

    def __exit__(self, *exc: object) -> None:
        # The release itself: a with block, the common way to release, makes a call less.
        with self._lock:
            if self._released:
                return
            self._released = True
            if not self._loading:
                self._cache._unpin(self._keys)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"HeldPrefix(num_tokens={self.num_tokens}, pending={self.pending}, {state})"
