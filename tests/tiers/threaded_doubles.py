"""ThreadedTier subclasses that use the names a tier author reaches for first."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from kvtier.keys import ChunkKey
from kvtier.tiers.jobs import JobState
from kvtier.tiers.local import ItemErrors
from kvtier.tiers.memory import MemoryBackend, MemoryTier
from kvtier.tiers.threaded import ThreadedTier

#: Worker threads of a tier found alive while its ``__init__`` ran, by tier type.
WORKERS_SEEN_IN_INIT: dict[str, list[str]] = {}


def tier_threads(tier_type: str) -> list[str]:
    """Names of live threads that belong to tiers of ``tier_type``."""
    return [t.name for t in threading.enumerate() if t.name.startswith(f"kvtier-{tier_type}-")]


class ObviousNamesTier(ThreadedTier):
    """Keeps chunks in ``_jobs`` under a Condition ``_lock``, with its own
    ``_closed``, ``_queue``, ``_workers`` and ``_idle``: none may be the base's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        WORKERS_SEEN_IN_INIT[self.tier_type] = tier_threads(self.tier_type)
        self._lock = threading.Condition()
        self._closed = False
        self._jobs: dict[ChunkKey, bytes] = {}
        self._queue: list[ChunkKey] = []  # keys in the order they were stored
        self._workers = 0  # hook calls seen
        self._idle = True

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            self._workers += 1
            self._lock.notify_all()  # raises unless this thread holds the Condition
            return [key in self._jobs for key in keys]

    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("store after close")
            self._workers += 1
            self._jobs[key] = bytes(payload)
            self._queue.append(key)
            self._lock.notify_all()

    def _load_chunk(self, key: ChunkKey, out: memoryview) -> None:
        with self._lock:
            self._workers += 1
            out[:] = self._jobs[key]
            self._lock.notify_all()

    def _close(self) -> None:
        with self._lock:
            self._closed = True


class FailingSetUpTier(ObviousNamesTier):
    """Fails in ``__init__`` after ``super().__init__`` returned, without any try/shutdown."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        raise OSError("the backend is not there")


class PartNamingTier(ObviousNamesTier):
    """Keeps its own state under :attr:`own_name`, which a test sets (say, to
    one of the names the runtime keeps its parts in)."""

    own_name: ClassVar[str] = "_client"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        setattr(self, self.own_name, {"its": "own"})


class RaisingMemoryBackend(MemoryBackend):
    """The memory backend, raising what its tier says (see :class:`RaisingMemoryTier`)."""

    runtime: RaisingMemoryTier

    def _raise(self, step: str) -> None:
        tier = self.runtime
        if tier.error is not None and tier.raise_in == step:
            raise tier.error(f"{step} raised (injected)")

    # MemoryBackend narrows known to bool; the runtime takes bool | None.
    def known(self, key: ChunkKey) -> bool | None:  # type: ignore[override]
        return None  # every lookup asks contains_many

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._raise("_contains")
        return super().contains_many(keys)

    def move_many(
        self, state: JobState, keys: list[ChunkKey], payloads: list[memoryview]
    ) -> ItemErrors:
        self._raise("load" if state.loading else "store")
        errors = super().move_many(state, keys, payloads)
        return errors + [None] * self.runtime.extra_answers if state.loading else errors


class RaisingMemoryTier(MemoryTier):
    """The memory tier; while :attr:`error` is set, the step named by
    :attr:`raise_in` (``_contains``, ``load`` or ``store``) raises it (any
    exception class, ``BaseException`` ones included), and
    :attr:`extra_answers` pads a load batch's answer."""

    backend_class = RaisingMemoryBackend

    def __init__(self, **kwargs: Any) -> None:
        self.raise_in = ""
        self.error: type[BaseException] | None = None
        self.extra_answers = 0
        super().__init__(**kwargs)
