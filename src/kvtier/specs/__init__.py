"""Offloading specs and their factory."""

from kvtier.specs.base import OffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory, register_spec, spec_registry

__all__ = ["OffloadingSpec", "OffloadingSpecFactory", "register_spec", "spec_registry"]
