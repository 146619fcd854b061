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
from kvtier.demo.workload import RequestRecord, chat_workload

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
        eos_token_id: int | None = None

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


def test_a_directory_without_a_model_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no model here")
    result = CliRunner().invoke(cli, ["demo", "--quick", "--model", str(tmp_path)], env=WIDE)
    assert result.exit_code == 2
    assert f"cannot load a model from {tmp_path}" in result.output
    assert "Traceback" not in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_a_vocabulary_too_small_for_byte_tokens_is_a_clear_error(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    result = CliRunner().invoke(
        cli, ["demo", "--quick", "--model", str(tmp_path / "model")], env=WIDE
    )
    assert result.exit_code == 2
    assert "too small for byte tokens" in result.output
    assert isinstance(result.exception, SystemExit)


def _record(conversation: int, turn: int, ttft_s: float, reused: int) -> RequestRecord:
    return RequestRecord(conversation, turn, 64, 4, reused // 16, reused, (0,), 0, ttft_s, [1])


def test_each_rows_speed_up_agrees_with_its_columns() -> None:
    from kvtier.demo.report import summarise
    from kvtier.demo.workload import DemoRun

    # The first baseline request is slow (say a cold start) and is a kvtier miss:
    # the miss row compares it with itself, not with the baseline's overall mean.
    baseline = [_record(0, 0, 6.0, 0), _record(0, 1, 2.0, 0), _record(1, 1, 2.0, 0)]
    kvtier = [_record(0, 0, 5.0, 0), _record(0, 1, 0.5, 48), _record(1, 1, 1.0, 48)]
    rows = {row.label: row for row in summarise(DemoRun(baseline, kvtier, None), ["fs"])}
    miss = rows["kvtier: miss, prefill + store"]
    assert miss.baseline_ttft_s == 6.0 and miss.mean_ttft_s == 5.0
    assert miss.speedup == pytest.approx(1.2)
    hit = rows["kvtier: CPU-tier hit"]
    assert hit.baseline_ttft_s == 2.0 and hit.mean_ttft_s == 0.75
    assert hit.speedup == pytest.approx(hit.baseline_ttft_s / hit.mean_ttft_s)


def test_hits_slower_than_a_prefill_are_explained() -> None:
    from kvtier.demo.report import slow_hits_note, summarise
    from kvtier.demo.workload import DemoRun

    baseline = [_record(0, 0, 0.002, 0), _record(0, 1, 0.002, 0)]
    slow = [_record(0, 0, 0.003, 0), _record(0, 1, 0.004, 48)]
    note = slow_hits_note(summarise(DemoRun(baseline, slow, None), []))
    assert note is not None and "did not pay off" in note and "--quick" in note
    fast = [_record(0, 0, 0.003, 0), _record(0, 1, 0.001, 48)]
    assert slow_hits_note(summarise(DemoRun(baseline, fast, None), [])) is None


def test_the_quick_demo_says_why_its_hits_do_not_pay(tmp_path: Path) -> None:
    output = run_demo("--dir", str(tmp_path))
    speedups = [
        float(line.split("│")[-2].strip().rstrip("×"))
        for line in output.splitlines()
        if "-tier hit" in line
    ]
    assert speedups, output
    # Whatever this machine measures, a hit slower than a prefill never goes unexplained.
    assert ("did not pay off" in output) == any(s < 1 for s in speedups)


def test_a_model_context_shorter_than_the_workload_is_a_clear_error(tmp_path: Path) -> None:
    import transformers

    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    result = CliRunner().invoke(
        cli,
        ["demo", "--quick", "--model", str(tmp_path / "model"), "--dir", str(tmp_path / "kv")],
        env=WIDE,
    )
    assert result.exit_code == 2, result.output
    assert "more than the model's context of 64" in result.output
    assert "--system-tokens" in result.output
    assert isinstance(result.exception, SystemExit)


def test_a_model_failing_mid_workload_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.demo.workload

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("shape mismatch in attention")

    monkeypatch.setattr(kvtier.demo.workload, "run_demo", fail)
    result = CliRunner().invoke(cli, ["demo", "--quick", "--dir", str(tmp_path)], env=WIDE)
    assert result.exit_code == 1
    assert "the workload failed on the llama model: RuntimeError: shape mismatch" in result.output
    assert isinstance(result.exception, SystemExit)
