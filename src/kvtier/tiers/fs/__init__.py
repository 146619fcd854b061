"""The ``fs`` tier: a filesystem tier for local NVMe and shared mounts."""

from kvtier.tiers.fs.options import FilesystemTierOptions
from kvtier.tiers.fs.tier import FilesystemTier

__all__ = ["FilesystemTier", "FilesystemTierOptions"]
