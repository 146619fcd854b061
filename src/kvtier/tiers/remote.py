"""A base for tiers over a shared remote key-value store (Redis, S3...).

It does what every such tier must do the same way, so the backends only
write batched client calls:

* names: ``prefix + namespace hex + separator + key hex``. Chunk keys are
  hashes, so no client-supplied path ever reaches the store, and engines with
  different layouts can share a store without ever reading each other's bytes;
* integrity: every value is framed with :mod:`kvtier.integrity`'s header and
  verified *before* a byte of it reaches a primary slot; a corrupt, torn or
  foreign value is a miss, is deleted and is counted. Each worker frames into
  buffers it keeps (``io_batch`` chunks' worth), so stores allocate nothing;
* optional write deduplication (``skip_existing``): one batched existence
  check before a store, so chunks another engine already wrote are not sent again;
* failures: a backend error fails the batch's chunks (misses for the
  manager, which counts them), never reaches the caller's thread, and is
  logged once when the backend goes away and once when it answers again.
  Recovery needs nothing: the next batch simply tries again.
"""

from __future__ import annotations

import functools
import logging
import threading
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier import integrity
from kvtier.errors import CorruptChunkError, describe_error
from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric, TierOptions, TierStats
from kvtier.tiers.threaded import ThreadedTier, ThreadedTierOptions

logger = logging.getLogger(__name__)

#: What a batched read gives back per name: the value, ``None`` when the store
#: does not hold it, or the error that one item met.
Fetched = bytes | memoryview | None | BaseException
#: What a batched write gives back per name: ``None``, or the error that item met.
PutErrors = list[BaseException | None]


class RemoteTierOptions(ThreadedTierOptions):
    skip_existing: bool = False
    """Before a store, check which chunks the store already holds (one batched
    round trip) and send only the others. Worth it when many engines compute
    the same chunks at once; otherwise the extra round trip costs more than it
    saves, since the manager never writes a promoted chunk back to its tier."""


@dataclass
class RemoteTierStats(TierStats):
    """:class:`TierStats` plus what a remote backend does wrong (exported as counters)."""

    #: Backend calls that failed: a whole batch, or one item of it.
    backend_errors: int = 0
    #: Times the backend went from answering to failing.
    backend_outages: int = 0


class RemoteTier(ThreadedTier):
    """Framing, verification, naming and failure handling over a batched remote store."""

    Options: ClassVar[type[TierOptions]] = RemoteTierOptions
    #: Between the store's prefix and namespace digest and the key digest.
    name_separator: ClassVar[str] = ":"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._skip_existing = bool(getattr(self.options, "skip_existing", False))
        self._names_prefix = ""
        self._health_lock = threading.Lock()
        self._backend_down = False
        self._worker_local = threading.local()
        self.stats = RemoteTierStats()

    def _set_name_prefix(self, prefix: str) -> None:
        self._names_prefix = f"{prefix}{self.namespace.hex()}{self.name_separator}"

    def store_name(self, key: ChunkKey) -> str:
        """The name ``key`` has in the store."""
        return self._names_prefix + key.hex()

    @property
    def backend_down(self) -> bool:
        """Whether the last call to the backend failed."""
        return self._backend_down

    @property
    def value_bytes(self) -> int:
        """Length of one stored value: header and one slot's payload."""
        return integrity.HEADER_BYTES + self.slot_bytes

    # Backend hooks: blocking, batched, called on worker threads ----------

    @abstractmethod
    def _exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether the store holds each name; raise if the store cannot say."""

    @abstractmethod
    def _put_many(self, names: Sequence[str], values: Sequence[bytearray]) -> PutErrors:
        """Write each value; ``None`` per success or the error of that item.

        Raise when the whole batch failed (connection lost, timeout).
        """

    @abstractmethod
    def _get_many(self, names: Sequence[str]) -> list[Fetched]:
        """Read each value (see :data:`Fetched`); raise when the whole batch failed."""

    @abstractmethod
    def _delete(self, name: str) -> None:
        """Remove one value (a corrupt one)."""

    def _refresh_many(self, names: Sequence[str]) -> None:
        """Chunks that were stored again while held: extend their life. Default: nothing."""

    @abstractmethod
    def _ping(self) -> None:
        """One cheap request that raises unless the backend serves this tier."""

    # ThreadedTier hooks -------------------------------------------------------

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        try:
            found = self._exists_many([self.store_name(k) for k in keys])
        except Exception as exc:
            self._failed(exc)
            return [False] * len(keys)
        self._answered()
        return found

    def _store_batch(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> list[bool]:
        names = [self.store_name(k) for k in keys]
        try:
            held = self._exists_many(names) if self._skip_existing else [False] * len(names)
            todo = [i for i, present in enumerate(held) if not present]
            values = self._scratch(len(todo))
            for value, i in zip(values, todo, strict=False):
                integrity.frame_into(value, self.namespace, keys[i], payloads[i])
            errors = self._put_many([names[i] for i in todo], values[: len(todo)])
            if len(todo) < len(names):
                self._refresh_many([n for n, present in zip(names, held, strict=True) if present])
        except Exception as exc:
            self._failed(exc)
            return [False] * len(keys)
        ok = [True] * len(keys)
        for index, error in zip(todo, errors, strict=True):
            if error is not None:
                ok[index] = False
                self._failed(error)
        if all(ok):
            self._answered()
        return ok

    def _scratch(self, count: int) -> list[bytearray]:
        """This worker's reusable value buffers, at least ``count`` of them.

        Framing into buffers that stay mapped spares a fresh allocation, and
        its page faults, per chunk; the clients are done with a buffer when
        ``_put_many`` returns.
        """
        buffers: list[bytearray] = getattr(self._worker_local, "buffers", [])
        while len(buffers) < count:
            buffers.append(bytearray(self.value_bytes))
        self._worker_local.buffers = buffers
        return buffers

    def _load_batch(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        try:
            values = self._get_many([self.store_name(k) for k in keys])
        except Exception as exc:
            self._failed(exc)
            return [False] * len(keys)
        errors = [v for v in values if isinstance(v, Exception) and not _is_corrupt(v)]
        if errors:
            self._failed(errors[0])
        else:
            self._answered()
        return [
            self._attempt(functools.partial(self._verify_into, value), key, out)
            for key, value, out in zip(keys, values, outs, strict=True)
        ]

    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        value = self._scratch(1)[0]
        integrity.frame_into(value, self.namespace, key, payload)
        [error] = self._put_many([self.store_name(key)], [value])
        if error is not None:
            raise error

    def _load_chunk(self, key: ChunkKey, out: memoryview) -> None:
        [value] = self._get_many([self.store_name(key)])
        self._verify_into(value, key, out)

    def _discard(self, key: ChunkKey) -> None:
        self._delete(self.store_name(key))

    # Machinery ----------------------------------------------------------------

    def _verify_into(self, value: Fetched, key: ChunkKey, out: memoryview) -> None:
        if isinstance(value, BaseException):
            raise value
        if value is None:
            raise KeyError("chunk not in the store")
        integrity.unframe_into(value, out, namespace=self.namespace, key=key)

    def _failed(self, exc: BaseException) -> None:
        with self._health_lock:
            was_down, self._backend_down = self._backend_down, True
        self.count(backend_errors=1, backend_outages=0 if was_down else 1)
        if not was_down:
            logger.warning(
                "tier %s: backend failing (%s); its chunks count as misses until it answers",
                self.tier_type,
                describe_error(exc),
            )

    def _answered(self) -> None:
        if not self._backend_down:
            return
        with self._health_lock:
            was_down, self._backend_down = self._backend_down, False
        if was_down:
            logger.warning("tier %s: backend answers again", self.tier_type)

    def describe(self) -> dict[str, object]:
        return {"type": self.tier_type, "backend_down": self._backend_down}

    def health(self) -> Sequence[HealthCheck]:
        try:
            self._ping()
        except Exception as exc:
            return [HealthCheck("backend answers", False, describe_error(exc))]
        return [HealthCheck("backend answers", True)]

    def metrics(self) -> Sequence[TierMetric]:
        return [
            TierMetric(
                "backend_up",
                0.0 if self._backend_down else 1.0,
                "1 while the tier's last call to its backend succeeded, else 0.",
            )
        ]


def _is_corrupt(error: BaseException) -> bool:
    """A bad value, not a failing backend."""
    return isinstance(error, CorruptChunkError)
