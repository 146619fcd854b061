"""A cluster index in process memory, for tests: the store and its failures in the test's hands.

Loaded by ``module_path`` (``type: DictIndex, module_path: tests.fleet.fleet_doubles``)
as an out-of-tree index would be. Every instance shares :data:`STORE`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from kvtier.fleet.base import ClusterIndex, Holders, IndexOptions, NodeLease
from kvtier.keys import ChunkKey


class DictStore:
    """``entries[(key, medium)]`` of each incarnation, its lease, and a failure switch."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, set[tuple[ChunkKey, str]]] = {}
        self.leases: dict[str, NodeLease] = {}
        self.failing = False
        self.publishes = 0

    def held(self, medium: str = "cpu") -> set[ChunkKey]:
        """Keys held in ``medium`` by any live incarnation."""
        with self.lock:
            return {
                key
                for inc, entries in self.entries.items()
                if inc in self.leases
                for key, held_in in entries
                if held_in == medium
            }


STORE = DictStore()


class DictIndexOptions(IndexOptions):
    pass


class DictIndex(ClusterIndex):
    Options: ClassVar[type[IndexOptions]] = DictIndexOptions

    def publish(
        self,
        incarnation: str,
        lease: NodeLease,
        added: Sequence[tuple[ChunkKey, str]],
        removed: Sequence[tuple[ChunkKey, str]],
    ) -> None:
        with STORE.lock:
            if STORE.failing:
                raise ConnectionError("the index is down (test switch)")
            STORE.publishes += 1
            STORE.leases[incarnation] = lease
            entries = STORE.entries.setdefault(incarnation, set())
            entries.update(added)
            entries.difference_update(removed)

    def withdraw(self, incarnation: str) -> None:
        with STORE.lock:
            STORE.leases.pop(incarnation, None)

    def holders(self, keys: Sequence[ChunkKey]) -> Holders:
        with STORE.lock:
            if STORE.failing:
                raise ConnectionError("the index is down (test switch)")
            per_key: list[dict[str, frozenset[str]]] = []
            for key in keys:
                media: dict[str, set[str]] = {}
                for inc, entries in STORE.entries.items():
                    lease = STORE.leases.get(inc)
                    if lease is None:
                        continue
                    for held, medium in entries:
                        if held == key:
                            media.setdefault(lease.node, set()).add(medium)
                per_key.append({node: frozenset(m) for node, m in media.items()})
            nodes = {lease.node: lease for lease in STORE.leases.values()}
        return Holders(per_key, nodes)

    def close(self) -> None:
        pass
