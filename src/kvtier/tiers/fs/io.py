"""Chunk files: the payload, then one trailer block, moved with no extra copy.

A chunk file is the slot's bytes followed by ``TRAILER_BLOCK`` bytes holding
the shared integrity header (:mod:`kvtier.integrity`) padded with zeros. With
``O_DIRECT`` the kernel moves the payload by DMA straight between the device
and the page-aligned primary slot: a store is one ``writev`` of
``[slot, trailer block]``, a load one ``preadv`` into ``[slot, trailer block]``.

The integrity block goes last so the payload starts at file offset 0, aligned
on the disk as the slot is in memory: measured against the same block in
front, stores are about 1.2x and loads 1.1x faster on a virtio disk.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable

from kvtier import integrity
from kvtier.errors import CorruptChunkError

#: Bytes after the payload in a chunk file: the integrity header, zero padded.
TRAILER_BLOCK = 4096
#: Alignment ``O_DIRECT`` needs of buffers, lengths and offsets (covers 512 and 4K devices).
DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

_thread_buffers = threading.local()


def _trailer_buffer() -> mmap.mmap:
    """This thread's page-aligned trailer block (``mmap`` memory is page-aligned)."""
    buffer: mmap.mmap | None = getattr(_thread_buffers, "trailer", None)
    if buffer is None:
        buffer = mmap.mmap(-1, TRAILER_BLOCK)
        _thread_buffers.trailer = buffer
    return buffer


def probe_direct_io(directory: str) -> str | None:
    """``None`` if ``O_DIRECT`` writes and reads work in ``directory``, else why not."""
    if not O_DIRECT:
        return "O_DIRECT is not available on this platform"
    path = os.path.join(directory, f".direct-io-probe.{os.getpid()}.{threading.get_ident()}")
    block = mmap.mmap(-1, DIRECT_ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | O_DIRECT, 0o644)
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    finally:
        block.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The part of ``views`` after the first ``done`` bytes."""
    rest = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        rest.append(view[done:])
        done = 0
    return rest


#: A read refreshes a chunk file's mtime (its use time after a restart) when it
#: is older than this: once a minute keeps inode writes out of a hot read path.
USE_STAMP_S = 60.0


def _store_file_python(
    temp_path: str,
    final_path: str,
    payload: memoryview,
    trailer: memoryview,
    direct: bool,
    fsync: bool,
) -> bool:
    """Create ``temp_path`` exclusively, write ``payload`` then ``trailer``
    completely, optionally fsync, and rename it to ``final_path``; on any
    failure remove the temp file and raise ``OSError``. Writes nothing and
    returns false when ``final_path`` already is a file of that size (a key
    names its bytes, so another writer stored the same chunk)."""
    with contextlib.suppress(OSError):
        info = os.stat(final_path)
        if stat.S_ISREG(info.st_mode) and info.st_size == len(payload) + len(trailer):
            return False
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd = os.open(temp_path, flags, 0o644)
    try:
        try:
            views = [payload, trailer]
            done = 0
            while views:
                written = os.pwritev(fd, views, done)
                if written <= 0:
                    raise OSError(errno.ENOSPC, "write made no progress", temp_path)
                done += written
                views = _advance(views, written)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp_path, final_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise
    return True


def _load_file_python(
    path: str, out: memoryview, trailer: memoryview, direct: bool, stamp_after_s: float
) -> int:
    """Read ``path`` into ``out`` then ``trailer``; the bytes read (fewer than
    both hold if the file is short). Refreshes the file's mtime if older than
    ``stamp_after_s``. A missing file raises ``FileNotFoundError``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        views = [out, trailer]
        total = len(out) + len(trailer)
        done = 0
        while done < total:
            got = os.preadv(fd, _advance(views, done), done)
            if got <= 0:
                break
            done += got
        with contextlib.suppress(OSError):
            if time.time() - os.fstat(fd).st_mtime > stamp_after_s:
                os.utime(fd)
        return done
    finally:
        os.close(fd)


_StoreFile = Callable[[str, str, memoryview, memoryview, bool, bool], bool]
_LoadFile = Callable[[str, memoryview, memoryview, bool, float], int]

#: Implementations of the two functions above, by name.
IMPLEMENTATIONS: dict[str, tuple[_StoreFile, _LoadFile]] = {
    "python": (_store_file_python, _load_file_python)
}
try:
    # The same two functions compiled (_chunkio.c): each runs its whole
    # sequence of system calls with the GIL released, so I/O threads do not
    # queue for the GIL between calls. Built at install where a C compiler is.
    import kvtier.tiers.fs._chunkio as _chunkio
except ImportError:  # pragma: no cover - depends on the install
    IMPLEMENTATION = "python"
else:
    IMPLEMENTATIONS["compiled"] = (_chunkio.store, _chunkio.load)
    IMPLEMENTATION = "compiled"
#: What :func:`write_chunk` and :func:`read_chunk` call (tests swap them).
_store_file, _load_file = IMPLEMENTATIONS[IMPLEMENTATION]


def write_chunk(
    final_path: str,
    temp_path: str,
    namespace: bytes,
    key: bytes,
    payload: memoryview,
    *,
    direct: bool,
    fsync: bool,
) -> bool:
    """Atomically create ``final_path`` holding ``payload``; false if a
    complete file of it was there already, so nothing was written.

    Temp file in the same directory, full write (every byte counted), optional
    fsync, rename. Readers see the old state or the whole new file, never a
    part; two writers of one chunk both rename a complete file, last one wins.
    A failure (``ENOSPC`` too) removes the temp file and raises ``OSError``.
    """
    trailer = _trailer_buffer()
    packed = integrity.pack_header(namespace, key, payload)
    trailer[: len(packed)] = packed
    try:
        written = _store_file(temp_path, final_path, payload, memoryview(trailer), direct, fsync)
    except FileNotFoundError:  # its bucket was removed
        os.makedirs(os.path.dirname(temp_path), exist_ok=True)
        written = _store_file(temp_path, final_path, payload, memoryview(trailer), direct, fsync)
    if written and fsync:
        _fsync_directory(os.path.dirname(final_path))
    return written


def read_chunk(path: str, out: memoryview, namespace: bytes, key: bytes, *, direct: bool) -> None:
    """Read a chunk file into ``out`` and verify it.

    The payload is read straight into ``out`` (a primary slot the running
    load owns) and verified there; a file that fails raises
    :class:`CorruptChunkError`, so the load reports the key failed and the
    slot's bytes are never used. A missing file raises ``FileNotFoundError``.
    """
    trailer = _trailer_buffer()
    done = _load_file(path, out, memoryview(trailer), direct, USE_STAMP_S)
    total = len(out) + TRAILER_BLOCK
    if done < total:
        raise CorruptChunkError(f"chunk file truncated: {done} of {total} bytes")
    parsed = integrity.unpack_header(
        memoryview(trailer)[: integrity.HEADER_BYTES],
        namespace=namespace,
        key=key,
        payload_bytes=len(out),
    )
    parsed.verify(out)


def verify_file(path: str, namespace: bytes, key: bytes) -> int:
    """Check one chunk file completely (for ``kvtier inspect --verify``); returns
    its payload size. Raises :class:`CorruptChunkError` on any defect."""
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < TRAILER_BLOCK:
        raise CorruptChunkError(f"chunk file truncated to {len(data)} bytes")
    payload = memoryview(data)[: len(data) - TRAILER_BLOCK]
    trailer = memoryview(data)[len(data) - TRAILER_BLOCK :]
    parsed = integrity.unpack_header(
        trailer[: integrity.HEADER_BYTES], namespace=namespace, key=key, payload_bytes=len(payload)
    )
    parsed.verify(payload)
    return len(payload)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
