"""Group commit: threads that change an index at once share one transaction,
run by whichever of them gets there first."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

_T = TypeVar("_T")


@dataclass
class _Queued(Generic[_T]):
    """A change waiting for a transaction; ``result`` or ``error`` once done."""

    change: Callable[[sqlite3.Connection], _T]
    done: bool = False
    result: _T | None = None
    error: BaseException | None = None


class GroupCommit:
    """Runs changes in transactions opened by ``transaction``, each holding
    every change queued by the time it starts."""

    def __init__(
        self, transaction: Callable[[], AbstractContextManager[sqlite3.Connection]]
    ) -> None:
        self._transaction = transaction
        self._batch_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queued: list[_Queued[Any]] = []

    def run(self, change: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``change`` in a transaction, with the changes queued beside it:
        if the transaction fails, none of them holds and each raises."""
        request: _Queued[_T] = _Queued(change)
        with self._queue_lock:
            self._queued.append(request)
        with self._batch_lock:
            if not request.done:
                with self._queue_lock:
                    batch, self._queued = self._queued, []
                try:
                    with self._transaction() as db:
                        for queued in batch:
                            queued.result = queued.change(db)
                except BaseException as exc:
                    for queued in batch:  # rolled back: none of them holds
                        queued.error = exc
                for queued in batch:
                    queued.done = True
        if request.error is not None:
            raise request.error
        # Done without an error: the change returned its result (None is a result too).
        return cast(_T, request.result)
