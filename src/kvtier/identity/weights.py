"""An identity of a model's weight files that is cheap to compute and follows
their content: sizes, times, safetensors headers and sampled windows, or
every byte with ``full_read``.

See docs/vllm.md, 'What identifies a model's KV', for what is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path

import xxhash

#: Files up to this size are read whole (configs, tokenizer settings, code).
SMALL_FILE_BYTES = 64 * 1024
#: Windows sampled evenly over every larger file, and their size.
FILE_WINDOWS = 8
FILE_WINDOW_BYTES = 64 * 1024
#: Bytes sampled at the start, middle and end of every safetensors tensor.
TENSOR_WINDOW_BYTES = 256
#: The safetensors format caps its JSON header at 100 MB.
MAX_SAFETENSORS_HEADER = 100_000_000
#: Files read at once.
READ_THREADS = 8
#: Block size of full reads.
_READ_BLOCK = 8 * 1024 * 1024

logger = logging.getLogger(__name__)

_HUB_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_HUB_REVISION = re.compile(r"^[0-9a-f]{40}$")


Stat = tuple[int, int, int, int]


def _stat(path: str) -> Stat | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


@dataclass(frozen=True)
class FilesStamp:
    """The ``stat`` of files and of the directories holding them, to tell
    later whether any of them changed, without reading a byte.

    Writing a file changes its change time, which no tool sets back (unlike
    the modification time); replacing it by a rename changes its inode; adding,
    removing or renaming one changes its directory's times.
    """

    paths: tuple[str, ...]
    stats: tuple[Stat | None, ...]

    @classmethod
    def of(cls, paths: Iterable[str]) -> FilesStamp:
        paths = tuple(paths)
        return cls(paths, tuple(map(_stat, paths)))

    def changed(self) -> bool:
        """Whether a path is gone, or was written, replaced or had entries
        added or removed, since the stamp was taken."""
        return tuple(map(_stat, self.paths)) != self.stats


@dataclass(frozen=True)
class WeightsIdentity:
    """What :func:`weights_identity` found out about a model's files."""

    #: Hex digest over every file's record; equal digests, equal weights (see module doc).
    digest: str
    #: The commit of the Hugging Face cache snapshot the files came from, if they did.
    revision: str | None
    #: Files identified, and their total size in bytes.
    files: int
    total_bytes: int
    #: Bytes actually read to compute the identity.
    bytes_read: int
    full_read: bool
    #: The files and their directories as they were when identified (taken
    #: before reading them, so a change while reading shows too). Not part
    #: of the identity: equal digests are equal weights wherever they lie.
    stamp: FilesStamp = field(default=FilesStamp((), ()), compare=False, repr=False)

    @property
    def token(self) -> str:
        """The identity as one string, for a layout's namespace."""
        mode = "full" if self.full_read else "sampled"
        return f"files-{mode}:{self.digest}"


def weights_identity(path: str | os.PathLike[str], *, full_read: bool = False) -> WeightsIdentity:
    """Identify the weight files at ``path`` (a model directory or one weights file).

    Every regular file under a directory counts, except hidden ones (names
    starting with ``.``); symbolic links to files and directories are followed
    (as in a Hugging Face cache snapshot, or shards kept on another disk), each
    directory once, and files are named by their path under ``path``. Raises
    :class:`FileNotFoundError` when ``path`` does not exist and
    :class:`ValueError` when it holds no file.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"model weights not found: {root} does not exist")
    files = sorted(_model_files(root))
    if not files:
        raise ValueError(f"model weights not found: {root} holds no file to identify them by")
    folders = sorted({root, *(file.parent for _, file in files)}) if root.is_dir() else []
    stamp = FilesStamp.of(map(str, [*folders, *(file for _, file in files)]))
    revision = hub_revision(root)
    digest = hashlib.blake2b(digest_size=16, person=b"kvtier-weights")
    digest.update(f"revision={revision or ''}\0full={full_read}\0".encode())
    total = read = 0
    # Files are read in parallel: on a cold cache every window is a random
    # read of the device, and devices serve many at once.
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(files))) as pool:
        names, paths = zip(*files, strict=True)
        records = pool.map(_file_record, names, paths, repeat(full_read))
        for record, size, nread in records:
            digest.update(record)
            total += size
            read += nread
    return WeightsIdentity(
        digest=digest.hexdigest(),
        revision=revision,
        files=len(files),
        total_bytes=total,
        bytes_read=read,
        full_read=full_read,
        stamp=stamp,
    )


def hub_revision(path: str | os.PathLike[str]) -> str | None:
    """The commit of the Hugging Face cache snapshot holding ``path``, if it is in one.

    A snapshot lives at ``<cache>/models--<org>--<name>/snapshots/<commit>/``.
    """
    for part in (Path(path), *Path(path).parents):
        parent = part.parent
        if (
            parent.name == "snapshots"
            and parent.parent.name.startswith("models--")
            and _HUB_REVISION.match(part.name)
        ):
            return part.name
    return None


def _model_files(root: Path) -> Iterator[tuple[str, Path]]:
    """``(name relative to root, path)`` of every non-hidden regular file."""
    if root.is_file():
        yield root.name, root
        return
    seen: set[str] = set()
    # Linked directories hold weights too (shards on another disk); each real
    # directory is walked once, so a link cycle ends.
    for directory, subdirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        # Sorted: which of two links to one directory names its files is fixed.
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in names:
            file = Path(directory, name)
            if not name.startswith(".") and file.is_file():
                yield file.relative_to(root).as_posix(), file


def _file_record(name: str, file: Path, full_read: bool) -> tuple[bytes, int, int]:
    """``(record bytes, file size, bytes read)`` for one file."""
    try:
        return _content_record(name, file, full_read)
    except PermissionError:
        # The engine, running as this user, cannot read it either: its bytes
        # cannot reach the KV. Its size and time still count, so the identity
        # changes when it does, or when it becomes readable.
        logger.warning("kvtier: %s is not readable; identified by its size and time", file)
        stat = os.stat(file)
        record = f"{name}\0size={stat.st_size}\0unreadable\0mtime_ns={stat.st_mtime_ns}\n"
        return record.encode(), stat.st_size, 0


def _content_record(name: str, file: Path, full_read: bool) -> tuple[bytes, int, int]:
    with open(file, "rb") as handle:
        stat = os.fstat(handle.fileno())
        size = stat.st_size
        content = xxhash.xxh3_128()
        if full_read or size <= SMALL_FILE_BYTES:
            read = 0
            while block := handle.read(_READ_BLOCK):
                content.update(block)
                read += len(block)
            how = "whole"
        else:
            read = _sample(handle.fileno(), size, name.endswith(".safetensors"), content)
            # A blob of a Hugging Face cache is named by a hash of its content,
            # so its times need not match: downloads on two machines share KV.
            blob = Path(os.path.realpath(file)).name
            in_cache = Path(os.path.realpath(file)).parent.name == "blobs"
            how = (
                f"blob={blob}"
                if in_cache and _HUB_BLOB_NAME.match(blob)
                else (f"mtime_ns={stat.st_mtime_ns}")
            )
    record = f"{name}\0size={size}\0{how}\0{content.hexdigest()}\n"
    return record.encode(), size, read


def _sample(fd: int, size: int, safetensors: bool, content: xxhash.xxh3_128) -> int:
    """Hash the sampled windows of one file into ``content``; returns bytes read."""
    windows = _file_windows(size)
    if safetensors:
        windows += _safetensors_windows(fd, size)
    read = 0
    for offset, length in _merged(windows):
        data = os.pread(fd, length, offset)
        content.update(struct.pack("<QQ", offset, len(data)))
        content.update(data)
        read += len(data)
    return read


def _merged(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The windows as disjoint ``(offset, length)`` ranges, in file order."""
    ranges: list[tuple[int, int]] = []
    for offset, length in sorted(windows):
        if ranges and offset <= ranges[-1][0] + ranges[-1][1]:
            start, last_length = ranges[-1]
            ranges[-1] = (start, max(last_length, offset + length - start))
        else:
            ranges.append((offset, length))
    return ranges


def _file_windows(size: int) -> list[tuple[int, int]]:
    length = min(FILE_WINDOW_BYTES, size)
    last = size - length
    return [(index * last // (FILE_WINDOWS - 1), length) for index in range(FILE_WINDOWS)]


def _safetensors_windows(fd: int, size: int) -> list[tuple[int, int]]:
    """The header, and start, middle and end of every tensor's data.

    A file whose header does not parse gets its eight file windows only (the
    engine will refuse to load it anyway).
    """
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        return []
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > min(MAX_SAFETENSORS_HEADER, size - 8):
        return []
    windows = [(0, 8 + header_bytes)]
    try:
        header = json.loads(os.pread(fd, header_bytes, 8))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return windows  # RecursionError: a header of deeply nested arrays
    if not isinstance(header, dict):
        return windows
    data_start = 8 + header_bytes
    for name in sorted(header):
        offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            continue
        if not all(isinstance(offset, int) for offset in offsets):
            continue
        begin, end = data_start + offsets[0], data_start + offsets[1]
        length = end - begin
        if begin < data_start or length <= 0 or end > size:
            continue
        if length <= 3 * TENSOR_WINDOW_BYTES:
            windows.append((begin, length))
            continue
        middle = begin + (length - TENSOR_WINDOW_BYTES) // 2
        for offset in (begin, middle, end - TENSOR_WINDOW_BYTES):
            windows.append((offset, TENSOR_WINDOW_BYTES))
    return windows
