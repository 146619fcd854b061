"""``fs``: chunks as files on a local disk or a shared mount.

Every chunk is one file written atomically (temp file, full write, length
check, rename) with the integrity header in a trailer, checked on every load.
``O_DIRECT`` is used where the filesystem takes it, so 2 MiB chunks move by
DMA between disk and the primary slot with no copy in Python or the page
cache. An in-memory index answers lookups and orders eviction; it is rebuilt
from disk in the background after a restart.

Durability: without ``fsync`` a chunk survives the death of the process
(SIGKILL included: the page cache outlives it) but may be lost in a power
failure or kernel crash. It is never *wrong* after one: a torn file fails
its checksum, is deleted and counted. ``fsync: true`` makes every stored
chunk survive power loss at a large cost in store throughput.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import ByteSize, Field

from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric, TierOptions
from kvtier.tiers.fs import io as chunk_io
from kvtier.tiers.fs.index import ChunkIndex
from kvtier.tiers.fs.io import (
    DIRECT_ALIGN,
    TRAILER_BLOCK,
    probe_direct_io,
    read_chunk,
    write_chunk,
)
from kvtier.tiers.fs.layout import ChunkFile, NamespaceDir
from kvtier.tiers.threaded import ThreadedTier, ThreadedTierOptions

logger = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class FilesystemTierOptions(ThreadedTierOptions):
    root_dir: Path
    """Directory holding the chunk files; created if missing. May be shared by
    several processes and hosts (one subdirectory per KV layout)."""

    max_bytes: ByteSize | None = Field(default=None, gt=0)
    """Upper bound on bytes of chunk files this tier keeps (e.g. ``500GiB``);
    least recently used chunks (loads count as use) are deleted to make room.
    Unset: no bound, and stores fail cleanly when the disk is full. The bound
    covers the chunk files this process knows: those on disk when it started,
    those it stored, and those its lookups found; processes sharing a root
    should give it the same value."""

    io_threads: int = Field(default=32, ge=1, le=256)
    """Worker threads doing file I/O. One pool serves both directions and
    always takes queued loads before queued stores, so no separate read and
    write counts are needed for loads to win."""

    direct_io: Literal["auto", "on", "off"] = "auto"
    """``O_DIRECT`` I/O: ``auto`` uses it when a probe write in ``root_dir``
    succeeds and slots are 4 KiB multiples; ``on`` fails at start otherwise."""

    fsync: bool = False
    """fsync each chunk file and its directory before a store reports success
    (survives power loss; much slower)."""

    shared: bool = True
    """Other processes may write to ``root_dir``: a lookup the local index
    cannot answer checks the filesystem (``PENDING`` for a step). Set false if
    this process is the only writer, so that misses are answered at once."""

    abandoned_temp_s: float = Field(default=3600.0, gt=0)
    """Age after which a temp file of another host's unfinished write is deleted."""


class FilesystemTier(ThreadedTier):
    """Chunk files under ``root_dir/<namespace hex>/``; see the module docstring."""

    Options: ClassVar[type[TierOptions]] = FilesystemTierOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stopping = threading.Event()
        self._indexer: threading.Thread | None = None
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _setup(self) -> None:
        options: FilesystemTierOptions = self.options  # type: ignore[assignment]
        self.root_dir = options.root_dir.expanduser().absolute()
        self.dir = NamespaceDir(self.root_dir, self.namespace)
        try:
            self.dir.create(self.spec.layout, TRAILER_BLOCK)
        except OSError as exc:
            raise OSError(
                exc.errno, f"{self.tier_type}: cannot use root_dir {self.root_dir}: {exc.strerror}"
            ) from exc
        self.file_bytes = self.slot_bytes + TRAILER_BLOCK
        self.max_bytes = None if options.max_bytes is None else int(options.max_bytes)
        if self.max_bytes is not None and self.max_bytes < self.file_bytes:
            raise ValueError(
                f"{self.tier_type}: max_bytes={self.max_bytes} cannot hold one chunk file "
                f"of {self.file_bytes} bytes"
            )
        self.shared = options.shared
        self.fsync = options.fsync
        self.direct, self.io_mode_reason = self._choose_io_mode(options.direct_io)
        self.disk_full_errors = 0
        self._disk_full = False
        self._index = ChunkIndex(self.max_bytes)
        self._index_ready = threading.Event()
        self._indexer = threading.Thread(
            target=self._reindex,
            args=(options.abandoned_temp_s,),
            name=f"kvtier-{self.tier_type}-index",
            daemon=True,
        )
        self._indexer.start()
        logger.info(
            "tier %s: %s, %s I/O (%s) in %s code, max_bytes=%s, fsync=%s; "
            "re-indexing in the background",
            self.tier_type,
            self.dir.path,
            "direct" if self.direct else "buffered",
            self.io_mode_reason,
            chunk_io.IMPLEMENTATION,
            self.max_bytes,
            self.fsync,
        )

    def _choose_io_mode(self, wanted: str) -> tuple[bool, str]:
        if wanted == "off":
            return False, "direct_io: off"
        why_not = probe_direct_io(str(self.dir.path))
        if why_not is None and self.slot_bytes % DIRECT_ALIGN:
            why_not = f"slot_bytes={self.slot_bytes} is not a multiple of {DIRECT_ALIGN}"
        if why_not is None:
            address = int(np.frombuffer(self._flat_view, dtype=np.uint8).ctypes.data)
            if address % DIRECT_ALIGN:
                why_not = "the primary buffer is not page-aligned"
        if why_not is None:
            return True, "O_DIRECT probe succeeded"
        if wanted == "on":
            raise ValueError(
                f"{self.tier_type}: direct_io is 'on' but O_DIRECT cannot be used for "
                f"{self.root_dir}: {why_not}"
            )
        logger.warning(
            "tier %s: O_DIRECT unavailable at %s (%s); using buffered I/O",
            self.tier_type,
            self.root_dir,
            why_not,
        )
        return False, why_not

    # Index ----------------------------------------------------------------

    @property
    def index_ready(self) -> bool:
        """Whether the background re-index of what was on disk has finished."""
        return self._index_ready.is_set()

    def wait_index(self, timeout: float | None = None) -> bool:
        """Block until the re-index finished (for tools and tests)."""
        return self._index_ready.wait(timeout)

    def _reindex(self, abandoned_temp_s: float) -> None:
        try:
            self.dir.remove_abandoned_temps(abandoned_temp_s)
            found: list[ChunkFile] = []
            broken: list[ChunkFile] = []
            for chunk in self.dir.scan():
                if self._stopping.is_set():
                    return
                # A final name is only ever a complete file (rename), and the
                # size is fixed by the namespace: any other size is damage.
                (found if chunk.size == self.file_bytes else broken).append(chunk)
            for chunk in broken:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(chunk.path)
            if broken:
                logger.warning(
                    "tier %s: deleted %d damaged chunk files", self.tier_type, len(broken)
                )
                self.count(corrupt_chunks=len(broken))
            found.sort(key=lambda chunk: chunk.mtime_ns)
            self._delete(self._index.merge_scan((c.key, c.size) for c in found))
            logger.info(
                "tier %s: indexed %d chunks (%d bytes) under %s",
                self.tier_type,
                len(self._index),
                self._index.held_bytes,
                self.dir.path,
            )
        except Exception:
            logger.exception("tier %s: re-index of %s failed", self.tier_type, self.dir.path)
        finally:
            self._index_ready.set()

    def _delete(self, victims: Iterable[bytes]) -> None:
        """Delete evicted chunk files. A reader that opened one still reads it
        whole; a later reader gets ENOENT, a clean miss."""
        evicted = 0
        for key in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir.chunk_path(key))
            evicted += 1
        if evicted:
            self.count(evictions=evicted)

    # ThreadedTier hooks (worker threads) ----------------------------------------

    def _known(self, key: ChunkKey) -> bool | None:
        if key in self._index:
            return True
        if self.shared or not self._index_ready.is_set():
            return None  # ask the filesystem, off the caller's thread
        return False

    def _on_disk(self, key: ChunkKey) -> bool:
        """Whether a complete chunk file exists (stored by anyone); indexes it."""
        try:
            info = os.stat(self.dir.chunk_path(key))
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != self.file_bytes:
            return False
        self._delete(self._index.adopt(key, info.st_size))
        return True

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [key in self._index or self._on_disk(key) for key in keys]

    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        # A chunk another process (or our past self) stored is not written
        # again; write_chunk checks for it with the same GIL release as the write.
        fits, victims = self._index.reserve(self.file_bytes)
        self._delete(victims)
        if not fits:
            raise OSError(errno.ENOSPC, f"max_bytes={self.max_bytes} taken by writes in flight")
        path = self.dir.chunk_path(key)
        try:
            written = write_chunk(
                path,
                self.dir.temp_path(path),
                self.namespace,
                key,
                payload,
                direct=self.direct,
                fsync=self.fsync,
            )
        except OSError as exc:
            self._index.release(self.file_bytes)
            if exc.errno in _DISK_FULL:
                self._note_disk_full(exc)
            raise
        self._index.commit(key, self.file_bytes, self.file_bytes)
        if written and self._disk_full:
            self._disk_full = False
            logger.info("tier %s: stores succeed again", self.tier_type)

    def _note_disk_full(self, exc: OSError) -> None:
        with self._stats_lock:
            self.disk_full_errors += 1
            first = not self._disk_full
            self._disk_full = True
        if first:
            logger.warning(
                "tier %s: %s is full (%s); stores fail until space frees up",
                self.tier_type,
                self.root_dir,
                exc.strerror,
            )

    def _load_chunk(self, key: ChunkKey, out: memoryview) -> None:
        try:
            read_chunk(self.dir.chunk_path(key), out, self.namespace, key, direct=self.direct)
        except FileNotFoundError:
            self._index.remove(key)  # evicted, maybe by another process
            raise
        self._index.touch(key)

    def _discard(self, key: ChunkKey) -> None:
        self._index.remove(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir.chunk_path(key))

    def _close(self) -> None:
        self._stopping.set()
        if self._indexer is not None:
            self._indexer.join()

    # Optional hooks --------------------------------------------------------------

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self._index.touch(key)

    @property
    def held_bytes(self) -> int:
        """Bytes of chunk files the index knows."""
        return self._index.held_bytes

    def health(self) -> Sequence[HealthCheck]:
        checks = [self._writable_check()]
        try:
            space = os.statvfs(self.dir.path)
            free = space.f_bavail * space.f_frsize
            checks.append(
                HealthCheck(
                    "free space",
                    free >= self.file_bytes,
                    f"{free} bytes free under {self.root_dir}",
                )
            )
        except OSError as exc:
            checks.append(HealthCheck("free space", False, f"statvfs failed: {exc.strerror}"))
        bound = "unbounded" if self.max_bytes is None else f"of max_bytes={self.max_bytes}"
        checks.append(
            HealthCheck(
                "index",
                True,
                f"{len(self._index)} chunks, {self._index.held_bytes} bytes {bound}"
                + ("" if self.index_ready else " (re-index running)"),
            )
        )
        checks.append(
            HealthCheck(
                "io mode",
                True,
                f"{self.describe()['io']}: {self.io_mode_reason}; {chunk_io.IMPLEMENTATION} code",
            )
        )
        return checks

    def _writable_check(self) -> HealthCheck:
        probe = self.dir.temp_path(str(self.dir.path / f"health{os.getpid()}.kvc"))
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return HealthCheck("writable", False, f"{self.dir.path}: {exc.strerror}")
        return HealthCheck("writable", True, str(self.dir.path))

    def metrics(self) -> Sequence[TierMetric]:
        return (
            TierMetric("held_bytes", self._index.held_bytes, "Bytes of chunk files indexed."),
            TierMetric("chunks", len(self._index), "Chunk files indexed."),
            TierMetric(
                "disk_full_errors",
                self.disk_full_errors,
                "Stores that failed because the filesystem was full.",
                counter=True,
            ),
        )

    def describe(self) -> dict[str, object]:
        return {
            "type": self.tier_type,
            "root_dir": str(self.root_dir),
            "namespace_dir": str(self.dir.path),
            "io": "direct" if self.direct else "buffered",
            "io_reason": self.io_mode_reason,
            "io_code": chunk_io.IMPLEMENTATION,
            "io_threads": self.io_threads,
            "fsync": self.fsync,
            "shared": self.shared,
            "max_bytes": self.max_bytes,
            "held_bytes": self._index.held_bytes,
            "chunks": len(self._index),
            "index_ready": self.index_ready,
            "disk_full_errors": self.disk_full_errors,
        }
