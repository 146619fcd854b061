"""``KVCache``: kvtier for an engine in a handful of calls.

    cache = KVCache(config, layout)
    with cache.lookup(tokens) as found:        # the cached prefix, held
        found.load(out)                        # copy found.num_tokens tokens in
    ... prefill tokens[found.num_tokens:] ...
    cache.store(tokens, src)                   # offload the new full chunks

Chunks travel as ``uint8`` rows of ``layout.slot_bytes`` bytes (or rows of
the layout's shape and dtype); the integrations turn them into and out of
the engine's own tensors.

One ``KVCache`` may be shared by any number of threads: every method may be
called from any thread, at once. Bytes are copied on the calling thread,
outside the manager's lock. See the threading model in the architecture docs.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ClosedError
from kvtier.inputs import TokenIds, chunk_rows, chunks_of, count, seconds, token_array
from kvtier.keys import ChunkKey, KeyMemo
from kvtier.layout import KVLayout
from kvtier.lifecycle import Lifecycle
from kvtier.manager import TieringManager
from kvtier.metrics import KVTierMetrics, attach_metrics
from kvtier.prefix import ChunkCopier, HeldPrefix, copy_out
from kvtier.sim.record import TraceRecorder
from kvtier.specs.factory import OffloadingSpecFactory

__all__ = ["ChunkCopier", "HeldPrefix", "KVCache"]

#: Longest a lookup waiting for promotions sleeps between looks when every
#: tier announces its progress: a change none announced is seen this late.
_UNANNOUNCED_S = 0.05


class KVCache:
    """A kvtier manager plus the key bookkeeping an engine needs. Thread-safe."""

    def __init__(
        self,
        config: KVTierConfig | Mapping[str, Any] | str | Path | None,
        layout: KVLayout,
        *,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        """``metrics_registry``: where the metrics go (default: per the ``metrics``
        section, a registry of this cache's own)."""
        self.config = load_config(config)
        self.layout = layout
        self.spec = OffloadingSpecFactory.create_spec(self.config, layout)
        self.manager: TieringManager = self.spec.build_manager()
        try:
            # Owned by the manager from here: its shutdown closes the recorder.
            self.manager.trace_recorder = TraceRecorder.from_config(
                self.config.trace_recording, layout.chunk_tokens
            )
            self.metrics: KVTierMetrics = attach_metrics(
                self.manager, self.config.metrics, metrics_registry
            )
        except BaseException:
            self.manager.shutdown()
            raise
        #: Admits calls until :meth:`close`, which waits for the copies in progress.
        self.lifecycle = Lifecycle("KVCache")
        self._key_memo = KeyMemo(layout.namespace, layout.chunk_tokens)
        self._close_lock = threading.Lock()

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def closed(self) -> bool:
        return self.lifecycle.closed

    def keys(self, tokens: TokenIds) -> list[ChunkKey]:
        """Keys of the full chunks of ``tokens`` (ints: floats and bools are refused)."""
        self.lifecycle.check()
        with self.lifecycle.running():
            return self._keys(token_array(tokens))

    def _keys(self, tokens: np.ndarray, limit: int | None = None) -> list[ChunkKey]:
        # A request's lookup, load and store key the same prompt: hashed once.
        return self._key_memo.keys(tokens, limit)

    def lookup(
        self,
        tokens: TokenIds,
        *,
        request_id: str | None = None,
        timeout: float = 30.0,
        poll_s: float = 0.0005,
    ) -> HeldPrefix:
        """The cached prefix of ``tokens``, held until released (use it as a context manager).

        Waits for promotions from secondary tiers for up to ``timeout``
        seconds (``0``: answers with what is ready now, and the promotions it
        started go on), pinning the leading chunks as they become ready. The
        holder's :attr:`~HeldPrefix.num_tokens` can all be loaded, whatever
        other threads store meanwhile. A chunk whose promotion failed is not
        retried within the call. ``request_id`` groups lookups of one
        request (the caller then ends it with ``manager.on_request_finished``).
        """
        self.lifecycle.check()
        array = token_array(tokens)
        # NaN would never compare past the deadline: a lookup waiting for ever.
        timeout = seconds(timeout, "timeout")
        poll_s = seconds(poll_s, "poll_s")
        keys = self._keys(array)
        recorder = self.manager.trace_recorder
        if recorder is not None and not self.closed:  # one record a lookup: what simulate replays
            recorder.record(keys, len(array))
        owned = request_id is None
        request = f"kvtier-{uuid.uuid4().hex}" if request_id is None else request_id
        manager = self.manager
        deadline = time.monotonic() + timeout
        slots: list[int] = []
        waited = False
        try:
            while True:
                with self.lifecycle.running():
                    if waited:  # the results that woke it, before it looks again
                        manager.collect()
                    # Taken after that collect: results applied from here on
                    # (by this pass's step too) move it, so none is missed.
                    mark = manager.progress_mark
                    rest = keys[len(slots) :]
                    result = manager.lookup(rest, request)
                    pinned = manager.pin_prefix(rest[: result.hit_chunks])
                    slots += pinned
                    # Fewer pinned than found: evicted in between; look again.
                    evicted = len(pinned) < result.hit_chunks
                    left = deadline - time.monotonic()
                    if not (result.pending or evicted) or left <= 0:
                        return HeldPrefix(
                            self, keys[: len(slots)], slots, result.pending or evicted
                        )
                    manager.step()  # submits the promotions this lookup started
                waited = True
                if evicted or not manager.announces_progress:
                    time.sleep(poll_s)
                else:
                    # Woken by the tiers when a job ends or a check answers;
                    # the bound only covers a change nobody announced.
                    manager.wait_for_progress(mark, min(left, max(poll_s, _UNANNOUNCED_S)))
        except BaseException:
            self._unpin(keys[: len(slots)])
            raise
        finally:
            if owned:
                with suppress(ClosedError), self.lifecycle.running():
                    self.manager.on_request_finished(request)

    def cached_prefix(
        self,
        tokens: TokenIds,
        *,
        request_id: str | None = None,
        timeout: float = 30.0,
        poll_s: float = 0.0005,
    ) -> int:
        """Tokens of ``tokens`` that could be loaded now, after waiting for promotions.

        Holds nothing: another thread may evict them before a :meth:`load`,
        which then loads fewer. Use :meth:`lookup` to hold what was found.
        """
        with self.lookup(tokens, request_id=request_id, timeout=timeout, poll_s=poll_s) as found:
            return found.num_tokens

    def load(self, tokens: TokenIds, num_tokens: int, out: np.ndarray | ChunkCopier) -> int:
        """Copy the chunks of the first ``num_tokens`` tokens out of kvtier; returns
        the tokens really loaded.

        ``out`` is an array with a row per chunk (``(chunks, slot_bytes)``
        ``uint8``, or ``(chunks, *layout.chunk_shape)`` in the layout's dtype,
        C-contiguous) or a function called as ``out(index, chunk)`` per chunk
        while the chunk is pinned. Loads the leading chunks ready now: fewer
        than asked when some were evicted since a :meth:`cached_prefix` (or
        never cached), so use the return value. ``num_tokens`` past the full
        chunks of ``tokens`` is a ``ValueError``.
        """
        self.lifecycle.check()
        array = token_array(tokens)
        full = len(array) - len(array) % self.chunk_tokens
        chunks = chunks_of(num_tokens, self.chunk_tokens, full, "num_tokens")
        if not callable(out):
            chunk_rows(out, chunks, self.layout, "out", writable=True)
        keys = self._keys(array, chunks)
        with self.lifecycle.running():
            slots = self.manager.pin_prefix(keys)
            try:
                copy_out(self, slots, out)
            finally:
                self.manager.complete_load(keys[: len(slots)])
        return len(slots) * self.chunk_tokens

    def store(
        self,
        tokens: TokenIds,
        src: np.ndarray | ChunkCopier,
        *,
        num_chunks: int | None = None,
    ) -> int:
        """Offload the full chunks of ``tokens`` that kvtier does not hold yet.

        ``src`` is an array whose row ``i`` holds chunk ``i`` (shaped as for
        :meth:`load`; anything else is a ``ValueError`` naming the expected
        shape), or a function called as ``src(index, slot)`` to fill a slot.
        ``num_chunks`` stores only the first chunks. Returns the number of
        chunks written; ``0`` when they were all present or the primary tier
        had no room. At most as many chunks as the primary tier has slots are
        stored, from the start.
        """
        self.lifecycle.check()
        array = token_array(tokens)
        full = len(array) // self.chunk_tokens
        wanted = full if num_chunks is None else count(num_chunks, "num_chunks")
        if wanted > full:
            raise ValueError(f"num_chunks={wanted} exceeds the {full} full chunks of tokens")
        # No more than the primary tier holds: a prefix is only worth its first chunks.
        wanted = min(wanted, self.manager.primary.num_slots)
        rows = None
        if not callable(src):
            rows = chunk_rows(src, wanted, self.layout, "src", writable=False)
        keys = self._keys(array, wanted)
        with self.lifecycle.running():
            reserved = self.manager.prepare_store(keys)
            if not reserved:
                return 0
            written: list[ChunkKey] = []
            try:
                for index, key in enumerate(keys):
                    slot = reserved.get(key)
                    if slot is None:
                        continue
                    chunk = self.manager.primary.buffer.slot(slot)
                    if rows is not None:
                        chunk[:] = rows[index]
                    else:
                        src(index, chunk)  # type: ignore[operator]
                    written.append(key)
            except BaseException:
                self.manager.complete_store(list(reserved), success=False)
                raise
            self.manager.complete_store(written, success=True)
        return len(written)

    def step(self) -> None:
        """Drive pending work: collect finished transfers, submit promotions."""
        with self.lifecycle.running():
            self.manager.step()

    def drain(self) -> None:
        """Wait until every transfer in flight has ended."""
        with self.lifecycle.running():
            self.manager.drain()

    def _unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Release chunks pinned for this cache's lookups (nothing to do once closed)."""
        if keys:
            with suppress(ClosedError), self.lifecycle.running():
                self.manager.complete_load(keys)

    def close(self) -> None:
        """Drain and stop the tiers. Idempotent.

        Waits for the loads and stores copying right now, and refuses every
        later call with :class:`~kvtier.errors.ClosedError`. Lookups still
        held lose their chunks: their ``load`` raises ``ClosedError``.
        """
        with self._close_lock:
            if not self.lifecycle.close():
                return
            self.metrics.close()
            self.manager.shutdown()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
