"""The ``fs`` tier: contract, layout, corruption, bounds, restarts, sharing."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, integrity
from kvtier.errors import ConfigError
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.tiers.base import Lookup
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.fs.io import TRAILER_BLOCK
from tests.support.round_trip import assert_served_after_primary_reset
from tests.tiers.fs.fs_support import fs_tier

pytestmark = pytest.mark.usefixtures("chunk_io")


class TestFilesystemContract(TierContractTests[FilesystemTier]):
    persistent = True

    @pytest.fixture(autouse=True)
    def _root(self, root: Path) -> None:
        self.root = root

    def make_config(self) -> dict[str, Any]:
        return {"type": "fs", "root_dir": str(self.root), "io_threads": 2}


class TestFilesystemContractBufferedPrivate(TestFilesystemContract):
    def make_config(self) -> dict[str, Any]:
        return {**super().make_config(), "direct_io": "off", "shared": False}


def test_layout_is_namespaced_fanned_out_and_described(harness: TierHarness, root: Path) -> None:
    keys = harness.keys(3)
    harness.fill(range(3))
    assert harness.store(keys, [0, 1, 2]).success
    namespace = harness.layout.namespace.hex()
    assert [p.name for p in root.iterdir()] == [namespace]
    record = json.loads((root / namespace / "NAMESPACE.json").read_text())
    assert record["namespace"] == namespace
    assert record["layout"] == json.loads(json.dumps(harness.layout.describe()))
    assert record["chunk_file"]["payload_bytes"] == harness.layout.slot_bytes
    for key in keys:
        name = key.hex()
        path = root / namespace / name[:2] / f"{name}.kvc"
        assert path.stat().st_size == harness.layout.slot_bytes + TRAILER_BLOCK
    leftovers = [p for p in (root / namespace).rglob(".*")]
    assert leftovers == []


def test_describe_reports_io_mode(harness: TierHarness, root: Path) -> None:
    facts = fs_tier(harness).describe()
    assert facts["io"] in ("direct", "buffered")
    assert facts["root_dir"] == str(root)
    assert facts["index_ready"] is True


def test_direct_io_on_fails_at_start_when_slots_are_unaligned(root: Path) -> None:
    layout = small_layout(chunk_tokens=3)  # 1536-byte slots: not a 4 KiB multiple
    with pytest.raises(ValueError, match="direct_io is 'on'"):
        TierHarness({"type": "fs", "root_dir": str(root), "direct_io": "on"}, layout)


def test_direct_io_auto_falls_back_to_buffered_for_unaligned_slots(root: Path) -> None:
    h = TierHarness({"type": "fs", "root_dir": str(root)}, small_layout(chunk_tokens=3))
    try:
        assert fs_tier(h).describe()["io"] == "buffered"
        keys = h.keys(2)
        data = h.fill([0, 1])
        assert h.store(keys, [0, 1]).success
        assert h.load(keys, [2, 3]).success
        np.testing.assert_array_equal(h.buffer.array[2:4], data)
    finally:
        h.close()


def test_bad_options_fail_validation_with_their_path(root: Path) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.direct_io"):
        from kvtier.config import load_config

        load_config({"secondary_tiers": [{"type": "fs", "root_dir": str(root), "direct_io": "x"}]})


@pytest.mark.parametrize(
    ("root_dir", "problem"),
    [("", "an empty path"), ("   ", "an empty path"), ("/tmp/kv\0x", "NUL")],
)
def test_a_root_dir_no_directory_can_have_fails_when_the_config_loads(
    root_dir: str, problem: str
) -> None:
    from kvtier.config import load_config

    with pytest.raises(ConfigError, match=rf"secondary_tiers\[0\]\.root_dir: .*{problem}"):
        load_config({"secondary_tiers": [{"type": "fs", "root_dir": root_dir}]})


def test_max_bytes_below_one_chunk_is_rejected(root: Path) -> None:
    with pytest.raises(ValueError, match="cannot hold one chunk"):
        TierHarness({"type": "fs", "root_dir": str(root), "max_bytes": 4096}, small_layout())


# Corruption ---------------------------------------------------------------------


def _chunk_path(root: Path, namespace: bytes, key: bytes) -> Path:
    name = key.hex()
    return root / namespace.hex() / name[:2] / f"{name}.kvc"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _trailer(path: Path) -> int:
    """File offset of a chunk file's trailer block."""
    return path.stat().st_size - TRAILER_BLOCK


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: _flip(p, 100), id="payload-byte"),
        pytest.param(lambda p: _flip(p, _trailer(p) - 1), id="last-payload-byte"),
        pytest.param(lambda p: _flip(p, _trailer(p)), id="magic"),
        pytest.param(lambda p: _flip(p, _trailer(p) + 40), id="checksum"),
        pytest.param(lambda p: _truncate(p, _trailer(p)), id="no-trailer"),
        pytest.param(lambda p: _truncate(p, 10), id="truncated"),
        pytest.param(lambda p: _truncate(p, 0), id="empty"),
        pytest.param(lambda p: _truncate(p, _trailer(p) - 1), id="inside-payload-end"),
        pytest.param(lambda p: _truncate(p, _trailer(p) + 1), id="inside-magic"),
        pytest.param(
            lambda p: _truncate(p, _trailer(p) + integrity.HEADER_BYTES - 1), id="inside-header"
        ),
        pytest.param(
            lambda p: _truncate(p, _trailer(p) + integrity.HEADER_BYTES), id="header-no-padding"
        ),
        pytest.param(lambda p: _truncate(p, p.stat().st_size - 1), id="last-padding-byte"),
        # A complete, valid chunk with bytes after it is damage too (a load
        # served its payload while lookups and the re-index called it corrupt).
        pytest.param(lambda p: _append(p, b"\0"), id="one-byte-appended"),
        pytest.param(lambda p: _append(p, bytes(TRAILER_BLOCK)), id="block-appended"),
    ],
)
def test_damaged_chunk_is_a_miss_deleted_and_counted(
    harness: TierHarness, root: Path, damage: Any
) -> None:
    good, bad = harness.keys(2)
    harness.fill([0, 1])
    assert harness.store([good, bad], [0, 1]).success
    path = _chunk_path(root, harness.layout.namespace, bad)
    damage(path)
    result = harness.load([good, bad], [2, 3])
    assert not result.success and result.succeeded == frozenset([good])
    np.testing.assert_array_equal(harness.buffer.array[2], harness.buffer.array[0])
    assert not path.exists()
    assert harness.tier.stats.corrupt_chunks == 1
    assert harness.lookup(bad) is Lookup.MISS
    assert harness.lookup(good) is Lookup.HIT


def test_chunk_of_another_namespace_is_foreign(harness: TierHarness, root: Path) -> None:
    other_layout = small_layout(model_id="another-model")
    other = TierHarness({"type": "fs", "root_dir": str(root), "io_threads": 1}, other_layout)
    try:
        key = harness.keys(1)[0]
        other.fill([0])
        assert other.store([key], [0]).success  # same key bytes, other namespace
        harness.fill([0])
        assert harness.store([key], [0]).success
        ours = _chunk_path(root, harness.layout.namespace, key)
        shutil.copyfile(_chunk_path(root, other_layout.namespace, key), ours)
        result = harness.load([key], [1])
        assert not result.success
        assert not ours.exists()
        assert harness.tier.stats.corrupt_chunks == 1
        assert _chunk_path(root, other_layout.namespace, key).exists()
    finally:
        other.close()


def test_chunk_under_another_key_is_never_served(harness: TierHarness, root: Path) -> None:
    first, second = harness.keys(2)
    harness.fill([0, 1])
    assert harness.store([first, second], [0, 1]).success
    namespace = harness.layout.namespace
    shutil.copyfile(_chunk_path(root, namespace, first), _chunk_path(root, namespace, second))
    assert not harness.load([second], [2]).success
    assert harness.tier.stats.corrupt_chunks == 1


# Bounds --------------------------------------------------------------------------


def _disk_bytes(directory: Path) -> int:
    """Bytes of chunk and temp files: what ``max_bytes`` bounds."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.suffix in (".kvc", ".tmp"))


def test_max_bytes_holds_over_a_long_store_stream_and_hot_chunks_survive(root: Path) -> None:
    layout = small_layout()
    file_bytes = layout.slot_bytes + TRAILER_BLOCK
    h = TierHarness(
        {"type": "fs", "root_dir": str(root), "max_bytes": 8 * file_bytes, "io_threads": 2},
        layout,
    )
    try:
        tier = fs_tier(h)
        tier.wait_index(10)
        hot = h.keys(2)
        hot_data = h.fill([0, 1])
        assert h.store(hot, [0, 1]).success
        stream = h.keys(60)
        namespace_dir = root / layout.namespace.hex()
        for start in range(0, len(stream), 3):
            h.fill([2, 3, 4])
            assert h.store(stream[start : start + 3], [2, 3, 4]).success
            assert _disk_bytes(namespace_dir) <= 8 * file_bytes
            assert tier.held_bytes <= 8 * file_bytes
            assert h.load(hot, [5, 6]).success  # reads count as use
        np.testing.assert_array_equal(h.buffer.array[5:7], hot_data)
        assert tier.stats.evictions == 2 + 60 - 8
        assert [h.lookup(k) for k in stream[:10]] == [Lookup.MISS] * 10
        assert [h.lookup(k) for k in stream[-6:]] == [Lookup.HIT] * 6
    finally:
        h.close()


def test_restart_reindexes_in_lru_order_and_enforces_a_smaller_bound(root: Path) -> None:
    layout = small_layout()
    file_bytes = layout.slot_bytes + TRAILER_BLOCK
    first = TierHarness({"type": "fs", "root_dir": str(root)}, layout)
    keys = first.keys(6)
    first.fill(range(6))
    for i, key in enumerate(keys):
        assert first.store([key], [i]).success
    # Age the files an hour, oldest first, then read the oldest: a read of a
    # file not used for a while stamps it, so it is the newest after a restart.
    now = time.time()
    for i, key in enumerate(keys):
        stamp = now - 3600 + i
        os.utime(_chunk_path(root, layout.namespace, key), (stamp, stamp))
    assert first.load([keys[0]], [6]).success
    first.close()
    second = TierHarness(
        {"type": "fs", "root_dir": str(root), "max_bytes": 3 * file_bytes, "shared": False},
        layout,
    )
    try:
        tier = fs_tier(second)
        assert tier.wait_index(10)
        assert tier.stats.evictions == 3
        present = [k for k in keys if second.lookup(k) is Lookup.HIT]
        assert set(present) == {keys[0], keys[4], keys[5]}
        assert second.load(present, [0, 1, 2]).success
    finally:
        second.close()


# Engine path ----------------------------------------------------------------------


def test_kvcache_round_trip_through_fs_after_primary_reset(root: Path) -> None:
    layout = small_layout(chunk_tokens=4)
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 8 * layout.slot_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "io_threads": 2}],
    }
    tokens = list(range(20))
    data = np.random.default_rng(0).integers(0, 256, (5, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        assert_served_after_primary_reset(cache, tokens, data)
    assert len(list((root / layout.namespace.hex()).rglob("*.kvc"))) == 5


def test_unwritable_root_dir_fails_at_start_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="root_dir"):
        TierHarness({"type": "fs", "root_dir": str(blocker / "kv")}, small_layout())
    assert os.path.isfile(blocker)


def test_health_reports_writable_space_index_and_io_mode(harness: TierHarness) -> None:
    checks = {check.name: check for check in fs_tier(harness).health()}
    assert set(checks) == {"writable", "free space", "index", "io mode"}
    assert all(check.ok for check in checks.values())
    assert checks["io mode"].detail.startswith(str(fs_tier(harness).describe()["io"]))


def test_health_fails_when_the_directory_is_not_writable(harness: TierHarness) -> None:
    tier = fs_tier(harness)
    shutil.rmtree(tier.dir.path)
    tier.dir.path.touch()  # a file where the directory was
    try:
        checks = {check.name: check for check in tier.health()}
        assert not checks["writable"].ok
    finally:
        tier.dir.path.unlink()


def test_metrics_export_index_size_and_disk_full_errors(harness: TierHarness) -> None:
    keys = harness.keys(2)
    harness.fill([0, 1])
    assert harness.store(keys, [0, 1]).success
    values = {metric.name: metric.value for metric in fs_tier(harness).metrics()}
    assert values["chunks"] == 2
    assert values["held_bytes"] == 2 * (harness.layout.slot_bytes + TRAILER_BLOCK)
    assert values["disk_full_errors"] == 0


def test_the_example_configuration_validates() -> None:
    from kvtier.config import load_config

    example = Path(__file__).resolve().parents[3] / "examples" / "nvme.yaml"
    config = load_config(example)
    assert config.secondary_tiers[0].tier_type == "fs"
