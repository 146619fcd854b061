"""``kvtier inspect ROOT_DIR [--verify]``."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kvtier.cli import cli
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.fs.io import TRAILER_BLOCK


def _populate(root: Path, model_id: str, count: int) -> list[bytes]:
    harness = TierHarness({"type": "fs", "root_dir": str(root)}, small_layout(model_id=model_id))
    try:
        keys = harness.keys(count)
        harness.fill(range(count))
        assert harness.store(keys, list(range(count))).success
        return keys
    finally:
        harness.close()


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["inspect", *args], terminal_width=200)
    return result.exit_code, result.output


def test_inspect_counts_chunks_per_namespace(tmp_path: Path) -> None:
    _populate(tmp_path, "model-a", 3)
    _populate(tmp_path, "model-b", 2)
    code, output = _invoke(str(tmp_path))
    assert code == 0, output
    file_bytes = small_layout().slot_bytes + TRAILER_BLOCK
    assert f"2 namespaces, 5 chunks, {5 * file_bytes / 1024:.1f} KiB" in output
    assert "model-a" in output and "model-b" in output


def test_inspect_verify_passes_on_intact_chunks(tmp_path: Path) -> None:
    _populate(tmp_path, "model-a", 4)
    code, output = _invoke(str(tmp_path), "--verify")
    assert code == 0, output
    assert "all checksums verified" in output


def test_inspect_verify_fails_and_names_corrupt_chunks(tmp_path: Path) -> None:
    keys = _populate(tmp_path, "model-a", 4)
    victim = next(tmp_path.rglob(f"{keys[2].hex()}.kvc"))
    data = bytearray(victim.read_bytes())
    data[-TRAILER_BLOCK - 1] ^= 0x01  # the last payload byte
    victim.write_bytes(bytes(data))
    code, output = _invoke(str(tmp_path), "--verify")
    assert code == 1
    assert "1 corrupt chunks" in output
    assert keys[2].hex() in output.replace("\n", "")
    assert victim.exists()  # inspect reports, it never deletes


def test_inspect_empty_root(tmp_path: Path) -> None:
    code, output = _invoke(str(tmp_path), "--verify")
    assert code == 0
    assert "0 namespaces, 0 chunks" in output


def test_inspect_missing_root_is_a_usage_error(tmp_path: Path) -> None:
    code, output = _invoke(str(tmp_path / "absent"))
    assert code == 2
    assert "does not exist" in output
