"""``KVCache``: kvtier for an engine in a handful of calls (lookup, load,
store). Every method may be called from any thread, at once; bytes are
copied on the calling thread, outside the manager's lock.

See docs/engine-api.md and docs/threads.md.
"""

from __future__ import annotations

import enum
import itertools
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
from kvtier.inputs import TokenIds, check_str, chunk_rows, chunks_of, count, seconds
from kvtier.keys import ChunkKey, KeyedTokens, checked_keys
from kvtier.layout import KVLayout
from kvtier.lifecycle import Lifecycle
from kvtier.manager import LookupResult, TieringManager
from kvtier.metrics import KVTierMetrics, attach_metrics
from kvtier.prefix import ChunkCopier, HeldPrefix, copy_out
from kvtier.primary.rows import copy_rows
from kvtier.recording import TraceRecorder
from kvtier.request_keys import RequestKeys
from kvtier.residency import ResidencyListener
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.status import CacheStatus

__all__ = ["ChunkCopier", "HeldPrefix", "KVCache"]


class _Copy(enum.Enum):
    """What a hold copies as it pins, besides into an output (``load_prefix``)."""

    NOTHING = "nothing"  # a lookup: its caller loads the held chunks later


#: Ids of the lookups made without a ``request_id``: unique in the process
#: (``next`` on a counter is atomic), and cheaper than a UUID per lookup.
_anonymous_requests = map(f"kvtier-{uuid.uuid4().hex[:12]}-{{}}".format, itertools.count())


class KVCache:
    """kvtier for an engine: the surface engine integrations use (see the
    engine API docs). Thread-safe. Its ``manager`` is internal: watch a
    running cache through :attr:`status`."""

    def __init__(
        self,
        config: KVTierConfig | Mapping[str, Any] | str | Path | None,
        layout: KVLayout,
        *,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        """``metrics_registry``: where the metrics go (default: per the ``metrics``
        section, a registry of this cache's own)."""
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        if metrics_registry is not None and not isinstance(metrics_registry, CollectorRegistry):
            raise TypeError(
                "metrics_registry: expected a prometheus_client CollectorRegistry, "
                f"got {type(metrics_registry).__name__}"
            )
        self.config = load_config(config)
        self.layout = layout
        self.spec = OffloadingSpecFactory.create_spec(self.config, layout)
        self.manager: TieringManager = self.spec.build_manager()
        #: Where each lookup's keys are recorded (``trace_recording``); ``None`` when off.
        self.trace_recorder: TraceRecorder | None = None
        try:
            self.trace_recorder = TraceRecorder.from_config(
                self.config.trace_recording, layout.chunk_tokens
            )
            self.metrics: KVTierMetrics = attach_metrics(
                self.manager, self.config.metrics, metrics_registry, self.trace_recorder
            )
        except BaseException:
            self.manager.shutdown()
            if self.trace_recorder is not None:
                self.trace_recorder.close()
            raise
        #: What the cache holds and how its tiers fare, read-only (see :mod:`kvtier.status`).
        self.status = CacheStatus(self.manager)
        #: Admits calls until :meth:`close`, which waits for the copies in progress.
        self.lifecycle = Lifecycle("KVCache")
        self._request_keys = RequestKeys(layout.namespace, layout.chunk_tokens)
        # The guard every call enters (the same object each time): fetched once.
        self._running = self.lifecycle.running()
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
        return list(self._request_keys.keys(tokens)[0])

    def keyed(self, tokens: TokenIds) -> KeyedTokens:
        """``tokens`` checked and keyed once, for :meth:`lookup`, :meth:`load` and
        :meth:`store` to take in their place (a token array is otherwise
        checked again by each call; a list or tuple handed over again is not)."""
        self.lifecycle.check()
        return KeyedTokens(self.layout.namespace, *self._request_keys.keys(tokens))

    def chunks(self, keys: Sequence[ChunkKey]) -> KeyedTokens:
        """Keys an engine made itself (say, from its own page hashes with
        :func:`~kvtier.keys.chain_key` and this cache's namespace), for
        :meth:`lookup`, :meth:`load` and :meth:`store` to take as a sequence
        of ``len(keys)`` full chunks. A key that is not ``KEY_BYTES`` bytes is a
        ``TypeError``."""
        keys = checked_keys(keys)
        return KeyedTokens(self.layout.namespace, keys, len(keys) * self.chunk_tokens)

    def lookup(
        self,
        tokens: TokenIds | KeyedTokens,
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
        request (the caller then ends it with :meth:`end_request`).
        """
        return self._hold(tokens, request_id, timeout, poll_s, _Copy.NOTHING)

    def load_prefix(
        self,
        tokens: TokenIds | KeyedTokens,
        out: np.ndarray | ChunkCopier,
        *,
        request_id: str | None = None,
        timeout: float = 30.0,
        poll_s: float = 0.0005,
    ) -> int:
        """:meth:`cached_prefix` and :meth:`load` in one call, overlapped: waits
        for promotions as :meth:`lookup` does, and copies each leading chunk
        into ``out`` as soon as it is ready, while later ones are still on
        their way. ``out`` as for :meth:`load`, with a row for every full chunk
        of ``tokens``. Returns the tokens loaded: as many as a
        :meth:`cached_prefix` would have answered.
        """
        with self._hold(tokens, request_id, timeout, poll_s, out) as found:
            return found.num_tokens

    def _hold(
        self,
        tokens: TokenIds | KeyedTokens,
        request_id: str | None,
        timeout: float,
        poll_s: float,
        out: np.ndarray | ChunkCopier | _Copy,
    ) -> HeldPrefix:
        """:meth:`lookup`; with ``out``, each chunk pinned is copied into it at once."""
        self.lifecycle.check()
        keys, num_tokens = self._request_keys.keys(tokens)
        if out is not _Copy.NOTHING and not callable(out):
            out = chunk_rows(out, len(keys), self.layout, "out", writable=True)
        # NaN would never compare past the deadline: a lookup waiting for ever.
        # Floats >= 0 (the defaults) pass without a call: a fixed cost of every lookup.
        if type(timeout) is not float or not timeout >= 0:
            timeout = seconds(timeout, "timeout")
        if type(poll_s) is not float or not poll_s >= 0:
            poll_s = seconds(poll_s, "poll_s")
        recorder = self.trace_recorder
        # One record a lookup: what simulate replays.
        if recorder is not None and not self.lifecycle.closed:
            recorder.record(keys, num_tokens)
        owned = request_id is None
        if not owned and type(request_id) is not str:
            check_str(request_id, "request_id")
        request = next(_anonymous_requests) if request_id is None else request_id
        deadline = time.monotonic() + timeout
        slots: list[int] = []
        manager = self.manager
        waited = False
        looking = 0.0  # when the look began (once it has waited: else not read)
        try:
            while True:
                with self._running:
                    if waited:  # the results that woke it, before it looks again
                        manager.collect()
                        looking = time.monotonic()
                    # Taken after that collect: results applied from here on
                    # (by this pass's step too) move it, so none is missed.
                    mark = manager.progress.mark
                    pinned, pending = manager.lookup_pinned(
                        keys[len(slots) :], request, end_request=owned
                    )
                    slots += pinned
                    # The clock is read only when more may come (most lookups: never).
                    now = time.monotonic() if pending else deadline
                    done = now >= deadline
                    if not done:
                        manager.step()  # submits the promotions this lookup started
                    if out is not _Copy.NOTHING and pinned:  # while those promotions run
                        copy_out(self, pinned, out, start=len(slots) - len(pinned))
                    if done:
                        if owned and pending:
                            manager.on_request_finished(request)
                        return HeldPrefix(self, keys[: len(slots)], slots, pending)
                # How long the look took: the walk over the keys still
                # pending, not the results collected before it (the first
                # look's cost, with the promotions it starts, is not measured).
                looked_s = now - looking if waited else 0.0
                manager.progress.sleep(mark, deadline - now, poll_s, looked_s)
                waited = True
        except BaseException:
            self._unpin(keys[: len(slots)])
            if owned:
                with suppress(ClosedError), self._running:
                    manager.on_request_finished(request)
            raise

    def cached_prefix(
        self,
        tokens: TokenIds | KeyedTokens,
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

    def load(
        self, tokens: TokenIds | KeyedTokens, num_tokens: int, out: np.ndarray | ChunkCopier
    ) -> int:
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
        keys, _ = self._request_keys.keys(tokens)
        chunks = chunks_of(
            num_tokens, self.chunk_tokens, len(keys) * self.chunk_tokens, "num_tokens"
        )
        if not callable(out):
            chunk_rows(out, chunks, self.layout, "out", writable=True)
        keys = keys[:chunks]
        with self._running:
            slots = self.manager.pin_prefix(keys)
            try:
                copy_out(self, slots, out)
            finally:
                self.manager.complete_load(keys[: len(slots)])
        return len(slots) * self.chunk_tokens

    def store(
        self,
        tokens: TokenIds | KeyedTokens,
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
        # Entered first: a closed cache says so before it looks at the arguments.
        with self._running:
            keys, _ = self._request_keys.keys(tokens)
            full = len(keys)
            wanted = full if num_chunks is None else count(num_chunks, "num_chunks")
            if wanted > full:
                raise ValueError(f"num_chunks={wanted} exceeds the {full} full chunks of tokens")
            # No more than the primary tier holds: a prefix is only worth its first chunks.
            wanted = min(wanted, self.manager.primary.usable_slots)
            rows = None
            if not callable(src):
                rows = chunk_rows(src, wanted, self.layout, "src", writable=False)
            keys = keys[:wanted]
            reserved = self.manager.prepare_store(keys)
            if not reserved:
                return 0
            slot_rows = self.manager.primary.buffer.array
            try:
                indexes = _positions(keys, reserved)
                slots = list(reserved.values())
                if rows is None:
                    for index, slot in zip(indexes, slots, strict=True):
                        src(index, slot_rows[slot])  # type: ignore[operator]
                else:
                    copy_rows(slot_rows, slots, rows, indexes)
            except BaseException:
                self.manager.complete_store(reserved.keys(), success=False)
                raise
            self.manager.complete_store(reserved.keys(), success=True)
        return len(reserved)

    def step(self) -> None:
        """Drive pending work: collect finished transfers, submit promotions."""
        with self._running:
            self.manager.step()

    def drain(self) -> None:
        """Wait until every transfer in flight has ended."""
        with self._running:
            self.manager.drain()

    def reset(self) -> None:
        """Drain, then empty the primary tier; the secondary tiers keep their chunks."""
        with self._running:
            self.manager.reset()

    def end_request(self, request_id: str) -> None:
        """End the request a caller named in its lookups (``request_id``): the
        tiers forget what they kept for it, and its failed promotions may be tried again."""
        check_str(request_id, "request_id")
        with self._running:
            self.manager.on_request_finished(request_id)

    # Engines whose workers copy the bytes --------------------------------
    # Such an engine (vLLM) plans copies on its scheduler and makes them in
    # other processes, through the slots in shared memory: it asks, pins and
    # reserves chunks by key here and ends each once the copies are done.
    # These calls copy nothing, so they only check that the cache is open, and
    # that keys are keys where they enter it (reserve) or reach the secondary
    # tiers (probe, past the ready prefix).

    def probe(self, keys: Sequence[ChunkKey], *, request_id: str | None = None) -> LookupResult:
        """How many leading chunks of ``keys`` are ready now (``hit_chunks``),
        holding nothing; starts promotions of those a secondary tier has
        (``pending``: ask again after the next :meth:`step`). A request asking
        again counts its hits once; end it with :meth:`end_request`."""
        self.lifecycle.check()
        if request_id is not None and type(request_id) is not str:
            check_str(request_id, "request_id")
        return self.manager.lookup(keys, request_id)

    def wait_for_promotions(
        self,
        keys: Sequence[ChunkKey],
        *,
        request_id: str | None = None,
        timeout: float,
        poll_s: float = 0.0005,
    ) -> LookupResult:
        """:meth:`probe`, then block until its promotions end or ``timeout``
        seconds pass; the last answer (``pending`` still set at the timeout).

        For an engine with nothing else to run while a request's chunks come
        back from a secondary tier: it sleeps until a tier announces that a
        job ended (see :meth:`~kvtier.tiers.base.SecondaryTier.set_progress_listener`),
        instead of stepping or polling; a tier that does not announce is
        looked at every ``poll_s``. The promotions a probe starts are
        submitted at once. Holds nothing, like :meth:`probe`. A cache closed
        meanwhile ends the wait with :class:`~kvtier.errors.ClosedError`.
        """
        self.lifecycle.check()
        if request_id is not None:
            check_str(request_id, "request_id")
        timeout = seconds(timeout, "timeout")
        poll_s = seconds(poll_s, "poll_s")
        manager = self.manager
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            with self.lifecycle.running():
                manager.collect()
                looking = time.monotonic()
                # Taken after that collect: a result applied from here on moves it.
                mark = manager.progress.mark
                result = manager.lookup(keys, request_id)
                now = time.monotonic()
                if not result.pending or now >= deadline:
                    return result
                manager.step()  # submits the promotions this probe started
            # The look's cost, as lookup measures it (the first: not measured).
            looked_s = now - looking if waited else 0.0
            manager.progress.sleep(mark, deadline - now, poll_s, looked_s)
            waited = True

    def collect(self) -> None:
        """Apply the transfers that ended since the last call, as :meth:`step`
        does first, leaving queued promotions to the step: for an engine asking
        again, within a step, about chunks being promoted."""
        self.lifecycle.check()
        self.manager.collect()

    def pin(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin ready chunks for a copy out of their slots; returns the slots.
        ``KeyError`` if one is not ready (then nothing is pinned)."""
        self.lifecycle.check()
        return self.manager.prepare_load(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Release chunks :meth:`pin` pinned, once their copies ended."""
        self.lifecycle.check()
        self.manager.complete_load(keys)

    def reserve(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int] | None:
        """A slot to write for each chunk of ``keys`` not held yet (in order),
        or ``None`` when the primary tier has no room for them all."""
        self.lifecycle.check()
        return self.manager.prepare_store(checked_keys(keys))

    def commit(self, keys: Sequence[ChunkKey], success: bool | np.bool_ = True) -> None:
        """The writes into :meth:`reserve`'s slots ended: on success the chunks
        become ready and cascade to the secondary tiers; otherwise the slots are freed."""
        self.lifecycle.check()
        if not isinstance(success, bool | np.bool_):
            raise TypeError(f"success: expected a bool, got {type(success).__name__}")
        self.manager.complete_store(checked_keys(keys), bool(success))

    def record_request(self, keys: Sequence[ChunkKey], num_tokens: int) -> None:
        """Record a request's keys in the trace (``trace_recording``; nothing
        when off): once a request, for engines that use :meth:`probe`
        (:meth:`lookup` records its own)."""
        keys = checked_keys(keys)
        num_tokens = count(num_tokens, "num_tokens")
        recorder = self.trace_recorder
        if recorder is not None and not self.lifecycle.closed:
            recorder.record(keys, num_tokens)

    def watch_residency(self, listener: ResidencyListener) -> None:
        """Call ``listener(tier_name, keys, stored)`` whenever a tier takes in
        or drops chunks (``"cpu"`` for the primary tier): for KV events. It
        must be quick and thread-safe and must not call back into kvtier."""
        self.manager.residency.add_listener(listener)

    @property
    def shared_memory_name(self) -> str | None:
        """The name of the primary slots in shared memory (``None``: private),
        for an engine's workers to map with :func:`kvtier.shared_slots.map_slots`."""
        return self.manager.primary.buffer.shared_name

    def unlink_shared_memory(self) -> None:
        """Remove the slots' name once every worker mapped them (the mappings
        stay valid): an engine killed later leaves nothing in shared memory."""
        self.manager.primary.buffer.unlink()

    def _unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Release chunks pinned for this cache's lookups (nothing to do once closed).

        Not a call that close waits for: unpinning touches the primary tier's
        counts under its own lock, never the buffer that closing unmaps."""
        if keys and not self.lifecycle.closed:
            self.manager.primary.complete_load(keys)  # the manager's own is this call

    def close(self) -> None:
        """Drain and stop the tiers. Idempotent.

        Waits for the loads and stores copying right now, and refuses every
        later call with :class:`~kvtier.errors.ClosedError`. Lookups still
        held lose their chunks: their ``load`` raises ``ClosedError``.
        """
        with self._close_lock:
            if not self.lifecycle.close():
                return
            # Waits for promotions sleep outside the calls close waits for:
            # wake them, to find the cache closed, before the tiers drain.
            self.manager.progress.announce()
            self.metrics.close()
            self.manager.shutdown()
            # After the manager: an engine's scheduler may record until it stops.
            if self.trace_recorder is not None:
                self.trace_recorder.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _positions(keys: Sequence[ChunkKey], reserved: Mapping[ChunkKey, int]) -> range | list[int]:
    """Where in ``keys`` each reserved key is (reserved in the order of ``keys``).

    Most stores reserve a run of chunks to the end of the prompt (those past
    the cached prefix): then a range, with no lookup per key.
    """
    start = keys.index(next(iter(reserved)))
    if len(keys) - start == len(reserved):
        return range(start, len(keys))
    # A key given twice (engine-made keys) is one chunk: its first row is stored.
    first: dict[ChunkKey, int] = {}
    for index, key in enumerate(keys):
        first.setdefault(key, index)
    return [first[key] for key in reserved]
