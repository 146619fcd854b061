"""``kvtier check``: validates, starts every tier, round-trips chunks."""

from pathlib import Path

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
