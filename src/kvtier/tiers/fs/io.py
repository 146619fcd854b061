"""Chunk files: the payload, then one trailer block holding the integrity
header, moved with no extra copy (one ``writev`` / ``preadv`` each, by DMA
with ``O_DIRECT``) and checksummed in the same call.

See docs/fs.md, 'On disk'.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier import integrity
from kvtier.errors import CorruptChunkError
from kvtier.tiers.fs.layout import mode_kind

#: Bytes after the payload in a chunk file: the integrity header, zero padded.
TRAILER_BLOCK = 4096
#: The errno both implementations raise for a chunk path that holds something
#: other than a regular file (FIFO, directory, device); a symlink fails its
#: ``O_NOFOLLOW`` open with ``ELOOP``. Chosen because no open or read of a
#: chunk file gives it otherwise.
NOT_REGULAR_ERRNO: int = getattr(errno, "EFTYPE", None) or errno.EMEDIUMTYPE
#: Flags of every open of an existing chunk file: a symlink is never followed
#: and a FIFO can never block the open.
_OPEN_EXISTING = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
#: Alignment ``O_DIRECT`` needs of buffers, lengths and offsets (covers 512 and 4K devices).
DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

_thread_buffers = threading.local()


def _trailer_blocks(count: int) -> list[memoryview]:
    """``count`` of this thread's page-aligned trailer blocks (``mmap`` memory
    is page-aligned), kept for the thread's life: a write uses the first, a
    read of ``count`` files one each."""
    blocks: list[memoryview] = getattr(_thread_buffers, "blocks", [])
    if len(blocks) < count:
        memory = mmap.mmap(-1, count * TRAILER_BLOCK)
        blocks = [
            memoryview(memory)[i * TRAILER_BLOCK : (i + 1) * TRAILER_BLOCK] for i in range(count)
        ]
        _thread_buffers.blocks = blocks
    return blocks[:count]


def probe_direct_io(path: str) -> str | None:
    """``None`` if ``O_DIRECT`` writes and reads work for a new file at ``path``
    (removed again), else why not. Name ``path`` as a temp file, so that the
    probe of a process killed meanwhile is cleaned like one."""
    if not O_DIRECT:
        return "O_DIRECT is not available on this platform"
    block = mmap.mmap(-1, DIRECT_ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | O_DIRECT, 0o644)
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


_DIGEST = slice(integrity.DIGEST_OFFSET, integrity.DIGEST_OFFSET + integrity.DIGEST_BYTES)


def _store_file_python(
    temp_path: str,
    final_path: str,
    payload: memoryview,
    trailer: memoryview,
    direct: bool,
    fsync: bool,
) -> bool:
    """Create ``temp_path`` exclusively, put the checksum of ``payload`` into
    the packed header at the start of ``trailer``, write ``payload`` then
    ``trailer`` completely, optionally fsync, and rename it to ``final_path``;
    on any failure remove the temp file and raise ``OSError``. Neither hashes
    nor writes and returns false when ``final_path`` already is a file of
    that size (a key names its bytes, so another writer stored the same chunk)."""
    if _complete_files_python([final_path], len(payload) + len(trailer))[0]:
        return False
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd = os.open(temp_path, flags, 0o644)
    try:
        try:
            trailer[_DIGEST] = integrity.checksum(payload)
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
) -> tuple[int, bytes | None]:
    """Read ``path`` into ``out`` then ``trailer``; the bytes read (fewer than
    both hold if the file shrank meanwhile) and, once both are full, the
    checksum of ``out`` (else ``None``). A file whose size is not exactly
    what both hold is not read: its size comes back instead, with ``None``.
    Refreshes the file's mtime if older than ``stamp_after_s``. A missing
    file raises ``FileNotFoundError``; anything but a regular file raises
    ``OSError`` (``ELOOP`` for a symlink, :data:`NOT_REGULAR_ERRNO`
    otherwise) before a byte is read."""
    fd = os.open(path, _OPEN_EXISTING | (O_DIRECT if direct else 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(NOT_REGULAR_ERRNO, os.strerror(NOT_REGULAR_ERRNO), path)
        views = [out, trailer]
        total = len(out) + len(trailer)
        if info.st_size != total:  # a chunk file has one size: damage, not read
            return info.st_size, None
        done = 0
        while done < total:
            got = os.preadv(fd, _advance(views, done), done)
            if got <= 0:
                break
            done += got
        with contextlib.suppress(OSError):
            if time.time() - info.st_mtime > stamp_after_s:
                os.utime(fd)
    finally:
        os.close(fd)
    return done, integrity.checksum(out) if done == total else None


#: What reading one file gave: ``_load_file``'s ``(bytes read, digest)``,
#: or the ``OSError`` it raised.
Loaded = tuple[int, bytes | None] | OSError


def _load_files_python(
    paths: Sequence[str],
    outs: Sequence[memoryview],
    trailers: Sequence[memoryview],
    direct: bool,
    stamp_after_s: float,
) -> list[Loaded]:
    """:func:`_load_file_python` of each file in turn."""
    loaded: list[Loaded] = []
    for path, out, trailer in zip(paths, outs, trailers, strict=True):
        try:
            loaded.append(_load_file_python(path, out, trailer, direct, stamp_after_s))
        except OSError as exc:
            loaded.append(exc)
    return loaded


def _complete_files_python(paths: Sequence[str], size: int) -> list[bool]:
    """Which of ``paths`` are regular files of exactly ``size`` bytes."""
    return sized_files(paths, size.__eq__)


def sized_files(paths: Sequence[str], sized: Callable[[int], bool]) -> list[bool]:
    """Which of ``paths`` are regular files whose size passes ``sized`` (a
    symlink is not one, whatever it points at), one ``lstat`` each."""
    found = []
    for path in paths:
        try:
            info = os.lstat(path)
        except OSError:
            found.append(False)
            continue
        found.append(stat.S_ISREG(info.st_mode) and sized(info.st_size))
    return found


class ChunkIO(NamedTuple):
    """One implementation of the chunk-file system calls."""

    store: Callable[[str, str, memoryview, memoryview, bool, bool], bool]
    load: Callable[[str, memoryview, memoryview, bool, float], tuple[int, bytes | None]]
    complete: Callable[[Sequence[str], int], list[bool]]
    load_all: Callable[
        [Sequence[str], Sequence[memoryview], Sequence[memoryview], bool, float], list[Loaded]
    ]


#: Implementations of the four functions above, by name.
IMPLEMENTATIONS: dict[str, ChunkIO] = {
    "python": ChunkIO(
        _store_file_python, _load_file_python, _complete_files_python, _load_files_python
    )
}


def _compiled_io(chunkio: ModuleType, hashing: bool) -> ChunkIO:
    """The compiled functions, hashing in their own GIL release (``hashing``,
    see :func:`_bind_checksum`), else with the checksum taken in Python
    around them."""
    digest_offset = integrity.DIGEST_OFFSET if hashing else -1

    def store(
        temp: str, final: str, payload: memoryview, trailer: memoryview, direct: bool, fsync: bool
    ) -> bool:
        if not hashing:  # hashed even when the file turns out to be there already
            trailer[_DIGEST] = integrity.checksum(payload)
        written: bool = chunkio.store(temp, final, payload, trailer, direct, fsync, digest_offset)
        return written

    def load(
        path: str, out: memoryview, trailer: memoryview, direct: bool, stamp_after_s: float
    ) -> tuple[int, bytes | None]:
        digest = bytearray(integrity.DIGEST_BYTES) if hashing else None
        done: int = chunkio.load(path, out, trailer, direct, stamp_after_s, digest)
        return loaded(done, out, trailer, digest)

    def load_all(
        paths: Sequence[str],
        outs: Sequence[memoryview],
        trailers: Sequence[memoryview],
        direct: bool,
        stamp_after_s: float,
    ) -> list[Loaded]:
        digests = [bytearray(integrity.DIGEST_BYTES) for _ in paths] if hashing else None
        results = chunkio.load_all(paths, outs, trailers, direct, stamp_after_s, digests)
        into: Sequence[bytearray | None] = digests or [None] * len(results)
        return [
            done if isinstance(done, OSError) else loaded(done, out, trailer, digest)
            for done, out, trailer, digest in zip(results, outs, trailers, into, strict=True)
        ]

    def loaded(
        done: int, out: memoryview, trailer: memoryview, digest: bytearray | None
    ) -> tuple[int, bytes | None]:
        if done != len(out) + len(trailer):
            return done, None
        return done, bytes(digest) if digest is not None else integrity.checksum(out)

    return ChunkIO(store, load, chunkio.complete, load_all)


def _bind_checksum(chunkio: ModuleType) -> bool:
    """Point the compiled code at python-xxhash's own XXH3 function (the one
    ``integrity.checksum`` calls) and check it gives the same digests."""
    try:
        import xxhash._xxhash as xxhash_module

        if not chunkio.bind_xxh3(xxhash_module.__file__):
            return False
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    samples = (b"", b"kvtier", bytes(range(256)) * 1031)
    return all(chunkio.checksum(s) == integrity.checksum(s) for s in samples)


#: Whether the compiled functions take the checksum in their own GIL release.
COMPILED_CHECKSUM = False
try:
    # The same functions compiled (_chunkio.c): each runs its whole sequence
    # of system calls, and the checksum, with the GIL released, so I/O
    # threads do not queue for the GIL between calls. Built at install where
    # a C compiler is.
    from kvtier.tiers.fs._native import _chunkio
except ImportError:  # pragma: no cover - depends on the install
    IMPLEMENTATION = "python"
else:
    COMPILED_CHECKSUM = _bind_checksum(_chunkio)
    IMPLEMENTATIONS["compiled"] = _compiled_io(_chunkio, COMPILED_CHECKSUM)
    IMPLEMENTATION = "compiled"
#: What :func:`write_chunk`, :func:`read_chunk`, :func:`complete_files` and
#: :func:`read_chunks` call (tests swap them).
_store_file, _load_file, _complete_files, _load_files = IMPLEMENTATIONS[IMPLEMENTATION]


def complete_files(paths: Sequence[str], file_bytes: int) -> list[bool]:
    """Which of ``paths`` already hold a complete chunk file (a regular file
    of ``file_bytes``), all looked at with one GIL release: a store skips
    those before it hashes their payload."""
    return _complete_files(paths, file_bytes)


_NO_DIGEST_YET = bytes(integrity.DIGEST_BYTES)


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
    [trailer] = _trailer_blocks(1)
    # The store call fills the checksum in, unless the chunk is there already.
    packed = integrity.pack_header(namespace, key, payload, _NO_DIGEST_YET)
    trailer[: len(packed)] = packed
    try:
        written = _store_file(temp_path, final_path, payload, trailer, direct, fsync)
    except FileNotFoundError:
        # Only when its bucket was removed: a temp file removed under the
        # write (evicted as abandoned) must fail it, not start it again.
        directory = os.path.dirname(temp_path)
        if os.path.isdir(directory):
            raise
        os.makedirs(directory, exist_ok=True)
        written = _store_file(temp_path, final_path, payload, trailer, direct, fsync)
    if written and fsync:
        _fsync_directory(os.path.dirname(final_path))
    return written


def payload_size_fits(file_bytes: int, largest: int) -> bool:
    """Whether a chunk file of ``file_bytes`` may hold a payload of a
    variable-size codec whose payloads are at most ``largest`` bytes: whole
    pages (as every payload of such a codec is padded), a trailer after them."""
    payload = file_bytes - TRAILER_BLOCK
    return 0 < payload <= largest and payload % DIRECT_ALIGN == 0


def _variable_payload_bytes(path: str, largest: int) -> int:
    """The payload length of the chunk file at ``path``, from its size."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _not_a_file(mode_kind(info.st_mode))
    if not payload_size_fits(info.st_size, largest):
        raise CorruptChunkError(f"chunk file of {info.st_size} bytes holds no chunk of this tier")
    return info.st_size - TRAILER_BLOCK


def read_chunk(
    path: str,
    out: memoryview,
    namespace: bytes,
    key: bytes,
    *,
    direct: bool,
    variable: bool = False,
) -> None:
    """Read a chunk file into ``out`` and verify it.

    The payload is read straight into ``out`` (a primary slot the running
    load owns) and verified there. A file that fails, or anything at
    ``path`` that is not a regular file (never read), raises
    :class:`CorruptChunkError`; a missing file ``FileNotFoundError``.

    ``variable``: the payload is a variable-size codec's, at most ``out``
    long: the file's size less the trailer, which must be the length the
    header records over a payload whose checksum matches. It goes to the
    start of ``out``, and the rest of ``out`` is zeroed so that a decoder
    finds only this chunk's verified bytes there.
    """
    if variable:
        whole = out
        out = whole[: _variable_payload_bytes(path, len(whole))]
    [trailer] = _trailer_blocks(1)
    try:
        got: Loaded = _load_file(path, out, trailer, direct, USE_STAMP_S)
    except OSError as exc:
        got = exc
    _verify(path, got, out, trailer, namespace, key)
    if variable:
        np.frombuffer(whole, np.uint8)[len(out) :] = 0


def read_chunks(
    paths: Sequence[str],
    outs: Sequence[memoryview],
    namespace: bytes,
    keys: Sequence[bytes],
    *,
    direct: bool,
) -> list[Exception | None]:
    """:func:`read_chunk` of each chunk of a fixed size, the files read in one
    call: the compiled one gives up the GIL once for all of them, where a
    call per file would wait for it to come back after each, beside a thread
    running Python. Per chunk, ``None`` or the exception :func:`read_chunk`
    would raise."""
    trailers = _trailer_blocks(len(paths))
    errors: list[Exception | None] = []
    loaded = _load_files(paths, outs, trailers, direct, USE_STAMP_S)
    for path, got, out, trailer, key in zip(paths, loaded, outs, trailers, keys, strict=True):
        try:
            _verify(path, got, out, trailer, namespace, key)
            errors.append(None)
        except Exception as exc:
            errors.append(exc)
    return errors


def _verify(
    path: str, got: Loaded, out: memoryview, trailer: memoryview, namespace: bytes, key: bytes
) -> None:
    """Raise what reading ``path`` into ``out`` and ``trailer`` found wrong, if anything."""
    if isinstance(got, OSError):
        # Look only on the error path: the hot path pays no extra lstat.
        _raise_if_not_a_file(path, got)
        raise got
    done, digest = got
    total = len(out) + TRAILER_BLOCK
    if done < total:
        raise CorruptChunkError(f"chunk file truncated: {done} of {total} bytes")
    if done > total:  # a valid chunk with bytes appended is damage too
        raise CorruptChunkError(f"chunk file is {done} bytes, a chunk is {total}")
    parsed = integrity.unpack_header(
        trailer[: integrity.HEADER_BYTES],
        namespace=namespace,
        key=key,
        payload_bytes=len(out),
    )
    parsed.check_digest(digest)


#: Bytes :func:`verify_file` reads at a time.
_VERIFY_PIECE = 8 << 20


def verify_file(
    path: str,
    namespace: bytes,
    key: bytes,
    file_bytes: int | None = None,
    *,
    variable: bool = False,
) -> int:
    """Check one chunk file completely (for ``kvtier inspect --verify``); returns
    its payload size. Raises :class:`CorruptChunkError` on any defect.

    Reads boundedly: nothing but a regular file is opened for reading, a file
    whose size is not ``file_bytes`` (the size the namespace declares, where
    known; with ``variable``, the largest it may be) is rejected unread, and
    the payload is read only as far as its trailer declares, in pieces, so
    memory stays small whatever the file.
    """
    try:
        fd = os.open(path, _OPEN_EXISTING)
    except OSError as exc:
        _raise_if_not_a_file(path, exc)
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_a_file(mode_kind(info.st_mode))
        size = info.st_size
        if file_bytes is not None and variable:
            if not payload_size_fits(size, file_bytes - TRAILER_BLOCK):
                raise CorruptChunkError(
                    f"chunk file is {size} bytes, not whole pages up to {file_bytes}"
                )
        elif file_bytes is not None and size != file_bytes:
            raise CorruptChunkError(f"chunk file is {size} bytes, a chunk is {file_bytes}")
        if size < TRAILER_BLOCK:
            raise CorruptChunkError(f"chunk file truncated to {size} bytes")
        payload_bytes = size - TRAILER_BLOCK
        trailer = os.pread(fd, integrity.HEADER_BYTES, payload_bytes)
        parsed = integrity.unpack_header(
            trailer, namespace=namespace, key=key, payload_bytes=payload_bytes
        )
        # integrity.checksum() over the payload, computed piecewise.
        hasher = xxhash.xxh3_128()
        offset = 0
        while offset < payload_bytes:
            piece = os.pread(fd, min(_VERIFY_PIECE, payload_bytes - offset), offset)
            if not piece:
                raise CorruptChunkError(f"chunk file shrank to {offset} bytes while read")
            hasher.update(piece)
            offset += len(piece)
        if hasher.digest() != parsed.digest:
            raise CorruptChunkError("chunk checksum mismatch")
        return payload_bytes
    finally:
        os.close(fd)


def _not_a_file(kind: str) -> CorruptChunkError:
    return CorruptChunkError(f"{kind} at a chunk path, not a regular file")


def _raise_if_not_a_file(path: str, error: OSError) -> None:
    """Turn a failed open or read of ``path`` into :class:`CorruptChunkError`
    when what is there is not a regular file."""
    if isinstance(error, FileNotFoundError):
        return
    kind = odd_entry_kind(path)
    if kind is not None:
        raise _not_a_file(kind) from error


def odd_entry_kind(path: str) -> str | None:
    """What is at ``path`` if it exists and is not a regular file, else ``None``."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else mode_kind(mode)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
