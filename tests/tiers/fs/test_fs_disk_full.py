"""The ``fs`` tier on a full disk: stores fail cleanly and are counted, nothing crashes."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.base import Lookup
from kvtier.tiers.fs import FilesystemTier, io

pytestmark = pytest.mark.usefixtures("chunk_io")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: room for about twenty 12 KiB chunk files."""
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount command: cannot make a small filesystem (ENOSPC is injected below)")
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}); "
            "the injected-ENOSPC test covers this path"
        )
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def _stored_and_exact(harness: TierHarness, keys: list, expected: dict) -> int:
    good = 0
    for key in keys:
        if harness.lookup(key) is Lookup.HIT:
            assert harness.load([key], [0]).success
            np.testing.assert_array_equal(harness.buffer.array[0], expected[key])
            good += 1
    return good


def test_full_filesystem_fails_stores_cleanly_then_recovers(small_fs: Path) -> None:
    harness = TierHarness(
        {"type": "fs", "root_dir": str(small_fs / "kv"), "io_threads": 2},
        small_layout(),
        num_slots=8,
    )
    try:
        tier = harness.tier
        assert isinstance(tier, FilesystemTier)
        tier.wait_index(10)
        keys = harness.keys(40)
        expected = {}
        outcomes = []
        for key in keys:
            expected[key] = harness.fill([1])[0]
            outcomes.append(harness.store([key], [1]).success)
        assert True in outcomes and False in outcomes
        assert tier.disk_full_errors == outcomes.count(False)
        # Nothing half-written is left behind or served.
        assert list(small_fs.rglob("*.tmp")) == []
        stored = [k for k, ok in zip(keys, outcomes, strict=True) if ok]
        assert _stored_and_exact(harness, keys, expected) == len(stored)
        # Space freed by someone else: stores succeed again.
        for path in list(small_fs.rglob("*.kvc"))[:5]:
            path.unlink()
        late = harness.keys(1)
        harness.fill([2])
        assert harness.store(late, [2]).success
    finally:
        harness.close()


def test_full_filesystem_is_counted_as_store_failures_by_the_manager(small_fs: Path) -> None:
    layout = small_layout(chunk_tokens=4)  # 4 KiB chunks, 8 KiB files
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 64 * layout.slot_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(small_fs / "kv"), "io_threads": 2}],
    }
    tokens = list(range(4 * 60))
    data = np.random.default_rng(1).integers(0, 256, (60, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        assert cache.store(tokens, data) == 60  # the primary tier takes them all
        cache.drain()
        stats = cache.manager.tiers[0].stats
        assert stats.store_failures > 0
        assert stats.chunks_stored + stats.store_failures == 60


# The failure is injected into the Python implementation's write; the
# compiled one meets a real full disk in the tests above.
@pytest.mark.parametrize("chunk_io", ["python"], indirect=True)
def test_injected_enospc_fails_the_store_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = TierHarness(
        {"type": "fs", "root_dir": str(tmp_path / "kv"), "io_threads": 1}, small_layout()
    )
    try:
        tier = harness.tier
        assert isinstance(tier, FilesystemTier)
        keys = harness.keys(2)
        harness.fill([0, 1])
        real_pwritev = os.pwritev

        def full_disk(fd: int, buffers: list, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(io.os, "pwritev", full_disk)
        result = harness.store(keys, [0, 1])
        assert not result.success and result.succeeded == frozenset()
        assert tier.disk_full_errors == 2
        assert list(tmp_path.rglob("*.tmp")) == [] and list(tmp_path.rglob("*.kvc")) == []
        assert tier.held_bytes == 0
        monkeypatch.setattr(io.os, "pwritev", real_pwritev)
        assert harness.store(keys, [0, 1]).success
        assert harness.load(keys, [2, 3]).success
    finally:
        harness.close()
