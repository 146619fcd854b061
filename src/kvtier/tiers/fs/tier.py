"""``fs``: chunks as files on a local disk or a shared mount, one file per
chunk written atomically and verified on every load; with ``max_bytes`` an
index shared by every process of the host holds the bound.

The tier is the local-tier runtime over :class:`~kvtier.tiers.fs.backend.FsBackend`.
See docs/fs.md, 'Guarantees' and 'Shared roots'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvtier.keys import ChunkKey
from kvtier.tiers.fs.backend import FsBackend
from kvtier.tiers.fs.io import DIRECT_ALIGN
from kvtier.tiers.fs.layout import NamespaceDir
from kvtier.tiers.fs.options import FilesystemTierOptions
from kvtier.tiers.local import LocalTier

__all__ = ["FilesystemTier", "FilesystemTierOptions"]


class FilesystemTier(LocalTier[FilesystemTierOptions]):
    """Chunk files under ``root_dir/<namespace hex>/``; see docs/fs.md."""

    backend_class = FsBackend
    backend: FsBackend
    #: Chunk files have one size per namespace, or under a variable-size
    #: codec whole pages up to the largest; ``O_DIRECT`` needs whole pages.
    payload_align: ClassVar[int] = DIRECT_ALIGN
    knows_recent_use: ClassVar[bool] = True

    def recent_keys(self, limit: int) -> Sequence[ChunkKey]:
        return self.backend.index.recent(limit)

    @property
    def index_ready(self) -> bool:
        """Whether the background re-index of what was on disk has finished."""
        return self.backend.index.ready.is_set()

    def wait_index(self, timeout: float | None = None) -> bool:
        """Block until the re-index finished (for tools and tests)."""
        return self.backend.index.ready.wait(timeout)

    @property
    def held_bytes(self) -> int:
        """Bytes of chunk files (see :attr:`ChunkIndex.held_bytes`)."""
        return self.backend.index.held_bytes

    @property
    def chunk_count(self) -> int:
        """Chunk files, counted as :attr:`held_bytes` counts their bytes."""
        return self.backend.index.chunk_count

    @property
    def dir(self) -> NamespaceDir:
        """The namespace directory holding the chunk files."""
        return self.backend.dir

    @property
    def file_bytes(self) -> int:
        """Size of every chunk file, or of the largest under a variable-size codec."""
        return self.backend.file_bytes

    @property
    def disk_full_errors(self) -> int:
        """Stores that failed because the filesystem was full."""
        return self.backend.disk_full_errors

    @property
    def vanished_chunks(self) -> int:
        """Loads that found the chunk file gone (evicted by another process)."""
        return self.backend.vanished_chunks

    @property
    def scan_skipped(self) -> int:
        """Entries the re-index found that are not chunk files."""
        return self.backend.index.scan_skipped
