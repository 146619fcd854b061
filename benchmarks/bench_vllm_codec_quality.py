"""Greedy continuations through vLLM with and without each lossy codec.

Takes the trained model of ``bench_codec_quality.py`` (trained there once and
cached), saves it for vLLM (float32, byte-level vocabulary), and runs vLLM
engines (the CPU build) through kvtier's connector on the first ``--prefix``
bytes of held-out files:

1. an engine stores every prompt's chunks to one ``fs`` tier per codec
   (``none``, ``int8``, ``fp8``, ``int4``) and generates ``--greedy`` tokens
   greedily: vLLM's own outputs, as it loaded nothing through kvtier;
2. for each codec, a fresh engine (vLLM's prefix cache off) with that tier
   alone loads every prompt's whole chunks through the codec and generates.

Reports the share of generated tokens equal position by position to the
exact run's, and the share of prompts whose continuation is identical.

With ``--serve`` each engine is a ``vllm serve`` process instead (the OpenAI
server on loopback, the prompts sent as token ids to ``/v1/completions``).

    python benchmarks/bench_vllm_codec_quality.py --samples 16
    python benchmarks/bench_vllm_codec_quality.py --serve --samples 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "integrations" / "vllm_engine.py"
CODECS = ("none", "int8", "fp8", "int4")
BLOCK_TOKENS = 32


def save_for_vllm(out: Path, cache_dir: str) -> Path:
    """The trained model as a float32 checkpoint with a byte-level tokenizer."""
    import torch
    from bench_codec_quality import sources, trained_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # bench_codec_quality's default recipe, so its cached model is reused.
    recipe = argparse.Namespace(
        hidden=128, layers=2, steps=400, seq=128, batch=16, lr=3e-3, cache_dir=cache_dir
    )
    text, _ = sources()
    model, _ = trained_model(recipe, text)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    vocab = {f"b{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="b0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="b0").save_pretrained(out)
    return out


def engine(work: Path, name: str, spec: dict[str, Any], *, serve: bool) -> dict[str, Any]:
    if serve:
        sys.path.insert(0, str(ENGINE.parents[2]))  # the checkout, for the tests' server runner
        from tests.integrations.vllm_engine import serve as run_served

        try:
            result = run_served(spec, work / f"{name}.log")
        except RuntimeError as exc:
            sys.exit(f"engine {name} failed: {exc}")
    else:
        result = in_process(work, name, spec)
    stats = work / f"{name}-stats.json"
    result["stats"] = json.loads(stats.read_text()) if stats.exists() else None
    if result["stats"] is None:
        sys.exit(f"engine {name} wrote no kvtier stats: see {work / f'{name}.log'}")
    return result


def in_process(work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_file, result_file = work / f"{name}-spec.json", work / f"{name}-result.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with (work / f"{name}.log").open("w") as log:
        done = subprocess.run(
            [sys.executable, str(ENGINE), str(spec_file), str(result_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if done.returncode:
        sys.exit(f"engine {name} failed: see {work / f'{name}.log'}")
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--greedy", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", default="~/.cache/kvtier/bench-codec-quality")
    parser.add_argument("--serve", action="store_true", help="run each engine as `vllm serve`")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.serve:
        # A SIGTERM stops the servers as Ctrl-C does, rather than orphaning them.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    from bench_codec_quality import sources

    _, held_out = sources()
    prompts = [list(f[: args.prefix]) for f in held_out if len(f) >= args.prefix]
    prompts = prompts[: args.samples]
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-quality-") as tmp:
        work = Path(tmp)
        model = save_for_vllm(work / "model", args.cache_dir)

        def spec(name: str, codecs: tuple[str, ...], **engine_options: Any) -> dict[str, Any]:
            tiers = [
                {"type": "fs", "root_dir": str(work / f"tier-{codec}"), "codec": codec}
                for codec in codecs
            ]
            return {
                "model": str(model),
                "prompts": prompts,
                "max_tokens": args.greedy,
                "block_size": BLOCK_TOKENS,
                "max_model_len": args.prefix + args.greedy + 1,
                "extra_config": {
                    "kvtier": {
                        "chunk_tokens": args.chunk_tokens,
                        "cpu_bytes_to_use": "64MiB",
                        "secondary_tiers": tiers,
                    },
                    "kvtier_stats_file": str(work / f"{name}-stats.json"),
                },
                **engine_options,
            }

        exact = engine(work, "store", spec("store", CODECS), serve=args.serve)
        assert exact["stats"]["connector"]["hit_tokens"] == 0, "the storing engine loaded"
        served = (args.prefix - 1) // args.chunk_tokens * args.chunk_tokens
        results = []
        for codec in CODECS:
            run = engine(work, codec, spec(codec, (codec,), prefix_caching=False), serve=args.serve)
            # The prefix came through the codec, not recomputed: vLLM counts it
            # cached, and the codec's tier counts its chunks loaded.
            (tier,) = run["stats"]["tiers"]
            chunks = served // args.chunk_tokens * len(prompts)
            if run["cached"] != [served] * len(prompts) or tier["chunks_loaded"] < chunks:
                sys.exit(
                    f"{codec}: not every prefix loaded through the codec: vLLM counted "
                    f"{run['cached']} cached tokens (want {served} each), the tier "
                    f"{tier['chunks_loaded']} chunks loaded (want {chunks})"
                )
            same = [
                sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
                for got, want in zip(run["tokens"], exact["tokens"], strict=True)
            ]
            stored = exact["stats"]["tiers"][CODECS.index(codec)]
            results.append(
                {
                    "codec": codec,
                    # Raw KV over stored payload (codec header included).
                    "ratio": round(stored["codec_bytes_in"] / stored["codec_bytes_out"], 3)
                    if stored["codec_bytes_out"]
                    else 1.0,
                    "greedy_agreement": round(sum(same) / len(same), 4),
                    "identical_continuations": round(sum(s == 1.0 for s in same) / len(same), 4),
                    "chunks_loaded": tier["chunks_loaded"],
                    "codec_failures": tier["codec_failures"],
                }
            )
    report = {
        "mode": "vllm serve" if args.serve else "in process",
        "samples": len(prompts),
        "prefix_tokens": args.prefix,
        "served_tokens": served,
        "greedy_tokens": args.greedy,
        # A sanity check that vLLM runs the trained model: Python source.
        "first_continuation": bytes(exact["tokens"][0]).decode("latin-1"),
        "results": results,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print(f"{len(prompts)} prompts of {args.prefix} tokens, {served} served by kvtier")
    print(f"{'codec':8} {'ratio':>6} {'greedy agree':>12} {'identical':>10}")
    for row in results:
        print(
            f"{row['codec']:8} {row['ratio']:6.2f} {row['greedy_agreement']:12.3f} "
            f"{row['identical_continuations']:10.3f}"
        )


if __name__ == "__main__":
    main()
