"""The ``fs`` tier's options, validated from its configuration entry."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, field_validator

from kvtier.tiers.threaded import ThreadedTierOptions


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

    io_threads: int = Field(default=16, ge=1, le=256)
    """Worker threads doing file I/O. One pool serves both directions and
    always takes queued loads before queued stores, so no separate read and
    write counts are needed for loads to win. Sixteen reads of a chunk each
    keep a disk busy; more only contend for the cores that check and copy
    what they read (docs/tuning.md, 'Where the goals stand')."""

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

    @field_validator("root_dir", mode="before")
    @classmethod
    def _check_root_dir(cls, root_dir: object) -> object:
        if isinstance(root_dir, str):
            # An empty one would become ".", wherever the engine happens to run
            # (an unset variable in a templated configuration, most likely).
            if not root_dir.strip():
                raise ValueError("an empty path; name the directory to hold the chunk files")
            if "\0" in root_dir:
                raise ValueError("a path holds no NUL byte")
        return root_dir

    def store_location(self) -> str | None:
        # Symlinks and spellings (``~``, ``a/../b``, a trailing slash) resolved:
        # one directory however it is written.
        return f"directory {os.path.realpath(self.root_dir.expanduser())}"
