"""``kvtier demo`` end to end, on its reduced (``--quick``) workload."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers", reason="needs the 'transformers' extra")

from kvtier.cli import cli
from kvtier.demo.model import SIZES, ByteTokenizer
from kvtier.demo.workload import chat_workload

WIDE = {"COLUMNS": "160"}


def run_demo(*args: str) -> str:
    result = CliRunner().invoke(cli, ["demo", "--quick", *args], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.output


def test_demo_runs_end_to_end_and_checks_outputs(tmp_path: Path) -> None:
    output = run_demo("--dir", str(tmp_path))
    assert "✓ greedy outputs identical with and without kvtier (8 requests" in output
    assert "no kvtier: full prefill" in output
    assert "kvtier: miss, prefill + store" in output
    assert "kvtier: CPU-tier hit" in output
    assert "kvtier: fs-tier hit *" in output  # the phase with the CPU tier emptied
    assert "Tiers: chunks and bytes" in output and "0: fs" in output
    assert "run it again" in output
    assert any((tmp_path / "fs").rglob("*")), "the fs tier wrote nothing"


def test_a_second_run_in_a_new_process_is_served_from_the_fs_tier(tmp_path: Path) -> None:
    run_demo("--dir", str(tmp_path))
    second = subprocess.run(
        [sys.executable, "-c", "from kvtier.cli import main; main()", "demo", "--quick",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, **WIDE}, timeout=600,
    )  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    output = second.stdout
    assert "served from the fs tier of an earlier run" in output
    assert "kvtier: miss" not in output
    assert "✓ greedy outputs identical with and without kvtier" in output


def test_demo_runs_any_configuration(tmp_path: Path) -> None:
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "chunk_tokens: 32\ncpu_bytes_to_use: 8MiB\nsecondary_tiers:\n"
        "  - {type: memory, max_bytes: 1MiB}\n  - {type: memory, max_bytes: 16MiB}\n"
    )
    output = run_demo("--config", str(config), "--turns", "1", "--system-tokens", "100")
    assert "chunks of 32 tokens" in output
    assert "0: memory" in output and "1: memory" in output
    assert "✓ greedy outputs identical with and without kvtier (4 requests" in output


def test_demo_rejects_an_invalid_configuration(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("chunk_tokns: 32\n")
    result = CliRunner().invoke(cli, ["demo", "--quick", "--config", str(config)])
    assert result.exit_code == 2
    assert "chunk_tokns" in result.output and "chunk_tokens" in result.output


def test_the_workload_is_deterministic_and_sized_as_asked() -> None:
    size = SIZES["quick"]
    make = lambda: chat_workload(  # noqa: E731
        ByteTokenizer(), system_tokens=300, conversations=3, turns=2, new_tokens=size.new_tokens
    )
    first, second = make(), make()
    assert len(first.system) == 300
    assert first == second
    assert first.requests == 6
    # Conversations ask different things after the shared system prompt.
    assert len({tuple(turns[0]) for turns in first.user_turns}) > 1


def test_a_reply_that_differs_from_the_baseline_is_reported() -> None:
    from kvtier.demo.workload import DemoRun, RequestRecord

    def record(tokens: list[int], conversation: int = 0) -> RequestRecord:
        return RequestRecord(conversation, 0, 40, 2, 2, 32, (0,), 0, 0.1, tokens)

    baseline = [record([1, 2]), record([3, 4], 1)]
    same = DemoRun(baseline, [record([1, 2]), record([3, 4], 1)], [record([1, 2]), record([3, 4])])
    assert same.mismatches() == []
    differs = DemoRun(baseline, [record([1, 2]), record([3, 5], 1)], None)
    assert differs.mismatches() == [("kvtier", 1)]


def test_demo_runs_a_local_model_directory(tmp_path: Path) -> None:
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    output = run_demo("--model", str(tmp_path / "model"), "--dir", str(tmp_path / "kv"))
    assert f"loaded from {tmp_path / 'model'}" in output
    assert "model qwen2, 2 layers, 2 KV heads × 16" in output
    assert "✓ greedy outputs identical with and without kvtier" in output


def test_a_tokenizer_that_encodes_nothing_is_an_error() -> None:
    class Silent:
        eos_token_id = None

        def encode(self, text: str) -> list[int]:
            return []

    with pytest.raises(ValueError, match="no tokens"):
        chat_workload(Silent(), system_tokens=10, conversations=1, turns=1, new_tokens=1)


@pytest.mark.parametrize(
    ("reused", "hit_chunks", "promoted", "expected"),
    [
        (0, 0, (0,), "miss"),
        (32, 2, (0,), "CPU"),
        (32, 2, (2,), "fs"),
        (32, 2, (1,), "CPU+fs"),
    ],
)
def test_a_request_is_labelled_by_where_its_prefix_came_from(
    reused: int, hit_chunks: int, promoted: tuple[int, ...], expected: str
) -> None:
    from kvtier.demo.workload import RequestRecord

    record = RequestRecord(0, 0, 40, 2, hit_chunks, reused, promoted, 0, 0.1, [1])
    assert record.source(["fs"]) == expected
