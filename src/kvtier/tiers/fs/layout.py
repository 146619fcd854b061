"""Where the ``fs`` tier keeps things under ``root_dir``.

::

    root_dir/
      <namespace hex>/              one directory per KV layout (namespace digest)
        NAMESPACE.json              what the digest covers, in plain JSON
        ab/<key hex>.kvc            chunk files, in 256 buckets by the key's first byte
        ab/.<key hex>.<host>.<pid>.<nonce>.tmp   writes in progress

Keys are hashes and only ever become hex, so no client can name a path.

The 256 buckets are made when the namespace directory is, not by the first
store into each: creating directories on the store path (ext4 allocating a
directory inode per bucket) cut store throughput to half on a fresh root.
One level of 256 still keeps directories small: 4,000 files each at a
million chunks (2 TB of 2 MiB chunks).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.layout import KEY_BYTES, KVLayout

CHUNK_SUFFIX = ".kvc"
NAMESPACE_FILE = "NAMESPACE.json"
_CHUNK_NAME = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}{re.escape(CHUNK_SUFFIX)}$")
_TMP_NAME = re.compile(r"^\.[0-9a-f]+\.(?P<host>[^.]*)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")
_NAMESPACE_DIR = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]


@dataclass(frozen=True)
class ChunkFile:
    """A chunk file found on disk."""

    key: bytes
    path: str
    size: int
    mtime_ns: int


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
        stem = name[: -len(CHUNK_SUFFIX)]
        return f"{directory}/.{stem}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}.tmp"

    def create(self, layout: KVLayout, trailer_bytes: int) -> None:
        """Make the namespace directory, its 256 buckets and ``NAMESPACE.json``,
        unless that file says an earlier start did (it is written last,
        atomically; concurrent creators agree). A restart costs one ``stat``."""
        target = self.path / NAMESPACE_FILE
        if target.exists():
            return
        for bucket in range(256):
            os.makedirs(f"{self._base}/{bucket:02x}", exist_ok=True)
        record = {
            "what": "kvtier chunk files of one KV layout; the directory name is the "
            "namespace digest (BLAKE2b-256) of the layout below",
            "namespace": self.namespace.hex(),
            "layout": layout.describe(),
            "chunk_file": {
                "path": "ab/<64 hex key>.kvc (ab: the key's first byte)",
                "payload_bytes": layout.slot_bytes,
                "trailer_bytes": trailer_bytes,
                "trailer": "after the payload: magic KVTC, format version, payload "
                "length, xxh3-128 checksum, namespace, key; zero-padded to trailer_bytes",
            },
        }
        temp = self.temp_path(str(target.with_suffix(CHUNK_SUFFIX)))
        with open(temp, "w") as handle:
            json.dump(record, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(temp, target)

    def scan(self) -> Iterator[ChunkFile]:
        """Every complete chunk file under this namespace (order unspecified)."""
        for entry in self._entries():
            if not _CHUNK_NAME.match(entry.name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted meanwhile
            key = bytes.fromhex(entry.name[: -len(CHUNK_SUFFIX)])
            yield ChunkFile(key, entry.path, info.st_size, info.st_mtime_ns)

    def remove_abandoned_temps(self, max_age_s: float) -> int:
        """Delete temp files of writes that will never finish.

        A temp file is abandoned when its writer was a process of this host
        that no longer runs (SIGKILL, crash), or, for writers on other hosts
        of a shared mount, when it is older than ``max_age_s``.
        """
        removed = 0
        now = time.time()
        for entry in self._entries():
            match = _TMP_NAME.match(entry.name)
            if match is None:
                continue
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            dead = match["host"] == _HOST and not _pid_alive(int(match["pid"]))
            if dead or age > max_age_s:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def _entries(self) -> Iterator[os.DirEntry[str]]:
        """Every entry of every bucket."""
        for bucket in _buckets(self._base):
            with contextlib.suppress(FileNotFoundError), os.scandir(bucket) as entries:
                yield from entries


def namespace_dirs(root_dir: Path) -> Iterator[NamespaceDir]:
    """Every namespace directory under ``root_dir``."""
    for entry in sorted(os.scandir(root_dir), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and _NAMESPACE_DIR.match(entry.name):
            yield NamespaceDir(root_dir, bytes.fromhex(entry.name))


def _buckets(path: str) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
