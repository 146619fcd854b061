"""``fs``: chunks as files on a local disk or a shared mount, one file per
chunk written atomically and verified on every load; with ``max_bytes`` an
index shared by every process of the host holds the bound.

See docs/fs.md, 'Guarantees' and 'Shared roots'.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import sqlite3
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import ByteSize, Field

from kvtier.errors import ChunkVanishedError, describe_error
from kvtier.keys import ChunkKey
from kvtier.tiers.base import HealthCheck, TierMetric, TierOptions
from kvtier.tiers.fs import io as chunk_io
from kvtier.tiers.fs.io import (
    DIRECT_ALIGN,
    TRAILER_BLOCK,
    probe_direct_io,
    read_chunk,
    write_chunk,
)
from kvtier.tiers.fs.layout import ChunkFile, NamespaceDir, OddEntry, mode_kind, remove_entry
from kvtier.tiers.fs.shared_index import NETWORK_FILESYSTEMS, SharedIndex, filesystem_type
from kvtier.tiers.threaded import Priority, ThreadedTier, ThreadedTierOptions

logger = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class FilesystemTierOptions(ThreadedTierOptions):
    root_dir: Path
    """Directory holding the chunk files; created if missing. May be shared by
    several processes and hosts (one subdirectory per KV layout)."""

    max_bytes: ByteSize | None = Field(default=None, gt=0)
    """Upper bound on bytes of chunk and temp files under this layout's
    directory (e.g. ``500GiB``), held across every process of this host that
    uses it with a bound; least recently used chunks (loads count as use) are
    deleted to make room, whoever stored them. Unset: no bound, and stores
    fail cleanly when the disk is full. Processes sharing a root should give
    it the same value (the smallest one given is what holds)."""

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
    """Age after which a temp file (or a reservation of ``max_bytes``) of
    another host's unfinished write is deleted."""

    index_lock_timeout_s: float = Field(default=10.0, gt=0)
    """With ``max_bytes``: longest wait for the lock of the index shared with
    other processes. A process stopped or hung while holding it makes stores
    fail after this long (counted, the chunks stay where they are) instead of
    blocking I/O threads and ``close()``."""


class FilesystemTier(ThreadedTier[FilesystemTierOptions]):
    """Chunk files under ``root_dir/<namespace hex>/``; see docs/fs.md."""

    Options: ClassVar[type[TierOptions]] = FilesystemTierOptions
    #: Most chunks one I/O task moves (see :meth:`_split`).
    io_batch: ClassVar[int] = 8
    #: Chunk files have one size per namespace, or under a variable-size
    #: codec whole pages up to the largest; ``O_DIRECT`` needs whole pages.
    payload_align: ClassVar[int] = DIRECT_ALIGN
    #: A chunk file's size says how long its payload is (see :func:`read_chunk`).
    variable_payloads: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stopping = threading.Event()
        self._indexer: threading.Thread | None = None
        self._bound: SharedIndex | None = None
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _setup(self) -> None:
        options = self.options
        self.root_dir = options.root_dir.expanduser().absolute()
        self.dir = NamespaceDir(self.root_dir, self.namespace)
        try:
            stage = self.codec_stage
            codec: dict[str, object] | None = None
            if not stage.identity:
                codec = {"type": stage.name, "params": stage.codec.params()}
            self.dir.create(
                self.spec.layout,
                TRAILER_BLOCK,
                self.stored_bytes,
                codec,
                variable=not stage.fixed_size,
            )
            for path, kind in self.dir.repair_buckets():
                logger.warning("tier %s: replaced %s at bucket %s", self.tier_type, kind, path)
        except OSError as exc:
            raise OSError(
                exc.errno, f"{self.tier_type}: cannot use root_dir {self.root_dir}: {exc.strerror}"
            ) from exc
        #: Size of every chunk file, or of the largest under a variable-size codec.
        self.file_bytes = self.stored_bytes + TRAILER_BLOCK
        self.variable = not self.codec_stage.fixed_size
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
        self.vanished_chunks = 0
        self.scan_skipped = 0
        self._disk_full = False
        # Keys of chunk files known to exist; another process may have
        # deleted some since (a load then finds nothing: a plain miss).
        self._keys: set[bytes] = set()
        self._poll_queued = False
        if self.max_bytes is not None:
            fstype = filesystem_type(str(self.dir.path))
            if fstype in NETWORK_FILESYSTEMS:
                logger.warning(
                    "tier %s: %s is on %s: max_bytes holds only among processes of one "
                    "host; give each host its own root_dir (see docs/fs.md, Shared roots)",
                    self.tier_type,
                    self.root_dir,
                    fstype,
                )
            try:
                self._bound = SharedIndex(
                    str(self.dir.path),
                    self.max_bytes,
                    self.dir.chunk_path,
                    options.abandoned_temp_s,
                    scan=self._complete_chunk_files,
                    lock_timeout_s=options.index_lock_timeout_s,
                )
            except (sqlite3.Error, OSError) as exc:
                raise OSError(
                    f"{self.tier_type}: cannot open the index that holds max_bytes in "
                    f"{self.dir.path}: {describe_error(exc)}"
                ) from exc
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
        why_not = probe_direct_io(self.dir.probe_path("direct-io-probe"))
        if why_not is None and self.stored_bytes % DIRECT_ALIGN:
            why_not = f"stored_bytes={self.stored_bytes} is not a multiple of {DIRECT_ALIGN}"
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
            broken: list[str] = []
            strays: list[OddEntry] = []
            for entry in self.dir.survey():
                if self._stopping.is_set():
                    return
                if isinstance(entry, ChunkFile):
                    # A final name is only ever a complete file (rename), and the
                    # namespace fixes its size (or bounds it): any other is damage.
                    if self._sized_as_a_chunk(entry.size):
                        found.append(entry)
                        # Known from now on: a restarted engine's lookups stop
                        # checking the disk for it before the whole scan ends.
                        self._keys.add(entry.key)
                    else:
                        broken.append(entry.path)
                elif entry.key is not None:
                    broken.append(entry.path)  # a directory, FIFO... named like a chunk
                else:
                    strays.append(entry)
            self._drop_broken(broken)
            if strays:
                self.scan_skipped += len(strays)
                logger.warning(
                    "tier %s: skipped %d entries that are not chunk files (e.g. %s: %s)",
                    self.tier_type,
                    len(strays),
                    strays[0].path,
                    strays[0].kind,
                )
            if self._bound is not None:
                self._forget_evicted(self._bound.reconcile(found, self._stopping.is_set))
            logger.info(
                "tier %s: indexed %d chunks (%d bytes) under %s",
                self.tier_type,
                len(self._keys),
                self.held_bytes,
                self.dir.path,
            )
        except Exception:
            logger.exception("tier %s: re-index of %s failed", self.tier_type, self.dir.path)
        finally:
            self._index_ready.set()

    def _complete_chunk_files(self) -> Iterator[ChunkFile]:
        """Chunk files of the namespace's size (others are damage the
        re-index removes)."""
        return (chunk for chunk in self.dir.scan() if self._sized_as_a_chunk(chunk.size))

    def _sized_as_a_chunk(self, size: int) -> bool:
        """Whether a chunk file of ``size`` bytes may be one of this namespace."""
        if self.variable:
            return chunk_io.payload_size_fits(size, self.stored_bytes)
        return size == self.file_bytes

    def _complete(self, paths: Sequence[str]) -> list[bool]:
        """Which of ``paths`` hold a complete chunk file (:func:`complete_files`:
        one system-call run; under a variable-size codec, one ``lstat`` each)."""
        if not self.variable:
            return chunk_io.complete_files(paths, self.file_bytes)
        return chunk_io.sized_files(paths, self._sized_as_a_chunk)

    def _drop_broken(self, broken: Sequence[str]) -> None:
        # A lookup may find the same entry first: whoever removes it counts it.
        found = sum(_removed_or_kept(path) for path in broken)
        if found:
            logger.warning(
                "tier %s: removed %d damaged chunk files or entries at chunk paths",
                self.tier_type,
                found,
            )
            self.count(corrupt_chunks=found)

    def _forget_evicted(self, victims: Iterable[bytes]) -> None:
        """Chunks this process evicted through the shared index (which deleted
        their files)."""
        evicted = [ChunkKey(key) for key in victims]
        self._keys.difference_update(evicted)
        if evicted:
            self.count(evictions=len(evicted))
            self.report_removed(evicted)

    def _poll_evictions(self, bound: SharedIndex) -> None:
        """Drop keys other processes evicted from the local set, so that
        lookups stop answering HIT for them."""
        try:
            evicted = bound.evictions()
        finally:
            self._poll_queued = False
        if evicted is None:  # too far behind: rely on the filesystem instead
            self._keys.clear()
        else:
            # Those still held here: the index also lists this process's own
            # evictions, reported when they were made.
            held = [ChunkKey(key) for key in evicted if key in self._keys]
            self._keys.difference_update(evicted)
            self.report_removed(held)

    # ThreadedTier hooks (worker threads) ----------------------------------------

    def _known(self, key: ChunkKey) -> bool | None:
        if key in self._keys:
            return True
        if self.shared or not self._index_ready.is_set():
            return None  # ask the filesystem, off the caller's thread
        return False

    def _on_disk(self, key: ChunkKey) -> bool:
        """Whether a complete chunk file exists (stored by anyone). Answers
        for this key alone: an error examining it is a miss for it."""
        path = self.dir.chunk_path(key)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.debug("tier %s: cannot examine %s: %s", self.tier_type, path, exc)
            return False
        if not stat.S_ISREG(info.st_mode) or not self._sized_as_a_chunk(info.st_size):
            kind = "a regular file" if stat.S_ISREG(info.st_mode) else mode_kind(info.st_mode)
            logger.warning(
                "tier %s: discarding %s at chunk path %s (%d bytes)",
                self.tier_type,
                kind,
                path,
                info.st_size,
            )
            if self._discard(key):  # else the re-index got there first, and counted it
                self.count(corrupt_chunks=1)
            return False
        self._keys.add(key)
        return True

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # Every key the index does not know is looked at in one system-call
        # run (one GIL release); only those not found complete are examined
        # one by one, for what is there instead (damage is discarded).
        unknown = [key for key in keys if key not in self._keys]
        paths = [self.dir.chunk_path(key) for key in unknown]
        complete = dict(zip(unknown, self._complete(paths), strict=True))
        found = []
        for key in keys:
            present = complete.get(key, True) or self._on_disk(key)
            if present:
                self._keys.add(key)
            found.append(present)
        return found

    def _split(self, pending: list[tuple[ChunkKey, int]]) -> list[list[tuple[ChunkKey, int]]]:
        # While workers are idle a job goes one chunk per task, so that its
        # chunks move in parallel. Once the queue holds work for every
        # worker, more tasks add no parallelism: grouping chunks then pays
        # the queue, the wake-up and the job's lock once per group. Groups
        # take every n-th chunk, so that the job's chunks still start in
        # about their order (a prefix's first chunks first).
        idle = max(1, self.io_threads - self._backlog())
        size = min(self.io_batch, max(1, math.ceil(len(pending) / idle)))
        groups = math.ceil(len(pending) / size)
        return [pending[i::groups] for i in range(groups)]

    def _store_batch(self, keys: Sequence[ChunkKey], payloads: Sequence[memoryview]) -> list[bool]:
        # In a group, chunks already on disk (another process stored them,
        # or this one before a restart) are found first, all with one
        # system-call run: they are neither hashed nor written. A chunk
        # alone is left to the check write_chunk makes in the same GIL
        # release as its hash and write (neither happens if it is there): a
        # run of its own would give up and wait for the GIL once more.
        paths = [self.dir.chunk_path(key) for key in keys]
        on_disk = self._complete(paths) if len(paths) > 1 else [False]
        return [
            self._attempt(functools.partial(self._store_at, path, present), key, payload)
            for key, payload, path, present in zip(keys, payloads, paths, on_disk, strict=True)
        ]

    def _store_chunk(self, key: ChunkKey, payload: memoryview) -> None:
        self._store_at(self.dir.chunk_path(key), False, key, payload)

    def _store_at(self, path: str, on_disk: bool, key: ChunkKey, payload: memoryview) -> None:
        """Store ``key`` at ``path``, whose complete file was found there
        (``on_disk``) or not. One found missing may still appear meanwhile:
        :func:`write_chunk` looks again, with the same GIL release as the write."""
        temp = self.dir.temp_path(path)
        bound = self._bound
        if bound is not None:
            # The file's own size: under a variable-size codec the bound
            # counts what chunks take, not what the largest would.
            plan, victims = bound.reserve(key, len(payload) + TRAILER_BLOCK, temp)
            self._forget_evicted(victims)
            if plan == "present":  # there, or another live process is writing it
                self._keys.add(key)
                return
            if plan == "full":
                raise OSError(errno.ENOSPC, f"max_bytes={self.max_bytes} taken by writes in flight")
        try:
            written = not on_disk and write_chunk(
                path, temp, self.namespace, key, payload, direct=self.direct, fsync=self.fsync
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
                logger.warning("tier %s: index not updated: %s", self.tier_type, exc)
        self._keys.add(key)
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
            read_chunk(
                self.dir.chunk_path(key),
                out,
                self.namespace,
                key,
                direct=self.direct,
                variable=self.variable,
            )
        except FileNotFoundError as exc:
            # Evicted, most likely by another process: a miss, not damage.
            with self._stats_lock:
                self.vanished_chunks += 1
            self._keys.discard(key)
            if self._bound is not None:
                self._bound.forget(key)
            raise ChunkVanishedError(f"chunk file gone: {exc.filename}") from exc
        if self._bound is not None and self._bound.touch(key):
            try:
                self._bound.flush_if_free()
            except sqlite3.Error as exc:  # the chunk was loaded all the same
                logger.warning("tier %s: use stamps not written: %s", self.tier_type, exc)

    def _discard(self, key: ChunkKey) -> bool:
        # One removal for every path that finds damage (a load's verification,
        # a lookup, the re-index): only the one that removes the entry counts it.
        self._forget(key)
        return _removed_or_kept(self.dir.chunk_path(key))

    def _forget(self, key: ChunkKey) -> None:
        self._keys.discard(key)
        if self._bound is not None:
            self._bound.forget(key)

    def _close(self) -> None:
        self._stopping.set()
        if self._indexer is not None:
            self._indexer.join()
        if self._bound is not None:
            self._bound.close()

    # Optional hooks --------------------------------------------------------------

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        # Recorded in memory only (the caller's thread does no I/O); written
        # by the next store or load that finds the stamps due.
        if self._bound is not None:
            for key in keys:
                if key in self._keys:
                    self._bound.touch(key)

    def on_step_end(self) -> None:
        super().on_step_end()
        if self._bound is not None and self.shared and not self._poll_queued and not self.shut_down:
            self._poll_queued = True
            self._threaded_enqueue(
                Priority.CHECK, functools.partial(self._poll_evictions, self._bound)
            )

    @property
    def held_bytes(self) -> int:
        """Bytes of chunk files: of every process sharing the directory with
        ``max_bytes`` set, else those this process knows (at most: under a
        variable-size codec, counted at the largest file's size)."""
        if self._bound is not None:
            return self._bound.totals().nbytes
        return len(self._keys) * self.file_bytes

    @property
    def chunk_count(self) -> int:
        """Chunk files, counted as :attr:`held_bytes` counts their bytes."""
        if self._bound is not None:
            return self._bound.totals().chunks
        return len(self._keys)

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
                f"{self.chunk_count} chunks, {self.held_bytes} bytes {bound}"
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
            TierMetric("held_bytes", self.held_bytes, "Bytes of chunk files indexed."),
            TierMetric("chunks", self.chunk_count, "Chunk files indexed."),
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
            "held_bytes": self.held_bytes,
            "chunks": self.chunk_count,
            "shared_index": None if self._bound is None else self._bound.path,
            "index_ready": self.index_ready,
            "disk_full_errors": self.disk_full_errors,
            "vanished_chunks": self.vanished_chunks,
            "scan_skipped": self.scan_skipped,
        }


def _removed_or_kept(path: str) -> bool:
    """Remove a damaged entry; false only if it was gone already (removed,
    and counted, by another thread). One that must stay (a directory that is
    not empty) counts as found."""
    return remove_entry(path) or os.path.lexists(path)
