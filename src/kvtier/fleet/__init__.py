"""The fleet: which node holds which chunk, for routers and for ``p2p``.

:mod:`~kvtier.fleet.base` (the :class:`ClusterIndex` contract),
:mod:`~kvtier.fleet.redis` (Redis/Valkey), :mod:`~kvtier.fleet.factory`
(``type`` + ``module_path``, entry points ``kvtier.indexes``),
:mod:`~kvtier.fleet.publisher` (a node's changes, on its own thread),
:mod:`~kvtier.fleet.routing` (routing scores), :mod:`~kvtier.fleet.service`
(``kvtier route``: the scores over HTTP).
"""

from kvtier.fleet.base import ClusterIndex, Holders, IndexOptions, NodeLease
from kvtier.fleet.factory import build_index, index_registry, register_index
from kvtier.fleet.routing import ANY_TIER, FleetIndex, NodeScore, leading_runs, scores

__all__ = [
    "ANY_TIER",
    "ClusterIndex",
    "FleetIndex",
    "Holders",
    "IndexOptions",
    "NodeLease",
    "NodeScore",
    "build_index",
    "index_registry",
    "leading_runs",
    "register_index",
    "scores",
]
