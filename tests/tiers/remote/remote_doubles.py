"""A remote tier over a dict whose "network" the test freezes and thaws."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvtier.tiers.remote import (
    Exists,
    Fetched,
    FramedValue,
    PutErrors,
    RemoteTier,
    ValueBuffer,
)


class Backend:
    """A key-value store that can freeze: calls made while frozen hang until
    :meth:`release_stuck`, even after :meth:`thaw` (a connection blackholed
    during an outage stays dead when the server comes back)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._frozen = False
        self._release = threading.Event()
        self.stuck = 0  # calls hanging right now

    def freeze(self) -> None:
        with self._lock:
            self._frozen = True
            self._release = threading.Event()

    def thaw(self) -> None:
        with self._lock:
            self._frozen = False

    def release_stuck(self) -> None:
        with self._lock:
            self._release.set()

    def call(self) -> None:
        """Pass, or hang while frozen, until released."""
        with self._lock:
            if not self._frozen:
                return
            release = self._release
            self.stuck += 1
        release.wait()
        with self._lock:
            self.stuck -= 1
        raise ConnectionError("connection lost during the outage")


class FreezableTier(RemoteTier):
    """Chunks in :attr:`backend`, which tests freeze and thaw."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._set_name_prefix("t:")
        self.backend = Backend()

    def _exists_many(self, names: Sequence[str]) -> list[Exists]:
        self.backend.call()
        return [name in self.backend.values for name in names]

    def _put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        self.backend.call()
        for name, value in zip(names, values, strict=False):
            self.backend.values[name] = bytes(value)
        return [None] * len(names)

    def _get_many(self, names: Sequence[str]) -> list[Fetched]:
        self.backend.call()
        return [self.backend.values.get(name) for name in names]

    def _delete(self, name: str) -> None:
        self.backend.call()
        self.backend.values.pop(name, None)

    def _ping(self) -> None:
        self.backend.call()


class LateSendingTier(FreezableTier):
    """Sends framed values in place (:attr:`sends_framed`), reading the slot
    only when the send goes out: :attr:`gate` holds every send until set, as a
    socket whose buffer is full holds the rest of a value."""

    sends_framed = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def _put_framed(self, names: Sequence[str], values: Sequence[FramedValue]) -> PutErrors:
        self.gate.wait()
        for name, (header, payload) in zip(names, values, strict=True):
            self.backend.values[name] = header + bytes(payload)
        return [None] * len(names)
