"""Where the ``fs`` tier keeps things under ``root_dir``: one directory per
namespace, chunk files in 256 buckets by the key's first byte.

See docs/fs.md, 'On disk'.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.keys import ChunkKey
from kvtier.layout import KEY_BYTES, KVLayout

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kvc"
NAMESPACE_FILE = "NAMESPACE.json"
_CHUNK_NAME = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}{re.escape(CHUNK_SUFFIX)}$")
_TMP_NAME = re.compile(
    r"^\.(?P<what>[0-9A-Za-z_-]+)\.(?P<host>[^.]*)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$"
)
_NAMESPACE_DIR = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")
#: Most bytes of ``NAMESPACE.json`` read (the tier writes about 1 KiB).
RECORD_LIMIT = 1 << 20
#: This host's name as it appears in temp file names and write reservations.
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]


def _chunk_key(name: str) -> ChunkKey | None:
    """The key a chunk file's name holds; ``None`` for any other name."""
    if _CHUNK_NAME.match(name) is None:
        return None
    return ChunkKey(bytes.fromhex(name[: -len(CHUNK_SUFFIX)]))


@dataclass(frozen=True)
class ChunkFile:
    """A chunk file found on disk."""

    key: ChunkKey
    path: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class OddEntry:
    """Something in a namespace directory that is neither a chunk file nor a
    temp file: ``key`` is set when it sits at a chunk's path (a directory,
    FIFO, symlink or device named ``<key>.kvc``: a corrupt chunk)."""

    path: str
    kind: str
    key: ChunkKey | None


@dataclass(frozen=True)
class TempFile:
    """A file of a write in progress, or of one that will never finish."""

    path: str
    size: int
    abandoned: bool


class NamespaceDir:
    """The directory of one namespace: chunk paths, temp paths, scans."""

    def __init__(self, root_dir: Path, namespace: bytes) -> None:
        self.root_dir = root_dir
        self.namespace = namespace
        self.path = root_dir / namespace.hex()
        self._base = str(self.path)

    def chunk_path(self, key: bytes) -> str:
        """``<ns>/ab/<key hex>.kvc``, ``ab`` the key's first byte."""
        name = key.hex()
        return f"{self._base}/{name[:2]}/{name}{CHUNK_SUFFIX}"

    @staticmethod
    def temp_path(final_path: str) -> str:
        """A unique sibling of ``final_path`` for a write in progress (same directory,
        so the closing rename is atomic). Host and pid let a later scan tell an
        abandoned write from a live one."""
        directory, name = os.path.split(final_path)
        return _temp_name(directory, name[: -len(CHUNK_SUFFIX)])

    def probe_path(self, what: str) -> str:
        """A temp path in the namespace directory for a start-up file or probe
        (``what``: letters, digits, ``-``), so that one a killed process left
        is found and removed like the temp file of a chunk write."""
        return _temp_name(self._base, what)

    def create(
        self,
        layout: KVLayout,
        trailer_bytes: int,
        payload_bytes: int | None = None,
        codec: dict[str, object] | None = None,
        *,
        variable: bool = False,
    ) -> None:
        """Make the namespace directory, its 256 buckets and ``NAMESPACE.json``,
        unless that file says an earlier start did (it is written last,
        atomically; concurrent creators agree). A restart costs one ``stat``.

        ``variable``: chunk files hold payloads of varying size (a codec such
        as ``lossless``), ``payload_bytes`` at most: the record says so
        (``payload_bytes_max``) instead of declaring one size."""
        target = self.path / NAMESPACE_FILE
        if target.exists():
            return
        for bucket in range(256):
            os.makedirs(f"{self._base}/{bucket:02x}", exist_ok=True)
        payload = layout.slot_bytes if payload_bytes is None else payload_bytes
        record = {
            "what": "kvtier chunk files of one KV layout; the directory name is the "
            "namespace digest (BLAKE2b-256) of the layout below",
            "namespace": self.namespace.hex(),
            "layout": layout.describe(),
            "chunk_file": {
                "path": "ab/<64 hex key>.kvc (ab: the key's first byte)",
                ("payload_bytes_max" if variable else "payload_bytes"): payload,
                "trailer_bytes": trailer_bytes,
                "trailer": "after the payload: magic KVTC, format version, payload "
                "length, xxh3-128 checksum, namespace, key; zero-padded to trailer_bytes",
            },
        }
        if codec is not None:  # the directory name mixes the codec into the digest
            record["codec"] = codec
        temp = self.probe_path("NAMESPACE")
        with open(temp, "w") as handle:
            json.dump(record, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(temp, target)

    def repair_buckets(self) -> list[tuple[str, str]]:
        """Make each of the 256 buckets a directory again where something else
        took its place (a file, a FIFO, a symlink, which stores would follow
        out of the tree); returns each path replaced and what was there.
        256 ``lstat`` calls: cheap enough for every start."""
        replaced = []
        for bucket in range(256):
            path = f"{self._base}/{bucket:02x}"
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # made by the first store into it
            if stat.S_ISDIR(mode):
                continue
            os.unlink(path)
            os.mkdir(path)
            replaced.append((path, mode_kind(mode)))
        return replaced

    def read_record(self) -> object:
        """``NAMESPACE.json``, parsed. Reads boundedly: nothing but a regular
        file of at most :data:`RECORD_LIMIT` bytes is read (a FIFO, a link to
        ``/dev/zero``...). Raises ``FileNotFoundError`` if there is none, and
        ``ValueError`` saying what is wrong with anything else there."""
        path = self.path / NAMESPACE_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise
        except OSError as exc:
            try:
                what = mode_kind(os.lstat(path).st_mode)
            except OSError:
                what = "unreadable"
            raise ValueError(f"{what} ({exc.strerror})") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{mode_kind(info.st_mode)}, not a regular file")
            if info.st_size > RECORD_LIMIT:
                raise ValueError(f"{info.st_size} bytes, more than {RECORD_LIMIT}")
            data = os.pread(fd, RECORD_LIMIT, 0)
        finally:
            os.close(fd)
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not JSON ({type(exc).__name__})") from exc

    def scan(self) -> Iterator[ChunkFile]:
        """Every complete chunk file under this namespace (order unspecified)."""
        for found in self.survey():
            if isinstance(found, ChunkFile):
                yield found

    def listed_chunks(self) -> Iterator[bytes]:
        """The keys of the regular files named like chunks, from the buckets'
        listings alone: no file is examined where the filesystem lists entry
        types (a cold root's ``stat`` calls are most of :meth:`survey`'s
        time). Their sizes are for :meth:`survey` to check."""
        for entry in self._entries():
            if isinstance(entry, OddEntry):
                continue  # an unreadable bucket: the survey says so
            key = _chunk_key(entry.name)
            if key is None:
                continue
            try:
                listed = entry.is_file(follow_symlinks=False)
            except OSError:
                continue  # the survey says what it is
            if listed:
                yield key

    def survey(self) -> Iterator[ChunkFile | OddEntry]:
        """Every chunk file, and everything else that is not a temp file.

        Never raises for what it finds: an entry that cannot be examined, a
        directory or FIFO named like a chunk, an unknown name, an unreadable
        bucket each come back as an :class:`OddEntry`.
        """
        for entry in self._entries():
            if isinstance(entry, OddEntry):
                yield entry
                continue
            key = _chunk_key(entry.name)
            if key is None and _TMP_NAME.match(entry.name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted meanwhile
            except OSError as exc:
                yield OddEntry(entry.path, f"unreadable ({exc.strerror})", key)
                continue
            if key is None:
                yield OddEntry(entry.path, f"{mode_kind(info.st_mode)} with an unknown name", None)
            elif not stat.S_ISREG(info.st_mode):
                yield OddEntry(entry.path, mode_kind(info.st_mode), key)
            else:
                yield ChunkFile(key, entry.path, info.st_size, info.st_mtime_ns)

    def temp_files(self, max_age_s: float) -> Iterator[TempFile]:
        """Every temp file, in the buckets and at the top (start-up files).

        One is abandoned when its writer was a process of this host that no
        longer runs (SIGKILL, crash), or, for writers on other hosts of a
        shared mount, when it is older than ``max_age_s``.
        """
        now = time.time()
        for entry in self._entries(top=True):
            if isinstance(entry, OddEntry):
                continue
            match = _TMP_NAME.match(entry.name)
            if match is None:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            gone = abandoned(match["host"], int(match["pid"]), now - info.st_mtime, max_age_s)
            yield TempFile(entry.path, info.st_size, gone)

    def remove_abandoned_temps(self, max_age_s: float) -> int:
        """Delete the temp files of writes that will never finish (see
        :meth:`temp_files`); how many went."""
        removed = 0
        for temp in self.temp_files(max_age_s):
            if temp.abandoned:
                with contextlib.suppress(OSError):
                    os.unlink(temp.path)
                    removed += 1
        return removed

    def _entries(self, top: bool = False) -> Iterator[os.DirEntry[str] | OddEntry]:
        """Every entry of every bucket (and of the namespace directory itself
        with ``top``); an unreadable bucket comes back as an :class:`OddEntry`."""
        directories = ([self._base] if top else []) + _buckets(self._base)
        for directory in directories:
            try:
                with os.scandir(directory) as entries:
                    yield from entries
            except FileNotFoundError:
                continue
            except OSError as exc:
                yield OddEntry(directory, f"unreadable directory ({exc.strerror})", None)


class _WriterTag:
    """``<host>.<pid>.`` and a nonce unique to each temp name of this process.

    Made once per process (again after a fork) instead of per name: a
    ``getpid`` and a ``getrandom`` call per stored chunk cost the store path
    two system calls. The random start keeps a reused pid from meeting the
    names its previous owner left behind.
    """

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = f"{HOST}.{os.getpid()}."
        self.nonces = itertools.count(secrets.randbits(48) << 16)

    def name(self, directory: str, what: str) -> str:
        return f"{directory}/.{what}.{self.prefix}{next(self.nonces):x}.tmp"


_writer = _WriterTag()


def _temp_name(directory: str, what: str) -> str:
    return _writer.name(directory, what)


def mode_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words: "a regular file", "a FIFO"..."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"a file of mode {mode:o}"


def namespace_dirs(root_dir: Path) -> Iterator[NamespaceDir]:
    """Every namespace directory under ``root_dir``."""
    for entry in sorted(os.scandir(root_dir), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and _NAMESPACE_DIR.match(entry.name):
            yield NamespaceDir(root_dir, bytes.fromhex(entry.name))


def _buckets(path: str) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def write_abandoned(temp_path: str, max_age_s: float) -> bool:
    """Whether the write into ``temp_path`` will never finish (see
    :func:`abandoned`). Before its writer creates the file, or after it
    renamed it, there is no file: the write then counts as abandoned only
    once its writer is known to be dead."""
    match = _TMP_NAME.match(os.path.basename(temp_path))
    if match is None:
        return True
    try:
        age = time.time() - os.lstat(temp_path).st_mtime
    except FileNotFoundError:
        age = 0.0
    except OSError:
        return True
    return abandoned(match["host"], int(match["pid"]), age, max_age_s)


def abandoned(host: str, pid: int, age_s: float, max_age_s: float) -> bool:
    """Whether the work of process ``pid`` on ``host``, begun ``age_s`` ago,
    will never finish: that process of this host no longer runs, or (for
    another host, which cannot be asked) the work is older than ``max_age_s``.
    A pid reused by a new process keeps it alive until ``max_age_s``."""
    return (host == HOST and not _pid_alive(pid)) or age_s > max_age_s


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_entry(path: str) -> bool:
    """Remove what is at a chunk path, if that is safe: never follows a
    symlink, removes a directory only when it is empty. Whether it went."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        return False
    return True


def clear_odd_entry(path: str) -> None:
    """Make room at ``path`` for a regular file: anything else there (symlink,
    FIFO, directory, device) is removed, or moved aside when that is not safe
    (a directory with something in it). Raises ``OSError`` naming the path
    when neither works."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kind = mode_kind(mode)
    if remove_entry(path):
        logger.warning("fs index: removed %s at %s", kind, path)
        return
    aside = f"{path}.{secrets.token_hex(4)}.moved-aside"
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise OSError(
            exc.errno, f"fs index: {kind} at {path} can be neither removed nor moved aside"
        ) from exc
    logger.warning("fs index: moved %s at %s to %s", kind, path, aside)
