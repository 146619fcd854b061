"""What a lossy codec does to a trained model's outputs.

Trains (once, cached under ``--cache-dir``) a small byte-level Llama on the
Python standard library's sources, every machine's offline text, then for
held-out source files: prefills a prefix, passes its KV (bf16) through each
codec chunk by chunk exactly as a tier would (encode, decode), and reports
against the exact KV:

* perplexity of the next ``--continuation`` tokens given the prefix;
* next-token KL divergence (exact || codec), mean over those positions;
* greedy agreement: the share of ``--greedy`` greedily generated tokens that
  are the same with the codec's KV as with the exact KV.

Random weights say nothing about quantisation error, hence the training.
The model is tiny (a few hundred thousand parameters): its figures show how
the codecs rank and roughly how far each moves outputs, not what a 7B model
would lose.

    python benchmarks/bench_codec_quality.py               # trains ~minutes once
    python benchmarks/bench_codec_quality.py --quick --json
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.codecs import CodecStage, codec_config
from kvtier.layout import KVLayout

CODECS: list[Any] = ["lossless", "int8", "fp8", "int4", {"type": "int4", "group_size": 16}]
#: Held-out files: every tenth source file of the standard library, by name.
HOLD_OUT_EVERY = 10


def sources() -> tuple[bytes, list[bytes]]:
    """Training text and held-out files, split by file name."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    train: list[bytes] = []
    held_out: list[bytes] = []
    for index, path in enumerate(files):
        (held_out if index % HOLD_OUT_EVERY == 0 else train).append(Path(path).read_bytes())
    return b"\n".join(train), held_out


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def trained_model(args: argparse.Namespace, text: bytes) -> tuple[Any, dict[str, Any]]:
    """The model after ``args.steps`` steps, from the cache when trained before."""
    recipe = f"{args.hidden}-{args.layers}-{args.steps}-{args.seq}-{args.batch}-{len(text)}"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    path = Path(args.cache_dir).expanduser() / f"model-{digest}.pt"
    model = build_model(args)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["weights"])
        return model.eval(), saved["training"]
    data = torch.tensor(np.frombuffer(text, np.uint8).astype(np.int64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    losses = []
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:  # cosine decay after a short warm-up
            warm = min(1.0, (step + 1) / max(1, args.steps // 20))
            group["lr"] = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=generator)
        batch = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    training = {
        "steps": args.steps,
        "seconds": round(time.perf_counter() - started, 1),
        "final_loss_nats_per_byte": round(float(np.mean(losses[-20:])), 3),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": model.state_dict(), "training": training}, path)
    return model.eval(), training


def kv_layout(model: Any, chunk_tokens: int) -> KVLayout:
    config = model.config
    return KVLayout(
        "kvtier-quality-bench",
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
        "bfloat16",
        chunk_tokens,
    )


class Tally:
    """Bytes a codec was given and made, and whether it gave every byte back."""

    def __init__(self) -> None:
        self.raw = self.encoded = 0
        self.exact = True


def through_codec(
    cache: Any, stage: CodecStage | None, layout: KVLayout, tally: Tally | None = None
) -> Any:
    """A copy of ``cache`` whose KV went through ``stage`` chunk by chunk."""
    from transformers import DynamicCache

    pairs = [(layer.keys, layer.values) for layer in cache.layers]
    # (layers, 2, heads, tokens, dim) -> (layers, 2, tokens, heads, dim), as a slot holds it
    kv = torch.stack([torch.stack(pair) for pair in pairs])[:, :, 0].transpose(2, 3).contiguous()
    if stage is not None:
        raw = kv.view(torch.int16).numpy()
        tokens = raw.shape[2]
        out = np.empty_like(raw)
        for start in range(0, tokens, layout.chunk_tokens):
            chunk = np.ascontiguousarray(raw[:, :, start : start + layout.chunk_tokens])
            buffer = stage.scratch(1)[0]
            length = stage.encode(memoryview(chunk.tobytes()), buffer)
            decoded_bytes = bytearray(layout.slot_bytes)
            stage.decode(buffer[:length], memoryview(decoded_bytes))
            decoded = np.frombuffer(decoded_bytes, np.int16)
            if tally is not None:
                tally.raw += chunk.nbytes
                tally.encoded += length
                tally.exact = tally.exact and bytes(decoded_bytes) == chunk.tobytes()
            out[:, :, start : start + layout.chunk_tokens] = decoded.reshape(chunk.shape)
        kv = torch.from_numpy(out).view(torch.bfloat16)
    rebuilt = DynamicCache()
    for index in range(kv.shape[0]):
        keys = kv[index, 0].transpose(0, 1).unsqueeze(0).contiguous()
        values = kv[index, 1].transpose(0, 1).unsqueeze(0).contiguous()
        rebuilt.update(keys, values, index)
    return rebuilt


@torch.no_grad()
def evaluate(
    model: Any, inputs: torch.Tensor, cache: Any, greedy: int
) -> tuple[torch.Tensor, list[int]]:
    """Log-probabilities after each of ``inputs`` given the cached prefix; and
    the ``greedy`` tokens generated from the prefix and ``inputs``' first token."""
    import copy

    logits = model(inputs, past_key_values=copy.deepcopy(cache), use_cache=True).logits
    log_probs = torch.log_softmax(logits.float(), dim=-1)[0]
    tokens: list[int] = []
    step_cache = copy.deepcopy(cache)
    token = inputs[:, :1]
    for _ in range(greedy):
        out = model(token, past_key_values=step_cache, use_cache=True)
        step_cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
    return log_probs, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--greedy", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", default="~/.cache/kvtier/bench-codec-quality")
    parser.add_argument(
        "--quick", action="store_true", help="a 1-layer model, 2 training steps, 1 short sample"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.samples, args.prefix, args.continuation, args.greedy = 2, 1, 64, 16, 8
        args.hidden, args.layers, args.batch, args.seq = 64, 1, 2, 64
    torch.manual_seed(0)
    text, held_out = sources()
    model, training = trained_model(args, text)
    model = model.to(torch.bfloat16)
    layout = kv_layout(model, args.chunk_tokens)
    stages: dict[str, CodecStage | None] = {"none": None}
    for codec in CODECS:
        label = codec if isinstance(codec, str) else f"int4(group_size={codec['group_size']})"
        stages[label] = CodecStage(codec_config(codec).build(layout), layout)
    # The prefix is what a tier holds (whole chunks); the continuation is read after it.
    width = args.prefix + args.continuation + 1
    windows = [f[:width] for f in held_out if len(f) >= width][: args.samples]
    totals: dict[str, dict[str, float]] = {
        name: {"nll": 0.0, "kl": 0.0, "agree": 0.0} for name in stages
    }
    tallies = {name: Tally() for name in stages}
    positions = 0
    for window in windows:
        ids = torch.tensor([list(window)])
        inputs, targets = ids[:, args.prefix : -1], ids[0, args.prefix + 1 :]
        with torch.no_grad():
            cache = model(ids[:, : args.prefix], use_cache=True).past_key_values
        exact_lp, exact_tokens = evaluate(model, inputs, cache, args.greedy)
        positions += len(targets)
        for name, stage in stages.items():
            log_probs, tokens = (
                (exact_lp, exact_tokens)
                if stage is None
                else evaluate(
                    model, inputs, through_codec(cache, stage, layout, tallies[name]), args.greedy
                )
            )
            totals[name]["nll"] -= float(log_probs.gather(1, targets[:, None]).sum())
            totals[name]["kl"] += float((exact_lp.exp() * (exact_lp - log_probs)).sum())
            same = sum(a == b for a, b in zip(tokens, exact_tokens, strict=True))
            totals[name]["agree"] += same / len(tokens)
    results = [
        {
            "codec": name,
            "perplexity": round(math.exp(t["nll"] / positions), 4),
            "kl_nats": round(t["kl"] / positions, 6),
            "greedy_agreement": round(t["agree"] / len(windows), 4),
            # Of the prefixes' KV, as the tier would store it (codec header included).
            "ratio": round(tallies[name].raw / tallies[name].encoded, 3)
            if tallies[name].encoded
            else 1.0,
            "byte_exact": tallies[name].exact,
        }
        for name, t in totals.items()
    ]
    report = {
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            **training,
        },
        "samples": len(windows),
        "prefix_tokens": args.prefix,
        "continuation_tokens": args.continuation,
        "greedy_tokens": args.greedy,
        "results": results,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print(f"model: {report['model']}; {len(windows)} held-out files")
    print(f"{'codec':24} {'ratio':>6} {'perplexity':>10} {'KL nats':>10} {'greedy agree':>12}")
    for row in results:
        print(
            f"{row['codec']:24} {row['ratio']:6.2f} {row['perplexity']:10.4f} "
            f"{row['kl_nats']:10.6f} {row['greedy_agreement']:12.3f}"
        )


if __name__ == "__main__":
    main()
