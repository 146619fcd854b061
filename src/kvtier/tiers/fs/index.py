"""What an ``fs`` tier knows is on disk: the keys of chunk files it saw, the
index that holds ``max_bytes`` across the host's processes, and the
background re-index that rebuilds both after a restart.
"""

from __future__ import annotations

import heapq
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.errors import describe_error
from kvtier.keys import ChunkKey
from kvtier.tiers.fs import io as chunk_io
from kvtier.tiers.fs.io import TRAILER_BLOCK
from kvtier.tiers.fs.layout import ChunkFile, NamespaceDir, OddEntry, remove_entry
from kvtier.tiers.fs.options import FilesystemTierOptions
from kvtier.tiers.fs.shared_index import NETWORK_FILESYSTEMS, SharedIndex, filesystem_type
from kvtier.tiers.local import LocalRuntime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkSizes:
    """The sizes a chunk file of one namespace may have."""

    #: Payload bytes of one chunk (at most, under a variable-size codec).
    stored_bytes: int
    #: Payloads vary in size (a variable-size codec): files take whole pages up to the largest.
    variable: bool

    @property
    def file_bytes(self) -> int:
        """Size of every chunk file, or of the largest under a variable-size codec."""
        return self.stored_bytes + TRAILER_BLOCK

    def fits(self, size: int) -> bool:
        """Whether a chunk file of ``size`` bytes may be one of this namespace."""
        if self.variable:
            return chunk_io.payload_size_fits(size, self.stored_bytes)
        return size == self.file_bytes

    def complete(self, paths: Sequence[str]) -> list[bool]:
        """Which of ``paths`` hold a complete chunk file (:func:`complete_files`:
        one system-call run; under a variable-size codec, one ``lstat`` each)."""
        if not self.variable:
            return chunk_io.complete_files(paths, self.file_bytes)
        return chunk_io.sized_files(paths, self.fits)


def removed_or_kept(path: str) -> bool:
    """Remove a damaged entry; false only if it was gone already (removed,
    and counted, by another thread). One that must stay (a directory that is
    not empty) counts as found."""
    return remove_entry(path) or os.path.lexists(path)


class ChunkIndex:
    """Keys of chunk files known to exist, and with ``max_bytes`` the
    :class:`SharedIndex` of every process of the host that holds the bound.
    Another process may have deleted a known file since: a load then finds
    nothing, a plain miss."""

    def __init__(
        self,
        directory: NamespaceDir,
        sizes: ChunkSizes,
        options: FilesystemTierOptions,
        runtime: LocalRuntime,
    ) -> None:
        self.dir = directory
        self.sizes = sizes
        self.runtime = runtime
        self.keys: set[bytes] = set()
        #: Set once every chunk file's name is in :attr:`keys`: lookups are
        #: answered from them from then on, while :attr:`ready` waits for
        #: the files' sizes to be checked and the bound reconciled.
        self.listed = threading.Event()
        self.ready = threading.Event()
        self.scan_skipped = 0
        self._abandoned_temp_s = options.abandoned_temp_s
        self._stopping = threading.Event()
        self._indexer: threading.Thread | None = None
        self._poll_queued = False
        self.bound: SharedIndex | None = None
        if options.max_bytes is not None:
            self.bound = self._open_bound(int(options.max_bytes), options)

    def _open_bound(self, max_bytes: int, options: FilesystemTierOptions) -> SharedIndex:
        tier_type = self.runtime.tier_type
        fstype = filesystem_type(str(self.dir.path))
        if fstype in NETWORK_FILESYSTEMS:
            logger.warning(
                "tier %s: %s is on %s: max_bytes holds only among processes of one "
                "host; give each host its own root_dir (see docs/fs.md, Shared roots)",
                tier_type,
                self.dir.root_dir,
                fstype,
            )
        try:
            return SharedIndex(
                str(self.dir.path),
                max_bytes,
                self.dir.chunk_path,
                options.abandoned_temp_s,
                scan=self._complete_chunk_files,
                lock_timeout_s=options.index_lock_timeout_s,
            )
        except (sqlite3.Error, OSError) as exc:
            raise OSError(
                f"{tier_type}: cannot open the index that holds max_bytes in "
                f"{self.dir.path}: {describe_error(exc)}"
            ) from exc

    def start(self) -> None:
        """Re-index what is on disk, on a thread of its own."""
        self._indexer = threading.Thread(
            target=self._reindex,
            name=f"kvtier-{self.runtime.tier_type}-index",
            daemon=True,
        )
        self._indexer.start()

    def close(self) -> None:
        self._stopping.set()
        if self._indexer is not None:
            self._indexer.join()
        if self.bound is not None:
            self.bound.close()

    @property
    def held_bytes(self) -> int:
        """Bytes of chunk files: of every process sharing the directory with
        ``max_bytes`` set, else those this process knows (at most: under a
        variable-size codec, counted at the largest file's size)."""
        if self.bound is not None:
            return self.bound.totals().nbytes
        return len(self.keys) * self.sizes.file_bytes

    @property
    def chunk_count(self) -> int:
        """Chunk files, counted as :attr:`held_bytes` counts their bytes."""
        if self.bound is not None:
            return self.bound.totals().chunks
        return len(self.keys)

    def recent(self, limit: int) -> list[ChunkKey]:
        """Up to ``limit`` chunks, most recently used first: by the shared
        index's use stamps, or without one by the files' times (a load stamps
        a file it finds old; see :func:`~kvtier.tiers.fs.io.read_chunk`)."""
        if self.bound is not None:
            return [ChunkKey(key) for key in self.bound.most_recent(limit)]
        newest = heapq.nlargest(limit, self._complete_chunk_files(), key=lambda c: c.mtime_ns)
        return [ChunkKey(chunk.key) for chunk in newest]

    def forget(self, key: ChunkKey) -> None:
        self.keys.discard(key)
        if self.bound is not None:
            self.bound.forget(key)

    def forget_evicted(self, victims: Iterable[bytes]) -> None:
        """Chunks this process evicted through the shared index (which deleted
        their files)."""
        evicted = [ChunkKey(key) for key in victims]
        self.keys.difference_update(evicted)
        if evicted:
            self.runtime.count(evictions=len(evicted))
            self.runtime.report_removed(evicted)

    def eviction_poll(self) -> Callable[[], None] | None:
        """The task that learns what other processes evicted, unless one is
        queued already (or nobody else evicts: no shared bound)."""
        if self.bound is None or self._poll_queued:
            return None
        self._poll_queued = True
        return self.poll_evictions

    def poll_evictions(self) -> None:
        """Drop keys other processes evicted from the local set, so that
        lookups stop answering HIT for them."""
        if self.bound is None:
            return
        try:
            evicted = self.bound.evictions()
        finally:
            self._poll_queued = False
        if evicted is None:  # too far behind: rely on the filesystem instead
            self.keys.clear()
        else:
            # Those still held here: the index also lists this process's own
            # evictions, reported when they were made.
            held = [ChunkKey(key) for key in evicted if key in self.keys]
            self.keys.difference_update(evicted)
            self.runtime.report_removed(held)

    def drop_broken(self, broken: Sequence[str]) -> None:
        """Remove damaged entries at chunk paths, counting those removed here."""
        # A lookup may find the same entry first: whoever removes it counts it.
        found = sum(removed_or_kept(path) for path in broken)
        if found:
            logger.warning(
                "tier %s: removed %d damaged chunk files or entries at chunk paths",
                self.runtime.tier_type,
                found,
            )
            self.runtime.count(corrupt_chunks=found)

    def _reindex(self) -> None:
        tier_type = self.runtime.tier_type
        try:
            # The names first: a final name is only ever a complete file
            # (rename), so a restarted engine's lookups are answered from the
            # names once all are listed. A file damaged since is a miss its
            # load finds (and removes), as it would be after the survey.
            for key in self.dir.listed_chunks():
                if self._stopping.is_set():
                    return
                self.keys.add(key)
            self.listed.set()
            found: list[ChunkFile] = []
            broken: list[str] = []
            strays: list[OddEntry] = []
            for entry in self.dir.survey():  # the directories are cached by now
                if self._stopping.is_set():
                    return
                if isinstance(entry, ChunkFile):
                    # The namespace fixes a chunk file's size (or bounds it):
                    # any other is damage.
                    if self.sizes.fits(entry.size):
                        found.append(entry)
                        self.keys.add(entry.key)  # stored since the listing
                    else:
                        self.keys.discard(entry.key)
                        broken.append(entry.path)
                elif entry.key is not None:
                    self.keys.discard(entry.key)
                    broken.append(entry.path)  # a directory, FIFO... named like a chunk
                else:
                    strays.append(entry)
            # After the listing and the survey: this walk finds the directories cached.
            self.dir.remove_abandoned_temps(self._abandoned_temp_s)
            self.drop_broken(broken)
            if strays:
                self.scan_skipped += len(strays)
                logger.warning(
                    "tier %s: skipped %d entries that are not chunk files (e.g. %s: %s)",
                    tier_type,
                    len(strays),
                    strays[0].path,
                    strays[0].kind,
                )
            if self.bound is not None:
                self.forget_evicted(self.bound.reconcile(found, self._stopping.is_set))
            logger.info(
                "tier %s: indexed %d chunks (%d bytes) under %s",
                tier_type,
                len(self.keys),
                self.held_bytes,
                self.dir.path,
            )
        except Exception:
            logger.exception("tier %s: re-index of %s failed", tier_type, self.dir.path)
        finally:
            self.listed.set()
            self.ready.set()

    def _complete_chunk_files(self) -> Iterator[ChunkFile]:
        """Chunk files of the namespace's size (others are damage the
        re-index removes)."""
        return (chunk for chunk in self.dir.scan() if self.sizes.fits(chunk.size))
