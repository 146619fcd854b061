"""Put the plugin registries back as they were after a test changes them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.codecs import codec_registry
from kvtier.policies.factory import policy_registry
from kvtier.specs.factory import spec_registry
from kvtier.tiers.factory import tier_registry

_REGISTRIES = (tier_registry, policy_registry, spec_registry, codec_registry)


@contextmanager
def restore_registries() -> Iterator[None]:
    """Snapshot every registry, and start the block as a fresh process would:
    with the once-per-process warnings not yet given."""
    saved = [(registry, registry.snapshot()) for registry in _REGISTRIES]
    for registry, snapshot in saved:
        registry.restore(snapshot, forget_warnings=True)
    try:
        yield
    finally:
        for registry, snapshot in saved:
            registry.restore(snapshot)
