"""``kvtier bench`` and ``kvtier check`` on real tiers."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from kvtier.cli import cli
from kvtier.cli.memory import available_memory, refuse_beyond_memory
from kvtier.testing import restore_registries
from kvtier.tiers import HealthCheck, register_tier, tier_registry
from kvtier.tiers.memory import MemoryTier


def write_config(tmp_path: Path, *tiers: dict[str, Any]) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"chunk_tokens": 16, "secondary_tiers": list(tiers)}))
    return str(path)


def bench_json(config: str, *args: str, exit_code: int = 0) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["bench", config, "--json", *args])
    assert result.exit_code == exit_code, result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def assert_sane(entry: dict[str, Any], chunks: int, chunk_bytes: int) -> None:
    for phase in ("store", "lookup", "load"):
        result = entry[phase]
        assert result["failures"] == 0
        assert result["chunks"] == chunks
        assert result["seconds"] > 0 and result["chunks_per_s"] > 0
        latency = result["latency_ms"]
        assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    for phase in ("store", "load"):
        assert entry[phase]["bytes"] == chunks * chunk_bytes
        assert entry[phase]["ops"] == -(-chunks // 4)  # one job per batch of 4
        assert entry[phase]["mb_per_s"] > 0 and entry[phase]["vs_copy"] > 0
    assert entry["lookup"]["ops"] == chunks


def test_bench_json_on_the_memory_tier(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"type": "memory", "max_bytes": "64MiB"})
    report = bench_json(config, "--chunks", "10", "--chunk-kib", "64", "--batch", "4")
    assert report["chunk_bytes"] == 64 * 1024 and report["chunks"] == 10
    assert report["copy_mb_per_s"] > 0
    [entry] = report["tiers"]
    assert entry["tier_type"] == "memory"
    assert_sane(entry, 10, 64 * 1024)


@pytest.mark.skipif(
    "fs" not in tier_registry.registered_names(), reason="the fs tier is not built in yet"
)
def test_bench_json_on_the_fs_tier(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, {"type": "memory"}, {"type": "fs", "root_dir": str(tmp_path / "fs")}
    )
    report = bench_json(
        config, "--chunks", "10", "--chunk-kib", "64", "--batch", "4", "--tier", "1"
    )
    [entry] = report["tiers"]
    assert entry["tier"] == 1 and entry["tier_type"] == "fs"
    assert_sane(entry, 10, 64 * 1024)


def test_bench_reports_a_failing_tier_and_exits_non_zero(tmp_path: Path) -> None:
    faulty = {"type": "FaultyTier", "module_path": "kvtier.testing.faults", "fail_rate": 1.0}
    with restore_registries():
        config = write_config(tmp_path, {"type": "memory"}, faulty)
        report = bench_json(config, "--chunks", "4", "--chunk-kib", "16", exit_code=1)
    memory, broken = report["tiers"]
    assert memory["store"]["failures"] == 0
    assert broken["store"]["failures"] == 4 and broken["store"]["chunks"] == 0
    assert broken["lookup"]["failures"] == 4 and broken["load"]["failures"] == 4


def test_bench_table_and_bad_tier_index(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"type": "memory"})
    shown = CliRunner().invoke(
        cli, ["bench", config, "--chunks", "4", "--chunk-kib", "16"], env={"COLUMNS": "80"}
    )
    assert shown.exit_code == 0, shown.output
    assert (
        "store" in shown.stdout and "load" in shown.stdout and "latency of one job" in shown.stdout
    )
    # At 80 columns every header and cell is whole: nothing is cut to an ellipsis.
    assert "…" not in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    for header in ("chunks/s", "MB/s", "×copy", "p50", "p90", "p99", "fail"):
        assert header in shown.stdout
    wrong = CliRunner().invoke(cli, ["bench", config, "--tier", "3"])
    assert wrong.exit_code == 2 and "no tier 3" in wrong.output


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("bench", ["--timeout", "0"], "'--timeout': 0.0 is not in the range x>0"),
        ("bench", ["--timeout", "-1"], "'--timeout': -1.0 is not in the range x>0"),
        ("bench", ["--timeout", "nan"], "'--timeout': 'nan' is not a number of seconds"),
        ("check", ["--timeout", "nan"], "'--timeout': 'nan' is not a number of seconds"),
        ("bench", ["--chunks", "0"], "'--chunks': 0 is not in the range x>=1"),
        ("bench", ["--batch", "-2"], "'--batch': -2 is not in the range x>=1"),
        ("bench", ["--chunk-kib", "0"], "'--chunk-kib': 0 is not in the range x>=1"),
        ("bench", ["--tier", "-1"], "no tier -1: .* names 1 tier \\(indexes 0 to 0\\)"),
    ],
)
def test_bad_options_name_the_option_and_run_nothing(
    tmp_path: Path, command: str, args: list[str], message: str
) -> None:
    config = write_config(tmp_path, {"type": "memory"})
    result = CliRunner().invoke(cli, [command, config, *args])
    assert result.exit_code == 2, result.output
    assert re.search(message, result.output), result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_bench_runs_a_tier_named_twice_once(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"type": "memory"})
    report = bench_json(config, "--chunks", "4", "--chunk-kib", "16", "--tier", "0", "--tier", "0")
    assert [entry["tier"] for entry in report["tiers"]] == [0]


class _ReadOnlyTier(MemoryTier):
    def health(self) -> Sequence[HealthCheck]:
        return (
            HealthCheck("reachable", True, "answers"),
            HealthCheck("writable", False, "permission denied: /nowhere"),
        )


class _CrashingHealthTier(MemoryTier):
    def health(self) -> Sequence[HealthCheck]:
        raise OSError("disk vanished")


def test_check_runs_each_tiers_health_checks(tmp_path: Path) -> None:
    with restore_registries():
        register_tier("read_only", __name__, "_ReadOnlyTier")
        register_tier("crashing", __name__, "_CrashingHealthTier")
        config = write_config(tmp_path, {"type": "memory"}, {"type": "read_only"})
        result = CliRunner().invoke(cli, ["check", config, "--chunk-kib", "16"], terminal_width=200)
        assert result.exit_code == 1, result.output
        assert "permission denied: /nowhere" in result.stdout and "FAILED" in result.stdout
        assert result.stdout.count("byte-exact") == 2  # both round trips still ran

        config = write_config(tmp_path, {"type": "crashing"})
        result = CliRunner().invoke(cli, ["check", config, "--chunk-kib", "16"], terminal_width=200)
        assert result.exit_code == 1 and "OSError: disk vanished" in result.stdout

    healthy = write_config(tmp_path, {"type": "memory"})
    result = CliRunner().invoke(cli, ["check", healthy, "--chunk-kib", "16"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "capacity" in result.stdout and "byte-exact" in result.stdout


# 2**30 KiB (1 TiB) chunks: beyond any machine that runs these tests.
@pytest.mark.parametrize("command", ["check", "bench"])
def test_sizes_beyond_the_available_memory_are_refused_before_any_tier_starts(
    tmp_path: Path, command: str
) -> None:
    root = tmp_path / "never-created"
    config = write_config(tmp_path, {"type": "fs", "root_dir": str(root)})
    result = CliRunner().invoke(
        cli, [command, config, "--chunks", "3", "--chunk-kib", str(2**30)], terminal_width=200
    )
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "--chunks 3 × --chunk-kib 1073741824 needs" in message
    assert "of memory" in message and "available (" in message
    assert "lower --chunks or --chunk-kib" in message
    assert not root.exists()  # refused before the fs tier made its directory


def test_available_memory_is_the_lower_of_memavailable_and_the_cgroup_allowance(
    tmp_path: Path,
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == (8000000 * 1024, f"MemAvailable in {meminfo}")
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory(meminfo, cgroup) == (8000000 * 1024, f"MemAvailable in {meminfo}")
    (cgroup / "memory.max").write_text(f"{3 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert available_memory(meminfo, cgroup) == (
        2 << 30,
        f"the cgroup limit in {cgroup}/memory.max",
    )


def test_a_v1_cgroup_bounds_the_memory_at_its_root_or_in_the_process_own_group(
    tmp_path: Path,
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    8000000 kB\n")
    cgroup, own = tmp_path / "cgroup", tmp_path / "self-cgroup"
    group = cgroup / "memory" / "engines" / "a"
    group.mkdir(parents=True)
    own.write_text("4:memory:/engines/a\n1:cpu:/\n0::/\n")
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text(f"{5 << 30}\n")
    assert available_memory(meminfo, cgroup, own)[1] == f"MemAvailable in {meminfo}"  # type: ignore[index]
    (group / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (group / "memory.usage_in_bytes").write_text(f"{3 << 30}\n")
    limit = group / "memory.limit_in_bytes"
    assert available_memory(meminfo, cgroup, own) == (1 << 30, f"the cgroup limit in {limit}")
    # Taken whole, the limit: what the group uses holds page cache the kernel gives back.
    assert available_memory(meminfo, cgroup, own, less_used=False) == (
        4 << 30,
        f"the cgroup limit in {limit}",
    )


def test_sizes_within_the_available_memory_pass_and_beyond_it_name_both_options() -> None:
    available = (10 << 20, "MemAvailable in /proc/meminfo")
    refuse_beyond_memory(10 << 20, 20, 512, "why", available)  # exactly fits: no error
    with pytest.raises(click.UsageError) as refused:
        refuse_beyond_memory((10 << 20) + 1, 20, 512, "its primary tier", available)
    assert str(refused.value) == (
        "--chunks 20 × --chunk-kib 512 needs 10.0 MiB of memory (its primary tier), more "
        "than the 10.0 MiB available (MemAvailable in /proc/meminfo); lower --chunks or "
        "--chunk-kib"
    )
