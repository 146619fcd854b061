"""Policies that read the prefix tree: bonuses by place in it, and sessions by root."""

from __future__ import annotations

from typing import Any, Literal

from kvtier.keys import ChunkKey
from policy_lab.ranked import Rank, RankedPolicy

Bonus = Literal["fan-out", "extension", "shallow"]


class ChainBonus(RankedPolicy):
    """Last use (in requests) plus a bonus, deepest first among equals.

    ``fan-out``: ``requests`` for a chunk that two or more distinct chains
    branched from; ``extension``: ``requests`` for a chunk some later request
    extended (it has a child); ``shallow``: ``requests / (1 + depth)``.
    """

    def __init__(
        self, capacity: int, *, bonus: Bonus = "fan-out", requests: float = 200, **kwargs: Any
    ) -> None:
        super().__init__(capacity, **kwargs)
        if bonus not in ("fan-out", "extension", "shallow"):
            raise ValueError(f"unknown bonus {bonus!r}")
        self.bonus, self.requests = bonus, requests
        self.children: dict[ChunkKey, set[ChunkKey]] = {}
        self.depth: dict[ChunkKey, int] = {}
        self.last: dict[ChunkKey, int] = {}

    def _value(self, key: ChunkKey) -> Rank:
        depth, last = self.depth[key], self.last[key]
        if self.bonus == "shallow":
            extra = self.requests / (1 + depth)
        else:
            wanted = 2 if self.bonus == "fan-out" else 1
            extra = self.requests if len(self.children.get(key, ())) >= wanted else 0.0
        return (last + extra, -depth)

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        self.depth[key], self.last[key] = depth, self.request
        if parent is not None and new:
            siblings = self.children.setdefault(parent, set())
            if key not in siblings:
                siblings.add(key)
                if parent in self:  # its bonus may have changed
                    self._push(parent, self._value(parent))
        return self._value(key)

    def forget(self, key: ChunkKey) -> None:
        self.depth.pop(key, None)
        self.last.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self.children.clear()
        self.depth.clear()
        self.last.clear()


class SessionRoot(RankedPolicy):
    """Evicts first the chunks of requests whose root (the first chunk of the
    chain, which names a conversation) was never seen before, then the rest;
    within each class the least recently used request's deepest chunk first.
    Roots are counted without bound, beyond what the tier holds."""

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.roots: dict[ChunkKey, int] = {}
        self._returning = False

    def rank(self, key: ChunkKey, depth: int, parent: ChunkKey | None, new: bool) -> Rank:
        if depth == 0:
            seen = self.roots[key] = self.roots.get(key, 0) + 1
            self._returning = seen > 1
        return (1 if self._returning else 0, self.request, -depth)

    def clear(self) -> None:
        super().clear()
        self.roots.clear()
