"""Routing scores: how many leading tokens of a prompt each node holds, per tier.

A router sends a request where most of its prefix is cached already. It asks
:class:`FleetIndex` with the prompt's chunk keys (or tokens, hashed with the
engines' layout) and gets, per live node, the leading tokens it holds in each
tier and in any of them. The answer is advice from the index: a chunk evicted
since it was published costs the chosen engine a recompute, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.fleet.base import PRIMARY_MEDIUM, ClusterIndex, Holders
from kvtier.keys import ChunkKey, checked_keys, chunk_keys
from kvtier.layout import KVLayout
from kvtier.tiers.addresses import parse_host_port

#: What a node holds in any of its tiers, beside each tier's own count.
ANY_TIER = "any"


@dataclass(frozen=True)
class NodeScore:
    """Leading tokens of the asked prompt that ``node`` holds, per tier and in any."""

    node: str
    p2p_address: str | None
    tokens: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> int:
        return self.tokens.get(ANY_TIER, 0)

    def as_dict(self) -> dict[str, object]:
        return {"node": self.node, "p2p": self.p2p_address, "tokens": dict(self.tokens)}


def leading_runs(per_key: Sequence[Mapping[str, frozenset[str]]]) -> dict[str, dict[str, int]]:
    """Per node, the leading chunks held in each medium and in any (``ANY_TIER``).

    ``per_key[i]`` maps a node to the media it holds chunk ``i`` in. A
    node's run in a medium ends at the first chunk it lacks there; its
    ``any`` run at the first chunk it lacks everywhere.
    """
    runs: dict[str, dict[str, int]] = {}
    open_runs: dict[str, set[str]] = {}  # node -> media whose run is still going
    for position, holders in enumerate(per_key):
        if position == 0:
            for node, media in holders.items():
                runs[node] = dict.fromkeys((*media, ANY_TIER), 1)
                open_runs[node] = {*media, ANY_TIER}
            continue
        for node in list(open_runs):
            media = holders.get(node, frozenset())
            going = open_runs[node]
            for medium in list(going):
                if medium in media or (medium == ANY_TIER and media):
                    runs[node][medium] += 1
                else:
                    going.discard(medium)
            if not going:
                del open_runs[node]
        if not open_runs:
            break
    return runs


def scores(holders: Holders, chunk_tokens: int) -> list[NodeScore]:
    """:class:`NodeScore` of every node holding the first chunk, best first."""
    ranked = [
        NodeScore(
            node,
            holders.nodes[node].p2p_address if node in holders.nodes else None,
            {medium: chunks * chunk_tokens for medium, chunks in sorted(run.items())},
        )
        for node, run in leading_runs(holders.per_key).items()
    ]
    ranked.sort(key=lambda score: (-score.best, -score.tokens.get(PRIMARY_MEDIUM, 0), score.node))
    return ranked


class FleetIndex:
    """A reader of the cluster index for routers: scores for a prompt."""

    def __init__(self, index: ClusterIndex, chunk_tokens: int, layout: KVLayout | None = None):
        """``layout``: the engines' KV layout, to hash token lists; without it
        only chunk keys can be asked about."""
        if layout is not None and layout.chunk_tokens != chunk_tokens:
            raise ValueError(
                f"layout has chunk_tokens={layout.chunk_tokens}, expected {chunk_tokens}"
            )
        self.index = index
        self.chunk_tokens = chunk_tokens
        self.layout = layout

    def keys_of(self, tokens: Sequence[int] | np.ndarray) -> list[ChunkKey]:
        if self.layout is None:
            raise ValueError("no layout: token lists cannot be hashed; ask with chunk keys")
        return list(chunk_keys(self.layout.namespace, tokens, self.chunk_tokens))

    def scores(self, keys: Sequence[ChunkKey]) -> list[NodeScore]:
        """Every live node holding a leading part of ``keys``, best first.
        Raises when the index does not answer within its ``timeout_s``, and
        ``TypeError`` for keys that are not chunk keys, before the index is
        asked (they would count as its failures)."""
        return scores(self.index.holders(checked_keys(keys)), self.chunk_tokens)

    def scores_for_tokens(self, tokens: Sequence[int] | np.ndarray) -> list[NodeScore]:
        return self.scores(self.keys_of(tokens))

    def close(self) -> None:
        self.index.close()


class PeerFinder:
    """The index as the ``p2p`` tier asks it: which peer services hold a chunk
    in their primary tier (:class:`~kvtier.tiers.base.HolderIndex`)."""

    def __init__(self, index: ClusterIndex) -> None:
        self.index = index

    def peers_holding(self, keys: Sequence[ChunkKey]) -> list[frozenset[str]]:
        holders = self.index.holders(keys)
        addresses = {
            node: lease.p2p_address
            for node, lease in holders.nodes.items()
            if lease.p2p_address is not None and _is_address(lease.p2p_address)
        }
        return [
            frozenset(
                addresses[node]
                for node, media in held.items()
                if PRIMARY_MEDIUM in media and node in addresses
            )
            for held in holders.per_key
        ]


def _is_address(text: str) -> bool:
    try:
        parse_host_port(text)
    except ValueError:
        return False
    return True
