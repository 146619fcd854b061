"""A remote tier over a dict whose "network" the test freezes and thaws."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.tiers.backend import (
    Backend,
    BackendRuntime,
    Exists,
    Fetched,
    FramedValue,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.remote import RemoteTier


class FreezableStore:
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


class FreezableBackend(Backend[RemoteTierOptions]):
    """Chunks in a :class:`FreezableStore`, which tests freeze and thaw
    through the backend (``tier.backend.freeze()``)."""

    def __init__(self, options: RemoteTierOptions, runtime: BackendRuntime) -> None:
        super().__init__(options, runtime)
        self.store = FreezableStore()
        self.values = self.store.values
        self.freeze, self.thaw = self.store.freeze, self.store.thaw
        self.release_stuck = self.store.release_stuck

    @classmethod
    def name_prefix(cls, options: RemoteTierOptions) -> str:
        return "t:"

    @property
    def stuck(self) -> int:
        return self.store.stuck

    def exists_many(self, names: Sequence[str]) -> list[Exists]:
        self.store.call()
        return [name in self.values for name in names]

    def put_many(self, names: Sequence[str], values: Sequence[ValueBuffer]) -> PutErrors:
        self.store.call()
        for name, value in zip(names, values, strict=False):
            self.values[name] = bytes(value)
        return [None] * len(names)

    def get_many(self, names: Sequence[str]) -> list[Fetched]:
        self.store.call()
        return [self.values.get(name) for name in names]

    def delete(self, name: str) -> None:
        self.store.call()
        self.values.pop(name, None)

    def ping(self) -> None:
        self.store.call()


class FreezableTier(RemoteTier[RemoteTierOptions]):
    backend_class = FreezableBackend


class LateSendingBackend(FreezableBackend):
    """Sends framed values in place (:attr:`sends_framed`), reading the slot
    only when the send goes out: :attr:`gate` holds every send until set, as a
    socket whose buffer is full holds the rest of a value."""

    sends_framed = True

    def __init__(self, options: RemoteTierOptions, runtime: BackendRuntime) -> None:
        super().__init__(options, runtime)
        self.gate = threading.Event()

    def put_framed(self, names: Sequence[str], values: Sequence[FramedValue]) -> PutErrors:
        self.gate.wait()
        for name, (header, payload) in zip(names, values, strict=True):
            self.values[name] = header + bytes(payload)
        return [None] * len(names)


class LateSendingTier(RemoteTier[RemoteTierOptions]):
    backend_class = LateSendingBackend
