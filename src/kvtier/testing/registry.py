"""Put the plugin registries back as they were after a test changes them."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.policies.factory import policy_registry
from kvtier.specs.factory import spec_registry
from kvtier.tiers.factory import tier_registry

_REGISTRIES = (tier_registry, policy_registry, spec_registry)


@contextmanager
def restore_registries() -> Iterator[None]:
    """Snapshot every registry, and start the block as a fresh process would:
    with the once-per-process warnings not yet given."""
    saved = [(r, copy.copy(r.__dict__)) for r in _REGISTRIES]
    for registry, state in saved:
        state["_registry"] = dict(state["_registry"])
        registry._warned_out_of_tree = False
    try:
        yield
    finally:
        for registry, state in saved:
            registry.__dict__.clear()
            registry.__dict__.update(state)
