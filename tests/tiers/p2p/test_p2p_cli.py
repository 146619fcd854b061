"""``kvtier peer`` and ``kvtier check`` with a p2p tier."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import cli
from tests.tiers.p2p.p2p_nodes import CHUNK_TOKENS, SECRET, PeerProcess


def write(path: Path, config: dict[str, object]) -> Path:
    path.write_text(json.dumps(config))
    return path


def test_check_probes_a_p2p_tier_with_lookups(
    tmp_path: Path, fleet: tuple[PeerProcess, PeerProcess]
) -> None:
    a, _ = fleet
    entry = {"type": "p2p", "secret": SECRET, "peers": [a.address], "listen": None}
    config = write(tmp_path / "c.json", {"chunk_tokens": CHUNK_TOKENS, "secondary_tiers": [entry]})
    result = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "64"])
    assert result.exit_code == 0, result.output
    assert "lookups answered" in result.output
    assert "peers_reachable=1" in result.output
    assert f"peer {a.address}" in result.output and "answers, authenticated" in result.output


def test_check_fails_for_a_peer_that_does_not_authenticate(
    tmp_path: Path, fleet: tuple[PeerProcess, PeerProcess]
) -> None:
    a, _ = fleet
    entry = {"type": "p2p", "secret": "another-fleet-secret", "peers": [a.address]}
    config = write(tmp_path / "c.json", {"chunk_tokens": CHUNK_TOKENS, "secondary_tiers": [entry]})
    result = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "64"])
    assert result.exit_code == 1, result.output
    assert "FAILED" in result.output and "secrets" in result.output


def test_peer_refuses_a_config_without_a_p2p_tier(tmp_path: Path) -> None:
    config = write(tmp_path / "m.json", {"secondary_tiers": [{"type": "memory"}]})
    result = CliRunner().invoke(cli, ["peer", str(config)])
    assert result.exit_code == 2
    assert "no p2p tier" in result.output


def test_peer_reports_an_invalid_config(tmp_path: Path) -> None:
    config = write(tmp_path / "bad.json", {"secondary_tiers": [{"type": "p2p"}]})
    result = CliRunner().invoke(cli, ["peer", str(config)])
    assert result.exit_code == 2
    assert "secondary_tiers[0].secret" in result.output


def test_peer_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    peer = PeerProcess(tmp_path, "S", chunks=1)
    assert peer.stop() == 0


def test_bench_skips_a_pull_only_tier(tmp_path: Path) -> None:
    entry = {"type": "p2p", "secret": SECRET, "listen": None}
    config = write(tmp_path / "p.json", {"chunk_tokens": CHUNK_TOKENS, "secondary_tiers": [entry]})
    result = CliRunner().invoke(cli, ["bench", str(config), "--chunks", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tiers"][0]["skipped"].startswith("a pull-only tier")


def test_peer_on_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        entry = {"type": "p2p", "secret": SECRET, "listen": f"127.0.0.1:{port}"}
        config = write(tmp_path / "p.json", {"secondary_tiers": [entry]})
        result = CliRunner().invoke(cli, ["peer", str(config)])
    assert result.exit_code == 1, result.output
    assert f"cannot start the node: OSError: [Errno {errno.EADDRINUSE}]" in result.output
    assert f"127.0.0.1:{port}" in result.output and "secondary_tiers[0]" in result.output
    assert isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chunk-kib", "0"], "'--chunk-kib': 0 is not in the range x>=1"),
        (["--chunk-kib", "-1"], "'--chunk-kib': -1 is not in the range x>=1"),
        (["--synthetic-chunks", "-1"], "'--synthetic-chunks': -1 is not in the range x>=0"),
    ],
)
def test_peer_refuses_bad_sizes_naming_the_option(
    tmp_path: Path, args: list[str], message: str
) -> None:
    entry = {"type": "p2p", "secret": SECRET, "listen": "127.0.0.1:0"}
    config = write(tmp_path / "p.json", {"secondary_tiers": [entry]})
    result = CliRunner().invoke(cli, ["peer", str(config), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
