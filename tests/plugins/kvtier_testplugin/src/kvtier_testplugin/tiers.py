"""Tiers loaded through module_path and through entry points."""

from typing import Any, ClassVar

from pydantic import Field

from kvtier.tiers.base import TierOptions
from kvtier.tiers.memory import MemoryTier, MemoryTierOptions


class OutOfTreeOptions(MemoryTierOptions):
    label: str = "oot"
    """A custom option: must reach the constructor."""

    weight: int = Field(default=1, ge=1)
    """A typed custom option, validated like a built-in one."""


class OutOfTreeTier(MemoryTier):
    """A memory tier that remembers the options it was built with."""

    Options: ClassVar[type[TierOptions]] = OutOfTreeOptions

    def __init__(self, **kwargs: Any) -> None:
        self.received = dict(kwargs)
        super().__init__(**kwargs)


class OtherTier(OutOfTreeTier):
    """A second out-of-tree tier, for once-per-process logging checks."""


class EntryPointTier(OutOfTreeTier):
    """Found through the ``kvtier.tiers`` entry point group."""


class NotATier:
    """Not a SecondaryTier: loading it must be a TypeError."""
