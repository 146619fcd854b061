"""The ``fs`` tier's backend: one file per chunk under ``root_dir/<namespace
hex>/``, written atomically (direct or buffered I/O) and verified on every
load. A :class:`~kvtier.tiers.local.LocalBackend` run by
:class:`~kvtier.tiers.fs.tier.FilesystemTier`; see docs/fs.md.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from kvtier.errors import ChunkVanishedError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric
from kvtier.tiers.fs import io as chunk_io
from kvtier.tiers.fs.index import ChunkIndex, ChunkSizes, removed_or_kept
from kvtier.tiers.fs.io import (
    DIRECT_ALIGN,
    TRAILER_BLOCK,
    probe_direct_io,
    read_chunk,
    read_chunks,
    write_chunk,
)
from kvtier.tiers.fs.layout import NamespaceDir, mode_kind
from kvtier.tiers.fs.options import FilesystemTierOptions
from kvtier.tiers.local import ItemErrors, LocalBackend, LocalRuntime, SlotPairs
from kvtier.tiers.runtime import spread_size
from kvtier.tiers.threaded import ThreadedTierOptions

logger = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class FsBackend(LocalBackend[FilesystemTierOptions]):
    """Chunk files in a namespace directory, bounded by ``max_bytes`` when set."""

    Options: ClassVar[type[ThreadedTierOptions]] = FilesystemTierOptions
    #: Most chunks one I/O task moves (see :meth:`batches`).
    io_batch: ClassVar[int] = 8
    #: Most payload bytes one I/O task moves, which caps a group of large chunks.
    batch_bytes: ClassVar[int] = 2 << 20
    #: A chunk file's size says how long its payload is (see :func:`read_chunk`).
    variable_payloads: ClassVar[bool] = True

    def __init__(self, options: FilesystemTierOptions, runtime: LocalRuntime) -> None:
        super().__init__(options, runtime)
        self.root_dir = options.root_dir.expanduser().absolute()
        self.dir = NamespaceDir(self.root_dir, runtime.namespace)
        stage = runtime.codec_stage
        self.sizes = ChunkSizes(stage.stored_bytes, variable=not stage.fixed_size)
        #: Most chunks one I/O task moves: :attr:`io_batch`, fewer of large chunks.
        self.group_chunks = max(1, min(self.io_batch, self.batch_bytes // stage.stored_bytes))
        self._create_dir()
        #: Size of every chunk file, or of the largest under a variable-size codec.
        self.file_bytes = self.sizes.file_bytes
        self.max_bytes = None if options.max_bytes is None else int(options.max_bytes)
        runtime.require_room(self.max_bytes, self.file_bytes, "chunk file")
        self.shared = options.shared
        self.fsync = options.fsync
        self.direct, self.io_mode_reason = self._choose_io_mode(options.direct_io)
        self.disk_full_errors = 0
        self.vanished_chunks = 0
        self._disk_full = False
        self._counts_lock = threading.Lock()
        self.index = ChunkIndex(self.dir, self.sizes, options, runtime)
        try:
            self.index.start()
        except BaseException:
            self.index.close()
            raise
        logger.info(
            "tier %s: %s, %s I/O (%s) in %s code, max_bytes=%s, fsync=%s; "
            "re-indexing in the background",
            runtime.tier_type,
            self.dir.path,
            "direct" if self.direct else "buffered",
            self.io_mode_reason,
            chunk_io.IMPLEMENTATION,
            self.max_bytes,
            self.fsync,
        )

    def _create_dir(self) -> None:
        stage = self.runtime.codec_stage
        codec: dict[str, object] | None = None
        if not stage.identity:
            codec = {"type": stage.name, "params": stage.codec.params()}
        try:
            self.dir.create(
                stage.layout,
                TRAILER_BLOCK,
                stage.stored_bytes,
                codec,
                variable=self.sizes.variable,
            )
            for path, kind in self.dir.repair_buckets():
                logger.warning(
                    "tier %s: replaced %s at bucket %s", self.runtime.tier_type, kind, path
                )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"{self.runtime.tier_type}: cannot use root_dir {self.root_dir}: {exc.strerror}",
            ) from exc

    def _choose_io_mode(self, wanted: str) -> tuple[bool, str]:
        if wanted == "off":
            return False, "direct_io: off"
        stored_bytes = self.sizes.stored_bytes
        why_not = probe_direct_io(self.dir.probe_path("direct-io-probe"))
        if why_not is None and stored_bytes % DIRECT_ALIGN:
            why_not = f"stored_bytes={stored_bytes} is not a multiple of {DIRECT_ALIGN}"
        if why_not is None:
            # Slot 0 opens the primary buffer: its address is the buffer's.
            address = int(np.frombuffer(self.runtime.slot(0), dtype=np.uint8).ctypes.data)
            if address % DIRECT_ALIGN:
                why_not = "the primary buffer is not page-aligned"
        if why_not is None:
            return True, "O_DIRECT probe succeeded"
        if wanted == "on":
            raise ValueError(
                f"{self.runtime.tier_type}: direct_io is 'on' but O_DIRECT cannot be used for "
                f"{self.root_dir}: {why_not}"
            )
        logger.warning(
            "tier %s: O_DIRECT unavailable at %s (%s); using buffered I/O",
            self.runtime.tier_type,
            self.root_dir,
            why_not,
        )
        return False, why_not

    # Lookups ----------------------------------------------------------------

    def known(self, key: ChunkKey) -> bool | None:
        if not self.index.listed.is_set():
            # Being listed, the index knows the chunks it has walked so far, in
            # the root's order, not a prefix's: answering those at once and
            # checking the rest would promote a prefix out of order, and its
            # reader waits for its earliest chunk. So until every name is
            # listed, every key is checked (one it knows costs no system call).
            return None
        if key in self.index.keys:
            return True
        # Another process may have stored it: ask the filesystem, off the caller's thread.
        return None if self.shared else False

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # Every key the index does not know is looked at in one system-call
        # run (one GIL release); only those not found complete are examined
        # one by one, for what is there instead (damage is discarded).
        known = self.index.keys
        unknown = [key for key in keys if key not in known]
        paths = [self.dir.chunk_path(key) for key in unknown]
        complete = dict(zip(unknown, self.sizes.complete(paths), strict=True))
        found = []
        for key in keys:
            present = complete.get(key, True) or self._on_disk(key)
            if present:
                known.add(key)
            found.append(present)
        return found

    def _on_disk(self, key: ChunkKey) -> bool:
        """Whether a complete chunk file exists (stored by anyone). Answers
        for this key alone: an error examining it is a miss for it."""
        path = self.dir.chunk_path(key)
        tier_type = self.runtime.tier_type
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.debug("tier %s: cannot examine %s: %s", tier_type, path, exc)
            return False
        if not stat.S_ISREG(info.st_mode) or not self.sizes.fits(info.st_size):
            kind = "a regular file" if stat.S_ISREG(info.st_mode) else mode_kind(info.st_mode)
            logger.warning(
                "tier %s: discarding %s at chunk path %s (%d bytes)",
                tier_type,
                kind,
                path,
                info.st_size,
            )
            if self.discard(key):  # else the re-index got there first, and counted it
                self.runtime.count(corrupt_chunks=1)
            return False
        self.index.keys.add(key)
        return True

    # Moves --------------------------------------------------------------------

    def batches(self, pending: SlotPairs, idle_workers: int) -> list[SlotPairs]:
        # While workers are idle a job goes one chunk per task, so that its
        # chunks move in parallel. Once the queue holds work for every
        # worker, more tasks add no parallelism: grouping chunks then pays
        # the queue, the wake-up and the job's lock once per group, up to
        # group_chunks. Past a few MiB a group saves nothing, and its chunks
        # move one after the other: a job of 2 MiB chunks queued behind
        # others (a prefix's later promotion job) went on two workers and
        # ended with all the rest, not in its turn. Groups take every n-th
        # chunk, so that the job's chunks still start in about their order
        # (a prefix's first chunks first).
        size = spread_size(len(pending), idle_workers, self.group_chunks)
        groups = math.ceil(len(pending) / size)
        return [pending[i::groups] for i in range(groups)]

    def store_many(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> ItemErrors:
        # In a group, chunks already on disk (another process stored them,
        # or this one before a restart) are found first, all with one
        # system-call run: they are neither hashed nor written. A chunk
        # alone is left to the check write_chunk makes in the same GIL
        # release as its hash and write (neither happens if it is there): a
        # run of its own would give up and wait for the GIL once more.
        paths = [self.dir.chunk_path(key) for key in keys]
        on_disk = self.sizes.complete(paths) if len(paths) > 1 else [False]
        errors: ItemErrors = []
        for key, payload, path, present in zip(keys, payloads, paths, on_disk, strict=True):
            try:
                self._store_at(path, present, key, payload)
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        return errors

    def _store_at(self, path: str, on_disk: bool, key: ChunkKey, payload: memoryview) -> None:
        """Store ``key`` at ``path``, whose complete file was found there
        (``on_disk``) or not. One found missing may still appear meanwhile:
        :func:`write_chunk` looks again, with the same GIL release as the write."""
        temp = self.dir.temp_path(path)
        bound = self.index.bound
        if bound is not None:
            # The file's own size: under a variable-size codec the bound
            # counts what chunks take, not what the largest would.
            plan, victims = bound.reserve(key, len(payload) + TRAILER_BLOCK, temp)
            self.index.forget_evicted(victims)
            if plan == "present":  # there, or another live process is writing it
                self.index.keys.add(key)
                return
            if plan == "full":
                raise OSError(errno.ENOSPC, f"max_bytes={self.max_bytes} taken by writes in flight")
        try:
            written = not on_disk and write_chunk(
                path,
                temp,
                self.runtime.namespace,
                key,
                payload,
                direct=self.direct,
                fsync=self.fsync,
            )
        except BaseException as exc:
            if bound is not None:
                bound.release(key, temp)
            if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
                self._note_disk_full(exc)
            raise
        if bound is not None:
            try:
                bound.written(key, temp)
            except sqlite3.Error as exc:  # stored all the same; counted as in flight
                logger.warning("tier %s: index not updated: %s", self.runtime.tier_type, exc)
        self.index.keys.add(key)
        if written and self._disk_full:
            self._disk_full = False
            logger.info("tier %s: stores succeed again", self.runtime.tier_type)

    def _note_disk_full(self, exc: OSError) -> None:
        with self._counts_lock:
            self.disk_full_errors += 1
            first = not self._disk_full
            self._disk_full = True
        if first:
            logger.warning(
                "tier %s: %s is full (%s); stores fail until space frees up",
                self.runtime.tier_type,
                self.root_dir,
                exc.strerror,
            )

    def load_many(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> ItemErrors:
        read: Sequence[BaseException | None]
        if self.sizes.variable:  # each file's size first says how much to read
            read = self.each(self._read_variable, keys, outs)
        else:
            paths = [self.dir.chunk_path(key) for key in keys]
            read = read_chunks(paths, outs, self.runtime.namespace, keys, direct=self.direct)
        return [self._loaded(key, error) for key, error in zip(keys, read, strict=True)]

    def _read_variable(self, key: ChunkKey, out: memoryview) -> None:
        path = self.dir.chunk_path(key)
        read_chunk(path, out, self.runtime.namespace, key, direct=self.direct, variable=True)

    def _loaded(self, key: ChunkKey, error: BaseException | None) -> BaseException | None:
        """What reading ``key`` gave, as the runtime takes it: a file gone is
        a miss (evicted, most likely by another process), not damage; a chunk
        read gets its use stamp."""
        if isinstance(error, FileNotFoundError):
            with self._counts_lock:
                self.vanished_chunks += 1
            self.index.forget(key)
            vanished = ChunkVanishedError(f"chunk file gone: {error.filename}")
            vanished.__cause__ = error
            return vanished
        if error is not None:
            return error
        bound = self.index.bound
        if bound is not None and bound.touch(key):
            try:
                bound.flush_if_free()
            except sqlite3.Error as exc:  # the chunk was loaded all the same
                logger.warning("tier %s: use stamps not written: %s", self.runtime.tier_type, exc)
        return None

    def discard(self, key: ChunkKey) -> bool:
        # One removal for every path that finds damage (a load's verification,
        # a lookup, the re-index): only the one that removes the entry counts it.
        self.index.forget(key)
        return removed_or_kept(self.dir.chunk_path(key))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        # Recorded in memory only (the caller's thread does no I/O); written
        # by the next store or load that finds the stamps due.
        bound = self.index.bound
        if bound is not None:
            for key in keys:
                if key in self.index.keys:
                    bound.touch(key)

    def step_task(self) -> Callable[[], None] | None:
        # Only a shared root has other processes evicting what this one knows.
        return self.index.eviction_poll() if self.shared else None

    def close(self) -> None:
        self.index.close()

    # Reports --------------------------------------------------------------------

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
                f"{self.index.chunk_count} chunks, {self.index.held_bytes} bytes {bound}"
                + ("" if self.index.ready.is_set() else " (re-index running)"),
            )
        )
        checks.append(
            HealthCheck(
                "io mode",
                True,
                f"{self._io_name}: {self.io_mode_reason}; {chunk_io.IMPLEMENTATION} code",
            )
        )
        return checks

    @property
    def _io_name(self) -> str:
        return "direct" if self.direct else "buffered"

    def _writable_check(self) -> HealthCheck:
        probe = self.dir.probe_path("health")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return HealthCheck("writable", False, f"{self.dir.path}: {exc.strerror}")
        return HealthCheck("writable", True, str(self.dir.path))

    def metrics(self) -> Sequence[TierMetric]:
        return (
            TierMetric("held_bytes", self.index.held_bytes, "Bytes of chunk files indexed."),
            TierMetric("chunks", self.index.chunk_count, "Chunk files indexed."),
            TierMetric(
                "disk_full_errors",
                self.disk_full_errors,
                "Stores that failed because the filesystem was full.",
                counter=True,
            ),
            TierMetric(
                "vanished_chunks",
                self.vanished_chunks,
                "Loads that found the chunk file gone (evicted by another process).",
                counter=True,
            ),
        )

    def describe(self) -> dict[str, object]:
        bound = self.index.bound
        return {
            "root_dir": str(self.root_dir),
            "namespace_dir": str(self.dir.path),
            "io": self._io_name,
            "io_reason": self.io_mode_reason,
            "io_code": chunk_io.IMPLEMENTATION,
            "io_threads": self.options.io_threads,
            "fsync": self.fsync,
            "shared": self.shared,
            "max_bytes": self.max_bytes,
            "held_bytes": self.index.held_bytes,
            "chunks": self.index.chunk_count,
            "shared_index": None if bound is None else bound.path,
            "index_ready": self.index.ready.is_set(),
            "disk_full_errors": self.disk_full_errors,
            "vanished_chunks": self.vanished_chunks,
            "scan_skipped": self.index.scan_skipped,
        }
