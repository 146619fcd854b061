"""The ``fs`` tier: a filesystem tier for local NVMe and shared mounts."""

from kvtier.tiers.fs.tier import FilesystemTier, FilesystemTierOptions

__all__ = ["FilesystemTier", "FilesystemTierOptions"]
