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
    """Snapshot every registry (entries and the once-per-process warning flag)."""
    saved = [(r, copy.copy(r.__dict__)) for r in _REGISTRIES]
    for _, state in saved:
        state["_registry"] = dict(state["_registry"])
    try:
        yield
    finally:
        for registry, state in saved:
            registry.__dict__.clear()
            registry.__dict__.update(state)
