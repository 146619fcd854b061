"""Dicts kept bounded by dropping their oldest entries: answers, waits and
records a tier keeps for callers that may never come back for them."""

from __future__ import annotations

import itertools
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def drop_oldest(entries: dict[K, V], limit: int) -> None:
    """Drop the oldest entries (first inserted) past ``limit``."""
    excess = len(entries) - limit
    if excess > 0:
        for stale in list(itertools.islice(entries, excess)):
            del entries[stale]
