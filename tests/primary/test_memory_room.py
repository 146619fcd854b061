"""A primary tier larger than the memory it can have fails at start, naming
``cpu_bytes_to_use``, instead of killing the engine later.

A named buffer's pages in ``/dev/shm`` are allocated as they are first
written: with too little room there (a container's is 64 MiB unless it is
given more), the write that finds none ends the process with ``SIGBUS``.
"""

import errno
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import ChunkKey, ConfigError, KVCache
from kvtier.primary import SlotBuffer
from kvtier.primary import buffer as buffer_module
from kvtier.specs import tiering
from kvtier.testing import small_layout

LAYOUT = small_layout()


def shared_memory_with(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """Make ``/dev/shm`` report ``free`` bytes free, whatever it has."""
    real = os.statvfs

    def statvfs(path: Any) -> Any:
        stats = real(path)
        if os.fspath(path) != buffer_module._SHM_DIR:
            return stats
        blocks = free // stats.f_frsize
        fields = list(stats)
        fields[3] = fields[4] = blocks  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


def start(cpu_bytes: str, name: str | None = None) -> KVCache:
    config = {"chunk_tokens": LAYOUT.chunk_tokens, "cpu_bytes_to_use": cpu_bytes}
    return KVCache({**config, "shared_memory_name": name}, LAYOUT)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this platform")
def test_shared_slots_beyond_the_free_shared_memory_fail_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"kvtier-room-{os.getpid()}"
    shared_memory_with(monkeypatch, 8 << 20)
    with pytest.raises(ConfigError) as info:
        start("32MiB", name)
    (where, problem), *others = info.value.problems
    assert not others and where == "cpu_bytes_to_use"
    assert problem == (
        "cannot map 32.0 MiB of slots in shared memory: /dev/shm has 8.0 MiB free: "
        "give it more (a container's --shm-size) or ask for less"
    )
    assert not Path("/dev/shm", name).exists()  # nothing left behind

    shared_memory_with(monkeypatch, 64 << 20)
    cache = start("32MiB", name)
    try:
        tokens = list(range(4 * LAYOUT.chunk_tokens))
        kv = np.random.default_rng(0).integers(0, 256, (4, LAYOUT.slot_bytes), np.uint8)
        cache.store(tokens, kv)
        out = np.zeros_like(kv)
        assert cache.load_prefix(tokens, out) == len(tokens)
        assert np.array_equal(out, kv)
    finally:
        cache.close()


def test_slots_beyond_the_memory_available_fail_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError) as info:
        start("4EiB")
    ((where, problem),) = info.value.problems
    assert where == "cpu_bytes_to_use"
    assert problem.startswith("4194304.0 TiB of slots exceed the ")

    available = (16 << 20, "MemAvailable in /proc/meminfo")
    monkeypatch.setattr(tiering, "available_memory", lambda **_: available)
    with pytest.raises(ConfigError) as info:
        start("32MiB")
    assert info.value.problems == [
        (
            "cpu_bytes_to_use",
            "32.0 MiB of slots exceed the 16.0 MiB available (MemAvailable in /proc/meminfo)",
        )
    ]
    start("16MiB").close()

    # Where the system does not say, the mapping itself is what refuses.
    monkeypatch.setattr(tiering, "available_memory", lambda **_: None)
    with pytest.raises(ConfigError) as info:
        start("4EiB")
    assert info.value.problems == [
        ("cpu_bytes_to_use", "cannot map 4194304.0 TiB of slots: Cannot allocate memory")
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
@pytest.mark.parametrize(
    ("code", "level"),
    [
        (errno.EFAULT, logging.WARNING),
        (errno.ENOSPC, logging.WARNING),
        (errno.EINVAL, logging.INFO),
    ],
)
def test_memory_that_runs_short_while_mapped_ahead_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int, level: int
) -> None:
    def short(*args: Any) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(SlotBuffer, "_map_ahead", short)
    buffer = SlotBuffer(4, 4096)
    try:
        with caplog.at_level(logging.INFO, logger=buffer_module.__name__):
            buffer.populate_in_background()
            assert buffer.wait_populated(60)
    finally:
        buffer.close()
    (record,) = caplog.records
    assert record.levelno == level
    if level == logging.WARNING:
        assert "only part of its 16.0 KiB could be mapped ahead" in record.getMessage()


def running_short_after(backed: list[int]) -> Any:
    """A ``_map_ahead`` that writes the pages of the ``backed`` slots (as
    touching does, or a promotion before it), then fails as a full
    ``/dev/shm`` does: the other slots keep no memory."""

    def map_ahead(buffer: SlotBuffer) -> None:
        buffer.array[backed] = 0
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return map_ahead


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this platform")
@pytest.mark.parametrize("tier_first", [True, False], ids=["tier-first", "buffer-first"])
def test_slots_left_without_memory_are_never_handed_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tier_first: bool
) -> None:
    """A first write into a slot its file has no room for ends the process
    with ``SIGBUS``: where ``/dev/shm`` runs out while the buffer is mapped
    ahead, the slots without memory are taken out of use, whether the tier
    was built before or after. A slot written already has its memory and stays."""
    from kvtier.policies.lru import LRUCachePolicy
    from kvtier.primary import PrimaryTier

    monkeypatch.setattr(SlotBuffer, "_map_ahead", running_short_after([0, 1, 2, 6]))
    buffer = SlotBuffer(8, 64 << 10, shared_name=f"kvtier-unbacked-{os.getpid()}")
    buffer.unlink()
    try:
        primary = PrimaryTier(buffer, LRUCachePolicy(8)) if tier_first else None
        with caplog.at_level(logging.WARNING, logger=buffer_module.__name__):
            buffer.populate_in_background()
            assert buffer.wait_populated(60)
        assert "4 of its 8 slots lack memory and are taken out of use" in caplog.text
        primary = primary or PrimaryTier(buffer, LRUCachePolicy(8))
        assert sorted(primary.free_slots()) == [0, 1, 2, 6]
        assert (primary.usable_slots, primary.free_count) == (4, 4)
        assert primary.busy_counts()["retired"] == 4
        keys = [ChunkKey(bytes([i]) * 32) for i in range(5)]
        assert primary.prepare_store(keys) is None  # room for four only
        reserved = primary.prepare_store(keys[:4])
        assert reserved is not None and sorted(reserved.values()) == [0, 1, 2, 6]
        primary.complete_store(keys[:4])
        primary.clear()
        assert sorted(primary.free_slots()) == [0, 1, 2, 6]  # still out of use
    finally:
        buffer.close()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this platform")
def test_a_store_takes_only_the_slots_with_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SlotBuffer, "_map_ahead", running_short_after([0, 1, 2]))
    cache = start(str(8 * LAYOUT.slot_bytes), f"kvtier-unbacked-{os.getpid()}")
    try:
        cache.unlink_shared_memory()
        assert cache.manager.primary.buffer.wait_populated(60)
        tokens = list(range(8 * LAYOUT.chunk_tokens))
        rows = np.random.default_rng(0).integers(0, 256, (8, LAYOUT.slot_bytes), dtype=np.uint8)
        assert cache.store(tokens, rows) == 3  # the first three chunks, as many as fit
        assert cache.status.primary.retired == 5
        assert sorted(cache.manager.primary.slots().values()) == [0, 1, 2]
    finally:
        cache.close()
