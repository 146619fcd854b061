"""``kvtier inspect ROOT_DIR [--verify]``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import cli
from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.fs.io import TRAILER_BLOCK
from kvtier.tiers.fs.layout import NamespaceDir


def _populate(root: Path, model_id: str, count: int) -> list[ChunkKey]:
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


def test_a_directory_without_kvtier_data_says_so_and_fails(tmp_path: Path) -> None:
    for args in ((str(tmp_path),), (str(tmp_path), "--verify")):
        code, output = _invoke(*args)
        assert code == 1
        assert f"no kvtier fs tier data in {tmp_path}" in output
        assert "verified" not in output and "Traceback" not in output


def test_a_directory_above_the_root_points_at_the_root(tmp_path: Path) -> None:
    """``kvtier inspect kvtier-demo`` instead of ``kvtier-demo/fs``."""
    _populate(tmp_path / "fs", "model-a", 2)
    code, output = _invoke(str(tmp_path))
    assert code == 1
    assert f"kvtier inspect {tmp_path / 'fs'}" in output


def test_inspect_fits_80_columns_and_counts_in_the_singular(tmp_path: Path) -> None:
    _populate(tmp_path, "model-with-a-rather-long-name-for-its-layout", 1)
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path)], terminal_width=80)
    assert result.exit_code == 0, result.output
    table = result.output.split("modification times (UTC)")[0]
    assert "…" not in table
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "1 namespace, 1 chunk," in result.output
    # The layout is written out whole, once per namespace, under the table.
    assert "model-with-a-rather-long-name-for-its-layout" in result.output


def test_inspect_missing_root_is_a_usage_error(tmp_path: Path) -> None:
    code, output = _invoke(str(tmp_path / "absent"))
    assert code == 2
    assert "does not exist" in output


def _chunk_paths(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvc"))


def test_inspect_verify_reports_odd_entries_as_rows_and_reads_boundedly(tmp_path: Path) -> None:
    _populate(tmp_path, "model-a", 6)
    paths = _chunk_paths(tmp_path)
    paths[0].unlink()
    paths[0].symlink_to("/dev/zero")  # endless bytes behind a chunk name
    paths[1].unlink()
    paths[1].mkdir()
    paths[2].unlink()
    os.mkfifo(paths[2])  # an open for reading would wait for a writer forever
    with open(paths[3], "r+b") as handle:
        handle.truncate(64 << 30)  # sparse: 64 GiB that must not be read
    (paths[4].parent / "notes.txt").write_text("left by someone")
    code, output = _invoke(str(tmp_path), "--verify")
    flat = output.replace("\n", "")
    assert code == 1, output
    assert "Traceback" not in output
    assert "4 corrupt chunks" in output
    for path, reason in [
        (paths[0], "a symlink, not a regular file"),
        (paths[1], "a directory, not a regular file"),
        (paths[2], "a FIFO, not a regular file"),
        (paths[3], f"chunk file is {64 << 30} bytes"),
    ]:
        assert f"corrupt {path}: {reason}" in flat, (path, output)
    assert f"skipped {paths[4].parent / 'notes.txt'}" in flat
    assert "6 chunks" not in output and "all checksums verified" not in output
    assert os.path.islink(paths[0]) and paths[1].is_dir()  # inspect reports, never deletes


def _abandon_a_temp_file(root: Path, size: int) -> Path:
    """A temp file as a writer killed mid-store leaves it (its pid is gone)."""
    script = (
        "import os, sys\n"
        "from kvtier.tiers.fs.layout import NamespaceDir\n"
        "from kvtier.testing import small_layout\n"
        "directory = NamespaceDir(__import__('pathlib').Path(sys.argv[1]), "
        "small_layout(model_id='model-a').namespace)\n"
        "path = directory.temp_path(directory.chunk_path(bytes(32)))\n"
        "with open(path, 'wb') as handle:\n"
        "    handle.write(bytes(int(sys.argv[2])))\n"
        "print(path)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(root), str(size)],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(child.stdout.strip())


def test_inspect_verify_lists_abandoned_temp_files_until_a_tier_start_removes_them(
    tmp_path: Path,
) -> None:
    _populate(tmp_path, "model-a", 3)
    temps = [_abandon_a_temp_file(tmp_path, 5120), _abandon_a_temp_file(tmp_path, 5120)]
    assert all(temp.exists() for temp in temps)
    code, output = _invoke(str(tmp_path), "--verify")
    flat = output.replace("\n", "")
    assert code == 0, output
    assert "all checksums verified" not in output
    assert "2 abandoned temp files (10.0 KiB)" in flat
    assert "removed at the next tier start" in flat
    assert all(f"abandoned temp {temp}" in flat for temp in temps)
    _populate(tmp_path, "model-a", 1)  # a tier start
    assert not any(temp.exists() for temp in temps)
    code, output = _invoke(str(tmp_path), "--verify")
    assert code == 0 and "all checksums verified" in output
    assert "abandoned" not in output


def test_inspect_tells_a_live_writer_s_temp_file_from_an_abandoned_one(tmp_path: Path) -> None:
    _populate(tmp_path, "model-a", 1)
    directory = NamespaceDir(tmp_path, small_layout(model_id="model-a").namespace)
    live = Path(directory.temp_path(directory.chunk_path(bytes(32))))  # this process: alive
    live.write_bytes(bytes(2048))
    code, output = _invoke(str(tmp_path), "--verify")
    assert code == 0, output
    assert "1 temp files (2.0 KiB) of writes in progress" in output
    assert "abandoned" not in output


def _inspect_in_a_bounded_process(root: Path) -> subprocess.CompletedProcess[str]:
    """``kvtier inspect --verify ROOT`` in a process that 1 GiB of memory
    stops: an unbounded read fails it with MemoryError instead of taking the
    machine's memory. The timeout only ends a hang."""
    limit = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
        "import sys; from kvtier.cli import main; sys.argv[0] = 'kvtier'; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", limit, "inspect", "--verify", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _namespace_record(root: Path) -> Path:
    (record,) = root.glob("*/NAMESPACE.json")
    return record


@pytest.mark.parametrize(
    ("make", "reported"),
    [
        (lambda path: os.mkfifo(path), "a FIFO, not a regular file"),
        (lambda path: path.symlink_to("/dev/zero"), "a symlink"),
        (lambda path: path.mkdir(), "a directory, not a regular file"),
        (lambda path: os.truncate(path.touch() or path, 8 << 30), f"{8 << 30} bytes"),
        (lambda path: path.write_text("[" * 100_000), "not JSON"),
    ],
    ids=["fifo", "link-to-dev-zero", "directory", "sparse-8GiB", "deeply-nested"],
)
def test_inspect_reads_namespace_json_boundedly(
    tmp_path: Path, make: Callable[[Path], object], reported: str
) -> None:
    _populate(tmp_path, "model-a", 2)
    record = _namespace_record(tmp_path)
    record.unlink()
    make(record)
    result = _inspect_in_a_bounded_process(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    assert f"NAMESPACE.json unreadable: {reported}" in output.replace("\n", "")
    assert "2 chunks" in output and "all checksums verified" in output


@pytest.mark.parametrize(
    "chunk_file",
    [
        {"payload_bytes": 1e400, "trailer_bytes": 4096},  # infinity once parsed
        {"payload_bytes": -8192, "trailer_bytes": 4096},
        {"payload_bytes": "16384", "trailer_bytes": 4096},
        {"payload_bytes": True, "trailer_bytes": 4096},
        ["payload_bytes", "trailer_bytes"],
    ],
    ids=["infinite", "negative", "text", "bool", "list"],
)
def test_inspect_ignores_a_chunk_size_namespace_json_cannot_declare(
    tmp_path: Path, chunk_file: object
) -> None:
    _populate(tmp_path, "model-a", 2)
    record = _namespace_record(tmp_path)
    content = json.loads(record.read_text())
    content["chunk_file"] = chunk_file
    record.write_text(json.dumps(content))
    code, output = _invoke(str(tmp_path), "--verify")
    assert code == 0, output
    assert "Traceback" not in output and "corrupt chunk" not in output
    assert "2 chunks" in output and "all checksums verified" in output


def test_inspect_of_a_root_that_is_a_fifo_is_a_usage_error(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "root")
    code, output = _invoke(str(tmp_path / "root"))
    assert code == 2, output
    assert "is not a directory" in output
