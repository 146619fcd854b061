"""The tier class of every remote backend: the tier runtime over a
:class:`~kvtier.tiers.remote_store.RemoteStore` (naming, framing, verifying)
with the guards its options configure (deadlines, circuit breaker, budgets).

See docs/shared-tiers.md, 'How they behave' and 'When the backend fails'.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from kvtier.keys import ChunkKey
from kvtier.tiers.backend import (
    MAX_WAIT_S,
    Backend,
    BackendSkipped,
    Exists,
    Fetched,
    FramedValue,
    PutErrors,
    RemoteTierOptions,
    ValueBuffer,
)
from kvtier.tiers.base import TierStats
from kvtier.tiers.budgets import RequestBudgets
from kvtier.tiers.circuit import CircuitBreaker
from kvtier.tiers.guards import Guards
from kvtier.tiers.prefetch import Prefetched
from kvtier.tiers.probes import Probes
from kvtier.tiers.remote_store import RemoteStore
from kvtier.tiers.runtime import ChunkStore, TierRuntime
from kvtier.tiers.workers import Priority

__all__ = [
    "MAX_WAIT_S",
    "BackendSkipped",
    "Exists",
    "Fetched",
    "FramedValue",
    "PutErrors",
    "RemoteTier",
    "RemoteTierOptions",
    "RemoteTierStats",
    "ValueBuffer",
    "remote_tier",
]


@dataclass
class RemoteTierStats(TierStats):
    """:class:`TierStats` plus what a remote backend does wrong (exported as counters)."""

    #: Backend calls that failed: a whole batch, or one item of it.
    backend_errors: int = 0
    #: Times the circuit breaker opened after the backend had been answering.
    backend_outages: int = 0
    #: Jobs and existence checks still running at their deadline.
    deadline_misses: int = 0
    #: Probes sent to a backend whose breaker was open.
    breaker_probes: int = 0
    #: Lookups answered MISS without asking the backend (breaker open).
    outage_skipped_lookups: int = 0
    #: Chunks of store jobs dropped without a call to the backend (breaker open).
    outage_dropped_stores: int = 0
    #: Chunks of load jobs failed without a call to the backend (breaker open).
    outage_failed_loads: int = 0
    #: Chunks whose write the backend refused while answering (full, read-only,
    #: not permitted): failed stores that leave the breaker alone.
    refused_stores: int = 0
    #: Chunks an existence check read whole and held for their promotion.
    prefetched_chunks: int = 0
    #: Chunks loads took from those held values, without a request.
    prefetch_served: int = 0
    #: Held values dropped unclaimed to make room for newer checks.
    prefetch_expired: int = 0


RemoteOptionsT = TypeVar("RemoteOptionsT", bound=RemoteTierOptions)


class RemoteTier(TierRuntime[RemoteOptionsT]):
    """A tier over a :class:`Backend`. A tier class names its backend in
    :attr:`backend_class` and nothing else (see :func:`remote_tier`)."""

    #: The backend this tier runs; :attr:`Options` and the batch sizes are its.
    backend_class: ClassVar[type[Backend[Any]]]
    Stats: ClassVar[type[TierStats]] = RemoteTierStats
    stats: RemoteTierStats
    store: RemoteStore
    guards: Guards

    def _open_store(self) -> ChunkStore:
        backend_class = getattr(type(self), "backend_class", None)
        if backend_class is None:
            raise TypeError(
                f"{type(self).__qualname__} names no backend_class: set it, "
                "or build the tier class with remote_tier(YourBackend)"
            )
        return RemoteStore(self, self.guards, backend_class)

    def _ping(self) -> None:
        self.store.backend.ping()

    @property
    def check_chunks(self) -> int:
        return self.store.check_chunks

    def _load_priority(self, keys: Sequence[ChunkKey]) -> Priority:
        # Promoting what the checks hold first gives their memory back at
        # once: the next checks read into it instead of into fresh pages,
        # and a prefix past prefetch_bytes keeps one request per chunk.
        return Priority.HELD if self.store.holds(keys) else Priority.LOAD

    # Read-only views, for operators and tests --------------------------------

    @property
    def backend(self) -> Backend[RemoteOptionsT]:
        return self.store.backend

    @property
    def breaker(self) -> CircuitBreaker:
        return self.guards.breaker

    @property
    def probes(self) -> Probes:
        return self.guards.probes

    @property
    def budgets(self) -> RequestBudgets:
        return self.guards.budgets

    @property
    def prefetched(self) -> Prefetched | None:
        """Values existence checks read whole, held for their loads."""
        return self.store.prefetched

    @property
    def backend_down(self) -> bool:
        """Whether calls skip the backend: the breaker is open or probing."""
        return not self.guards.breaker.closed

    @property
    def names_prefix(self) -> str:
        return self.store.names_prefix

    @property
    def value_bytes(self) -> int:
        return self.store.value_bytes

    def store_name(self, key: ChunkKey) -> str:
        """The name ``key`` has in the store."""
        return self.store.store_name(key)


@functools.cache
def remote_tier(backend_class: type[Backend[Any]]) -> type[RemoteTier[Any]]:
    """The tier class running ``backend_class`` (one per backend class), as
    the factory builds for a configuration entry that names a backend."""
    name = backend_class.__name__.removesuffix("Backend") + "Tier"
    namespace = {"backend_class": backend_class, "__module__": backend_class.__module__}
    return type(name, (RemoteTier,), namespace)
