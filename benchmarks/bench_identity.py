"""Start-up cost of kvtier's model identity on the layout of a large checkpoint.

Writes sparse ``*.safetensors`` shards with valid headers for a model shape
(no data blocks are allocated, so a 140 GB layout takes a few MB of disk),
then times :func:`kvtier.identity.weights_identity` over them. Reads of
holes cost no device I/O: the figure is the CPU and system-call cost, that
of a checkpoint in the page cache (as it is right after the engine loaded
it). On a cold cache each read is one random read of the device; the
number of reads is printed so its latency can be multiplied in.

    python benchmarks/bench_identity.py --root /tmp/kvtier-identity-bench
    python benchmarks/bench_identity.py --preset moe   # DeepSeek-V3-like: 256 experts
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import time
from collections.abc import Iterator
from pathlib import Path

from kvtier.identity import weights
from kvtier.identity.weights import weights_identity

#: (layers, hidden, intermediate, kv_heads, head_dim, vocab, experts, shard GB)
PRESETS = {
    "llama-70b": (80, 8192, 28672, 8, 128, 128256, 0, 5.0),
    "llama-405b": (126, 16384, 53248, 8, 128, 128256, 0, 5.0),
    "moe": (61, 7168, 2048, 1, 576, 129280, 256, 4.3),
}


def tensors(
    layers: int, hidden: int, inter: int, kv: int, head: int, vocab: int, experts: int
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of a Llama-like (or MoE) decoder, bf16."""
    yield "model.embed_tokens.weight", (vocab, hidden)
    for layer in range(layers):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (hidden,)
        yield f"{p}.post_attention_layernorm.weight", (hidden,)
        yield f"{p}.self_attn.q_proj.weight", (hidden, hidden)
        yield f"{p}.self_attn.k_proj.weight", (kv * head, hidden)
        yield f"{p}.self_attn.v_proj.weight", (kv * head, hidden)
        yield f"{p}.self_attn.o_proj.weight", (hidden, hidden)
        if experts:
            yield f"{p}.mlp.gate.weight", (experts, hidden)
            for e in range(experts):
                for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                    ("down", (hidden, inter))):  # fmt: skip
                    yield f"{p}.mlp.experts.{e}.{proj}_proj.weight", shape
        else:
            yield f"{p}.mlp.gate_proj.weight", (inter, hidden)
            yield f"{p}.mlp.up_proj.weight", (inter, hidden)
            yield f"{p}.mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def write_layout(root: Path, preset: str) -> tuple[int, int, int]:
    """Sparse shards of ``preset`` under ``root``; returns (files, tensors, bytes)."""
    *shape, shard_gb = PRESETS[preset]
    limit = int(shard_gb * 1e9)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors(*shape):
        nbytes = 2 * _prod(dims)
        if size and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    root.mkdir(parents=True, exist_ok=True)
    total = count = 0
    for index, members in enumerate(shards):
        header, offset = {}, 0
        for name, dims in members:
            nbytes = 2 * _prod(dims)
            header[name] = {
                "dtype": "BF16",
                "shape": list(dims),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = root / f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            out.truncate(8 + len(raw) + offset)
        total += 8 + len(raw) + offset
        count += len(members)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "layers": shape[0]}))
    return len(shards), count, total


def _prod(dims: tuple[int, ...]) -> int:
    result = 1
    for dim in dims:
        result *= dim
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path("/tmp/kvtier-identity-bench"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-70b")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the sparse files")
    args = parser.parse_args()
    root = args.root / args.preset
    try:
        files, count, total = write_layout(root, args.preset)
        seconds = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            identity = weights_identity(root)
            seconds.append(time.perf_counter() - began)
        reads = files * weights.FILE_WINDOWS + count * 3 + files  # windows + headers
        print(
            f"{args.preset}: {files} files, {count} tensors, {total / 1e9:.1f} GB; "
            f"read {identity.bytes_read / 1e6:.1f} MB in about {reads} reads; "
            f"median {statistics.median(seconds) * 1e3:.0f} ms "
            f"(min {min(seconds) * 1e3:.0f} ms) over {args.repeat} runs"
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
