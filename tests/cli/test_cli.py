"""``kvtier check``: validates, starts every tier, round-trips chunks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import cli

WIDE = {"COLUMNS": "200"}  # rich wraps table cells to the terminal width


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def test_check_round_trips_every_tier(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "chunk_tokens: 16\ncpu_bytes_to_use: 4MiB\nsecondary_tiers:\n"
        "  - {type: memory, max_bytes: 8MiB}\n  - {type: example}\n",
    )
    result = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "64"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert result.output.count("byte-exact") == 2


def test_check_fails_on_a_failing_tier(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "chunk_tokens: 16\nsecondary_tiers:\n  - {type: memory}\n"
        "  - {type: FaultyTier, module_path: kvtier.testing.faults, fail_rate: 1.0}\n",
    )
    result = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "16"], env=WIDE)
    assert result.exit_code == 1
    assert "FAILED" in result.output and "store failed for 4/4 chunks" in result.output


def test_check_reports_config_errors_by_path(tmp_path: Path) -> None:
    config = write(tmp_path, "secondary_tiers:\n  - {type: memory, max_bytse: 1MiB}\n")
    result = CliRunner().invoke(cli, ["check", str(config)])
    assert result.exit_code == 2
    assert "secondary_tiers[0].max_bytse" in result.output
    assert "did you mean 'max_bytes'?" in result.output


def test_check_a_config_without_tiers(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["check", str(write(tmp_path, "chunk_tokens: 8\n"))])
    assert result.exit_code == 0 and "names no secondary tiers" in result.output
    assert "warning:" in result.output and "secondary_tiers" in result.output


@pytest.mark.parametrize(
    ("option", "value"),
    [("--chunks", "0"), ("--chunks", "-3"), ("--chunk-kib", "-1"), ("--chunk-kib", "0")],
)
def test_check_refuses_probe_sizes_below_one(tmp_path: Path, option: str, value: str) -> None:
    config = write(tmp_path, "chunk_tokens: 8\nsecondary_tiers: [{type: memory}]\n")
    result = CliRunner().invoke(cli, ["check", str(config), option, value])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.output
    assert "x>=1" in result.output  # says what is valid, not a capacity error
    assert "cpu_bytes_to_use" not in result.output


@pytest.mark.parametrize("size", ["lots", "12 bananas", "-5"])
def test_a_bad_byte_size_shows_a_valid_one(tmp_path: Path, size: str) -> None:
    result = CliRunner().invoke(
        cli, ["check", str(write(tmp_path, f"cpu_bytes_to_use: {size!r}\n"))]
    )
    assert result.exit_code == 2
    assert "cpu_bytes_to_use" in result.output and "8GiB" in result.output


def test_check_prints_byte_counts_for_people(tmp_path: Path) -> None:
    config = write(
        tmp_path, "chunk_tokens: 8\nsecondary_tiers: [{type: memory, max_bytes: 1GiB}]\n"
    )
    result = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "16"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "max_bytes=1.0 GiB" in result.output
    assert "of 1.0 GiB held" in result.output
    assert "1073741824" not in result.output


def test_check_gives_no_throughput_for_a_tier_that_keeps_no_stores(tmp_path: Path) -> None:
    # A p2p node with no peers keeps no stores of its own: nothing to time.
    config = write(
        tmp_path,
        "chunk_tokens: 8\nsecondary_tiers:\n"
        "  - {type: p2p, listen: null, peers: [], secret: a-long-enough-test-secret}\n",
    )
    result = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "16"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "lookups answered" in result.output
    assert "0 MB/s" not in result.output


def _commands() -> list[str]:
    return sorted(cli.commands)


@pytest.mark.parametrize("command", _commands())
def test_help_is_plain_text(command: str) -> None:
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    for markup in ("``", ":func:", ":class:", ":meth:"):
        assert markup not in result.output, f"kvtier {command} --help shows {markup!r}"


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    # A process of its own: a check abandons a stuck tier by exiting at once.
    command = [sys.executable, "-c", "from kvtier.cli import main; main()", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **WIDE})


def test_check_bounds_a_tier_constructor_that_never_returns(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "chunk_tokens: 8\nsecondary_tiers:\n  - {type: memory}\n"
        "  - {type: FaultyTier, module_path: kvtier.testing.faults, hang_in: constructor}\n",
    )
    result = _kvtier("check", str(config), "--chunk-kib", "16", "--timeout", "0.5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "secondary_tiers[1] (type 'FaultyTier') did not start within 0.5 s (--timeout)"
        in result.stderr
    )


def test_check_bounds_a_health_check_that_never_returns(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "chunk_tokens: 8\nsecondary_tiers:\n"
        "  - {type: FaultyTier, module_path: kvtier.testing.faults, hang_in: health}\n",
    )
    result = _kvtier("check", str(config), "--chunk-kib", "16", "--timeout", "0.5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "health() did not return within 0.5 s" in result.stdout
    assert "byte-exact" in result.stdout  # the other steps still ran


def test_a_constructor_error_names_the_entry(tmp_path: Path) -> None:
    root = tmp_path / "file-not-dir"
    root.write_text("")
    config = write(
        tmp_path,
        "chunk_tokens: 8\nsecondary_tiers:\n  - {type: memory}\n"
        f"  - {{type: fs, root_dir: {root}}}\n",
    )
    result = CliRunner().invoke(cli, ["check", str(config)], env=WIDE)
    assert result.exit_code == 1
    assert "cannot start the tiers" in result.output
    assert "secondary_tiers[1]" in result.output


@pytest.mark.parametrize("command", ["check", "bench"])
def test_probe_chunks_are_removed_from_a_shared_tier(tmp_path: Path, command: str) -> None:
    root = tmp_path / "kvtier-cache"
    config = write(
        tmp_path, f"chunk_tokens: 8\nsecondary_tiers:\n  - {{type: fs, root_dir: {root}}}\n"
    )
    result = CliRunner().invoke(
        cli, [command, str(config), "--chunks", "4", "--chunk-kib", "16"], env=WIDE
    )
    assert result.exit_code == 0, result.output
    assert root.is_dir()  # the tier did run there
    assert not list(root.rglob("*.kvc")), "probe chunks left behind"
