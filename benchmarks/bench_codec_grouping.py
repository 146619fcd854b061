"""How the lossy codecs' grouping changes their error on a trained model's KV.

Takes the trained model of ``bench_codec_quality.py`` (trained there once and
cached), prefills 256 tokens of held-out files, and lays each 32-token chunk
out three ways: kvtier's default order (``layer,kv,token,head,dim``, where the
codecs group by head vector, or KIVI's way for int4), and as an engine's
pages in an order the codecs cannot know (vLLM's: per layer, blocks of 16
tokens, each ``kv,head,token,dim``; and the same with keys transposed to
``head,dim,token``, as some of vLLM's CPU kernels keep them), where they group
consecutive elements. Reports each codec's ratio and mean relative error
(mean absolute error over mean absolute value, all chunks).

    python benchmarks/bench_codec_grouping.py --samples 16
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from bench_codec_quality import sources, trained_model

from kvtier.codecs import CodecStage, codec_config
from kvtier.codecs.samples import decode_floats, encode_floats
from kvtier.layout import KVLayout

CHUNK_TOKENS = 32
BLOCK_TOKENS = 16
ORDERS = ("default", "pages", "pages, keys transposed")
CODECS: list[Any] = [
    *({"type": "int8", "group_size": g} for g in (None, 16, 32, 64, 128, 256)),
    *({"type": "fp8", "group_size": g} for g in (None, 32, 64, 128)),
    *({"type": "int4", "group_size": g} for g in (16, 32, 64)),
]


def prefix_kv(model: Any, files: list[bytes], tokens: int) -> list[np.ndarray]:
    """Each file's prefix KV as float32 ``(layers, 2, tokens, heads, dim)``."""
    kvs = []
    with torch.no_grad():
        for text in files:
            cache = model(torch.tensor([list(text[:tokens])]), use_cache=True).past_key_values
            pairs = [torch.stack((layer.keys, layer.values)) for layer in cache.layers]
            kvs.append(torch.stack(pairs)[:, :, 0].transpose(2, 3).float().numpy())
    return kvs


def chunks(kvs: list[np.ndarray], order: str) -> Iterator[np.ndarray]:
    """Chunks of ``CHUNK_TOKENS`` in ``order`` (see the module docstring)."""
    for kv in kvs:
        layers, _, tokens, heads, dim = kv.shape
        for start in range(0, tokens, CHUNK_TOKENS):
            chunk = kv[:, :, start : start + CHUNK_TOKENS]
            if order == "default":
                yield chunk
                continue
            blocks = CHUNK_TOKENS // BLOCK_TOKENS
            # (layer, block, kv, head, token, dim)
            pages = chunk.reshape(layers, 2, blocks, BLOCK_TOKENS, heads, dim)
            pages = pages.transpose(0, 2, 1, 4, 3, 5)
            if order == "pages":
                yield pages
                continue
            keys = pages[:, :, 0].transpose(0, 1, 2, 4, 3).reshape(layers, blocks, -1)
            yield np.stack((keys, pages[:, :, 1].reshape(layers, blocks, -1)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--cache-dir", default="~/.cache/kvtier/bench-codec-quality")
    args = parser.parse_args()
    # bench_codec_quality's default recipe, so its cached model is reused.
    recipe = argparse.Namespace(
        hidden=128, layers=2, steps=400, seq=128, batch=16, lr=3e-3, cache_dir=args.cache_dir
    )
    text, held_out = sources()
    model, _ = trained_model(recipe, text)
    files = [f for f in held_out if len(f) >= args.tokens][: args.samples]
    kvs = prefix_kv(model, files, args.tokens)
    layers, _, _, heads, dim = kvs[0].shape
    print(f"{len(files)} files, {args.tokens} tokens; head_dim {dim}")
    print(f"{'order':24} {'codec':10} {'grouping':12} {'group':>6} {'ratio':>6} {'error %':>8}")
    for order in ORDERS:
        kv_order = "layer,kv,token,head,dim" if order == "default" else "vllm-like-pages"
        layout = KVLayout("m", layers, heads, dim, "bfloat16", CHUNK_TOKENS, kv_order=kv_order)
        for entry in CODECS:
            entry = {k: v for k, v in entry.items() if v is not None}
            stage = CodecStage(codec_config(entry).build(layout), layout)
            error = magnitude = 0.0
            raw = encoded = 0
            for chunk in chunks(kvs, order):
                data = encode_floats(np.ascontiguousarray(chunk), layout)
                exact = decode_floats(data, layout)
                buffer = stage.scratch(1)[0]
                length = stage.encode(memoryview(data), buffer)
                decoded = bytearray(layout.slot_bytes)
                stage.decode(buffer[:length], memoryview(decoded))
                error += float(np.abs(decode_floats(decoded, layout) - exact).sum())
                magnitude += float(np.abs(exact).sum())
                raw, encoded = raw + len(data), encoded + length
            params = stage.codec.params()
            print(
                f"{order:24} {entry['type']:10} {params['grouping']:12} "
                f"{params['group_size']:6} {raw / encoded:6.2f} {100 * error / magnitude:8.2f}"
            )


if __name__ == "__main__":
    main()
