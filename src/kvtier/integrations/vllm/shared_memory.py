"""The name of an engine's primary slots in ``/dev/shm``, and what a crash leaves there.

The scheduler side creates the slots as ``kvtier-vllm-<pid>-<tag>``: ``pid``
is the engine-core process, ``tag`` comes from vLLM's ``engine_id`` (a UUID
every worker receives with the config). Workers run in the engine-core
process itself or in its children, so each can find the name at start-up
without being told; once every worker has mapped the slots the scheduler
removes the name, and from then on a killed engine leaves nothing behind.
A name whose creator died before that is stale: the next engine removes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

from kvtier.primary import SlotBuffer

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


def map_existing(names: list[str], slot_bytes: int) -> SlotBuffer | None:
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
        return SlotBuffer.attach(name, size // slot_bytes, slot_bytes)
    return None


def remove_stale_buffers(directory: str = SHM_DIR) -> list[str]:
    """Remove the slot names of engines whose process is gone; returns the names removed.

    Only a name whose pid no longer runs is touched, so a live engine (this
    machine's, same pid namespace) never loses its slots.
    """
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = _ENGINE_NAME.match(entry)
        if match is None or _is_running(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, entry))
            removed.append(entry)
    if removed:
        logger.info("kvtier: removed shared memory left by stopped engines: %s", removed)
    return removed


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
