"""Chunk files: one header block, then the payload, moved with no extra copy.

A chunk file is ``HEADER_BLOCK`` bytes holding the shared integrity header
(:mod:`kvtier.integrity`) padded with zeros, then the slot's bytes. The pad
keeps the payload at a 4 KiB file offset, so with ``O_DIRECT`` the kernel
moves it by DMA straight between the device and the page-aligned primary
slot: a store is one ``writev`` of ``[header block, slot]``, a load one
``preadv`` into ``[header block, slot]``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time

from kvtier import integrity
from kvtier.errors import CorruptChunkError

#: Bytes before the payload in a chunk file: the integrity header, zero padded.
HEADER_BLOCK = 4096
#: Alignment ``O_DIRECT`` needs of buffers, lengths and offsets (covers 512 and 4K devices).
DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

_thread_buffers = threading.local()


def _header_buffer() -> mmap.mmap:
    """This thread's page-aligned header block (``mmap`` memory is page-aligned)."""
    buffer: mmap.mmap | None = getattr(_thread_buffers, "header", None)
    if buffer is None:
        buffer = mmap.mmap(-1, HEADER_BLOCK)
        _thread_buffers.header = buffer
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


def write_chunk(
    final_path: str,
    temp_path: str,
    namespace: bytes,
    key: bytes,
    payload: memoryview,
    *,
    direct: bool,
    fsync: bool,
) -> int:
    """Atomically create ``final_path`` holding ``payload``; returns the file size.

    Temp file in the same directory, full write, length check, optional
    fsync, rename. Readers see the old state or the whole new file, never a
    part; two writers of one chunk both rename a complete file, last one wins.
    A failure (``ENOSPC`` too) removes the temp file and raises ``OSError``.
    """
    header = _header_buffer()
    packed = integrity.pack_header(namespace, key, payload)
    header[: len(packed)] = packed
    size = HEADER_BLOCK + len(payload)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    try:
        fd = os.open(temp_path, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(temp_path), exist_ok=True)
        fd = os.open(temp_path, flags, 0o644)
    try:
        try:
            views = [memoryview(header), payload]
            while views:
                written = os.writev(fd, views)
                if written <= 0:
                    raise OSError(errno.ENOSPC, "write made no progress", temp_path)
                views = _advance(views, written)
            stored = os.fstat(fd).st_size
            if stored != size:
                raise OSError(errno.EIO, f"file holds {stored} bytes after writing {size}")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp_path, final_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise
    if fsync:
        _fsync_directory(os.path.dirname(final_path))
    return size


def read_chunk(path: str, out: memoryview, namespace: bytes, key: bytes, *, direct: bool) -> None:
    """Read a chunk file into ``out`` and verify it.

    The payload is read straight into ``out`` (a primary slot the running
    load owns) and verified there; a file that fails raises
    :class:`CorruptChunkError`, so the load reports the key failed and the
    slot's bytes are never used. A missing file raises ``FileNotFoundError``.
    """
    header = _header_buffer()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        views = [memoryview(header), out]
        total = HEADER_BLOCK + len(out)
        done = 0
        while done < total:
            got = os.preadv(fd, _advance(views, done), done)
            if got <= 0:
                break
            done += got
        _mark_used(fd)
    finally:
        os.close(fd)
    if done < total:
        raise CorruptChunkError(f"chunk file truncated: {done} of {total} bytes")
    parsed = integrity.unpack_header(
        memoryview(header)[: integrity.HEADER_BYTES],
        namespace=namespace,
        key=key,
        payload_bytes=len(out),
    )
    parsed.verify(out)


#: A read refreshes a chunk file's mtime (its use time after a restart) when it
#: is older than this: once a minute keeps inode writes out of a hot read path.
USE_STAMP_S = 60.0


def _mark_used(fd: int) -> None:
    with contextlib.suppress(OSError):
        if time.time() - os.fstat(fd).st_mtime > USE_STAMP_S:
            os.utime(fd)


def verify_file(path: str, namespace: bytes, key: bytes) -> int:
    """Check one chunk file completely (for ``kvtier inspect --verify``); returns
    its payload size. Raises :class:`CorruptChunkError` on any defect."""
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < HEADER_BLOCK:
        raise CorruptChunkError(f"chunk file truncated to {len(data)} bytes")
    payload = memoryview(data)[HEADER_BLOCK:]
    parsed = integrity.unpack_header(
        data[: integrity.HEADER_BYTES], namespace=namespace, key=key, payload_bytes=len(payload)
    )
    parsed.verify(payload)
    return len(payload)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
