"""What the fs tier's test files share: the layout, a chunk file's size, and
opening a tier whose index is ready."""

from __future__ import annotations

from pathlib import Path

from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs.io import TRAILER_BLOCK

LAYOUT = small_layout()
FILE_BYTES = LAYOUT.slot_bytes + TRAILER_BLOCK


def fs_tier(harness: TierHarness) -> FilesystemTier:
    tier = harness.tier
    assert isinstance(tier, FilesystemTier)
    return tier


def open_tier(root: Path, *, io_threads: int = 2, **options: object) -> TierHarness[FilesystemTier]:
    """An fs tier on ``root`` whose index of chunks on disk is loaded."""
    harness = TierHarness(
        {"type": "fs", "root_dir": str(root), "io_threads": io_threads, **options},
        LAYOUT,
        tier_class=FilesystemTier,
    )
    assert fs_tier(harness).wait_index(30)
    return harness
