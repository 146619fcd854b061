"""Existence checks: the keys lookups asked about, the answers the workers
found, and the keys whose check failed or ran past its deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvtier.keys import ChunkKey
from kvtier.tiers.base import Lookup
from kvtier.tiers.bounded import drop_oldest

#: Seconds a check's MISS answers every lookup of its key, not only the one
#: that takes it: a request that asks again at each engine step (blocked
#: on memory), or the requests of one new prompt arriving together, would
#: otherwise each check again (PENDING: a step later) for the same answer.
MISS_ANSWER_S = 1.0


class ExistenceChecks:
    """Thread-safe. A HIT is consumed by the lookup that takes it (a shared
    backend may change under us), a MISS answers for :data:`MISS_ANSWER_S`
    (or until :meth:`forget`); an unknown one is asked again, up to
    ``attempts`` times before the lookup answers MISS."""

    def __init__(
        self,
        attempts: int,
        max_answers: int,
        *,
        miss_answer_s: float = MISS_ANSWER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.attempts = attempts
        self.max_answers = max_answers
        self.miss_answer_s = miss_answer_s
        self._clock = clock
        self._lock = threading.Lock()
        self._queued: list[ChunkKey] = []
        self._checking: set[ChunkKey] = set()
        # Keys found present (a dict: in the order found, for drop_oldest).
        self._found: dict[ChunkKey, None] = {}
        # Keys found missing, and when.
        self._missing: dict[ChunkKey, float] = {}
        # Checks past their deadline: every lookup of one answers MISS until it ends.
        self._overdue: set[ChunkKey] = set()
        self._failed: dict[ChunkKey, int] = {}

    @property
    def checking(self) -> frozenset[ChunkKey]:
        """Keys queued or being checked."""
        with self._lock:
            return frozenset(self._checking)

    @property
    def queued(self) -> tuple[ChunkKey, ...]:
        """Keys waiting for :meth:`take_queued`."""
        with self._lock:
            return tuple(self._queued)

    def answer(self, key: ChunkKey) -> Lookup:
        """The found answer for ``key``, else PENDING with its check queued."""
        with self._lock:
            return self._answer(key)

    def answer_run(self, keys: Sequence[ChunkKey]) -> list[Lookup]:
        """:meth:`answer` for ``keys`` in order, under one lock, ending after
        the first MISS: no check is queued, nor HIT taken, past it."""
        answers: list[Lookup] = []
        checking = self._checking
        with self._lock:
            # Two runs answered whole (tests/tiers/test_runtime_parts.py holds
            # each to what :meth:`_answer` of each key would do): every key
            # being checked, as most runs of a long prefix's later looks are;
            # or no key with any answer yet, as a new prefix's first look.
            if not self._overdue and checking.issuperset(keys):
                return [Lookup.PENDING] * len(keys)
            if self._unanswered(keys):
                new = [key for key in dict.fromkeys(keys) if key not in checking]
                checking.update(new)
                self._queued += new
                return [Lookup.PENDING] * len(keys)
            for key in keys:
                answer = self._answer(key)
                answers.append(answer)
                if answer is Lookup.MISS:
                    break
        return answers

    def _unanswered(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether no key of ``keys`` has an answer, nor is overdue or failed."""
        return (
            self._found.keys().isdisjoint(keys)
            and self._missing.keys().isdisjoint(keys)
            and self._overdue.isdisjoint(keys)
            and self._failed.keys().isdisjoint(keys)
        )

    def _answer(self, key: ChunkKey) -> Lookup:
        if key in self._checking:  # then neither found nor missing, nor failed for good
            return Lookup.MISS if key in self._overdue else Lookup.PENDING
        if key in self._found:
            del self._found[key]
            return Lookup.HIT
        since = self._missing.get(key)
        if since is not None:
            if self._clock() - since <= self.miss_answer_s:
                return Lookup.MISS
            del self._missing[key]
        if key in self._overdue:
            return Lookup.MISS
        if self._failed.get(key, 0) >= self.attempts:
            del self._failed[key]
            return Lookup.MISS  # the backend keeps failing for this key
        self._checking.add(key)
        self._queued.append(key)
        return Lookup.PENDING

    def take_queued(self) -> list[ChunkKey]:
        with self._lock:
            queued, self._queued = self._queued, []
        return queued

    def record(self, keys: Sequence[ChunkKey], found: Sequence[bool | None]) -> None:
        """What a check found; ``None``: unknown, asked again at the next lookup."""
        now = self._clock()
        with self._lock:
            for key, present in zip(keys, found, strict=True):
                self._checking.discard(key)
                self._overdue.discard(key)
                if present is None:
                    self._failed[key] = self._failed.get(key, 0) + 1
                    continue
                self._failed.pop(key, None)
                self._missing.pop(key, None)  # superseded; found missing again, the newest
                if present:
                    self._found[key] = None
                else:
                    self._missing[key] = now
            # Oldest answers first: nobody came back for them.
            drop_oldest(self._found, self.max_answers)
            drop_oldest(self._missing, self.max_answers)
            drop_oldest(self._failed, self.max_answers)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` are being stored: a MISS found before no longer answers."""
        if not self._missing:  # most stores: read without the lock, as a check racing them would
            return
        with self._lock:
            for key in keys:
                self._missing.pop(key, None)

    def overdue(self, keys: Sequence[ChunkKey]) -> None:
        """The check of ``keys`` is past its deadline: MISS until it ends."""
        with self._lock:
            self._overdue.update(key for key in keys if key in self._checking)
