"""The name of an engine's primary slots in ``/dev/shm``, and what a crash leaves there.

The scheduler side creates the slots as ``kvtier-vllm-<pid>-<tag>``: ``pid``
is the engine-core process, ``tag`` comes from vLLM's ``engine_id`` (a UUID
every worker receives with the config). Workers run in the engine-core
process itself or in its children, so each can find the name at start-up
without being told; once every worker has mapped the slots the scheduler
removes the name, and from then on a killed engine leaves nothing behind.
A name whose creator died before that is stale: the next engine removes it.
Its creator holds a shared ``flock`` on it until then, so a live engine's
name is never taken for stale, even one whose pid this process cannot see
(another container sharing ``/dev/shm``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re

from kvtier.shared_slots import MappedSlots, map_slots

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "kvtier-vllm-"
_ENGINE_NAME = re.compile(rf"^{_PREFIX}(\d+)-[0-9A-Za-z]+$")


def engine_buffer_name(engine_id: str, pid: int) -> str:
    """The shared memory name of the slots of the engine ``engine_id`` run by ``pid``."""
    tag = "".join(c for c in engine_id if c.isalnum())[:16] or "engine"
    return f"{_PREFIX}{pid}-{tag}"


def engine_buffer_names(engine_id: str) -> list[str]:
    """Where a worker of engine ``engine_id`` looks for its slots.

    Under this process's pid (engine and worker in one process) and its
    parent's (workers spawned by the engine core).
    """
    return [
        engine_buffer_name(engine_id, pid) for pid in dict.fromkeys((os.getpid(), os.getppid()))
    ]


def map_existing(names: list[str], slot_bytes: int) -> MappedSlots | None:
    """Map the first of ``names`` that exists in shared memory (``None`` if none does)."""
    for name in names:
        try:
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        except OSError:
            continue
        if size == 0 or size % slot_bytes:
            logger.warning(
                "kvtier: shared memory %r holds %d bytes, not whole %d-byte slots; not mapped",
                name,
                size,
                slot_bytes,
            )
            continue
        return map_slots(name, size // slot_bytes, slot_bytes)
    return None


class NameGuard:
    """Marks a slot name as in use by a live engine until :meth:`release`."""

    def __init__(self, name: str) -> None:
        self._fd: int | None = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with it
            self._fd = None


def remove_stale_buffers(directory: str = SHM_DIR) -> list[str]:
    """Remove the slot names of engines that are gone; returns the names removed.

    A name is stale when the pid in it no longer runs and nobody holds its
    :class:`NameGuard`.
    """
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = [
        entry
        for entry in entries
        if (match := _ENGINE_NAME.match(entry)) is not None
        and not _is_running(int(match.group(1)))
        and _remove_unguarded(os.path.join(directory, entry))
    ]
    if removed:
        logger.info("kvtier: removed shared memory left by stopped engines: %s", removed)
    return removed


def _remove_unguarded(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a live engine holds it
        os.close(fd)
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
