"""Chunk codecs on real KV: compression ratio, encode and decode GB/s per
core, against the tiers' own GB/s measured in the same run.

The KV comes from the demo's Llama-family model (``kvtier.demo.model``,
8 layers, 2 KV heads, head_dim 64) prefilling Python standard-library source
text, cast to bf16 and cut into chunks of ``--chunk-tokens``. Each codec
encodes and decodes every chunk on one thread (so GB/s are per core, of raw
KV bytes). In the same run the ``fs`` and ``memory`` tiers (and each
``--server`` tier, its server started on loopback for the run: Redis,
moto's S3 server for ``obj``, ``mooncake_master`` for ``mooncake``) store and
load the same chunks, with no codec and with each codec, end to end through
a tier harness (raw KV GB/s: a codec that shrinks chunks moves more KV per
second when the tier is the bottleneck), each against the same tier with no
codec. fs loads are served from the page cache here; ``--root`` picks the disk.
``memory-bounded`` rows bound every codec call (``codec_timeout_s``): what a
codec that may hang costs, against kvtier's own codecs called directly.

A codec pays on a tier's loads when decoding and moving fewer bytes beats
moving all of them: ``1/decode + 1/(ratio*S) < 1/S``, i.e. below the tier
speed ``S* = decode * (1 - 1/ratio)`` (per decoding core).

    python benchmarks/bench_codecs.py               # 2k tokens of KV
    python benchmarks/bench_codecs.py --server redis --server obj --server mooncake
    python benchmarks/bench_codecs.py --quick --json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.codecs import CodecStage, codec_config
from kvtier.layout import KVLayout
from kvtier.testing import TierHarness

#: Tiers whose server ``--server`` starts on loopback for the run.
SERVED_TIERS = ("redis", "obj", "mooncake")
#: Each tier's codecs, after none (its raw speed).
TIER_CODECS = ("lossless", "fp8", "int8", "int4")
#: A bench job moves far more than one request's chunks: let it finish, so
#: the rate measured is the tier's, not its per-request deadline's.
WHOLE_JOBS = {"deadline_s": 60}

CODECS: list[Any] = [
    "lossless",
    {"type": "lossless", "compressor": "lz4"},
    {"type": "lossless", "level": 3},
    "fp8",
    "int8",
    "int4",
]


def codec_label(codec: Any) -> str:
    if isinstance(codec, str):
        return codec
    options = ",".join(f"{k}={v}" for k, v in codec.items() if k != "type")
    return f"{codec['type']}({options})"


def stdlib_text(limit: int) -> bytes:
    """Python source of the standard library, the same bytes on every machine
    with this Python: ``os.py``, ``typing.py``... in name order."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    text = b""
    for path in files:
        text += Path(path).read_bytes()
        if len(text) >= limit:
            break
    return text[:limit]


def demo_kv(tokens: int, chunk_tokens: int) -> tuple[KVLayout, np.ndarray]:
    """``(layout, chunks)``: the demo model's bf16 KV of ``tokens`` tokens, one row a chunk."""
    import ml_dtypes
    import torch

    from kvtier.demo.model import SIZES, build_demo_model

    size = SIZES["default"]
    model = build_demo_model(size)
    ids = torch.tensor([list(stdlib_text(tokens))])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = getattr(cache, "layers", None)
    pairs = (
        [(layer.keys, layer.values) for layer in layers]
        if layers is not None
        else [(cache[i][0], cache[i][1]) for i in range(size.num_layers)]
    )
    # (layers, 2, heads, tokens, dim) -> (layers, 2, tokens, heads, dim)
    kv = torch.stack([torch.stack(pair) for pair in pairs])[:, :, 0].transpose(2, 3)
    values = kv.float().numpy()
    head_dim = values.shape[-1]
    layout = KVLayout(
        "kvtier-demo", size.num_layers, size.num_kv_heads, head_dim, "bfloat16", chunk_tokens
    )
    usable = tokens // chunk_tokens * chunk_tokens
    chunks = [
        values[:, :, start : start + chunk_tokens].astype(ml_dtypes.bfloat16).tobytes()
        for start in range(0, usable, chunk_tokens)
    ]
    return layout, np.stack([np.frombuffer(c, np.uint8) for c in chunks])


def measure_codec(codec: Any, layout: KVLayout, chunks: np.ndarray, repeat: int) -> dict[str, Any]:
    stage = CodecStage(codec_config(codec).build(layout), layout)
    buffers = [bytearray(stage.stored_bytes) for _ in chunks]
    lengths = [0] * len(chunks)
    raw = chunks.nbytes
    encode_s = decode_s = float("inf")
    out = memoryview(bytearray(layout.slot_bytes))
    worst = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        for i, chunk in enumerate(chunks):
            lengths[i] = stage.encode(memoryview(chunk), memoryview(buffers[i]))
        encode_s = min(encode_s, time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(len(chunks)):
            stage.decode(memoryview(buffers[i])[: lengths[i]], out)
        decode_s = min(decode_s, time.perf_counter() - start)
    exact = True
    for i, chunk in enumerate(chunks):
        stage.decode(memoryview(buffers[i])[: lengths[i]], out)
        if bytes(out) != chunk.tobytes():
            exact = False
            worst = max(worst, relative_error(layout, chunk, out))
    ratio = raw / sum(lengths)
    decode_gbps = raw / decode_s / 1e9
    return {
        "codec": codec_label(codec),
        "lossy": stage.lossy,
        "exact": exact,
        "ratio": round(ratio, 3),
        "encode_gbps": round(raw / encode_s / 1e9, 3),
        "decode_gbps": round(decode_gbps, 3),
        "pays_below_gbps": round(decode_gbps * (1 - 1 / ratio), 3),
        "worst_relative_error": round(worst, 5),
    }


def relative_error(layout: KVLayout, chunk: np.ndarray, decoded: memoryview) -> float:
    from kvtier.testing.codec_suite import decode_floats

    want = decode_floats(chunk.tobytes(), layout)
    got = decode_floats(bytes(decoded), layout)
    return float(np.abs(got - want).mean() / max(np.abs(want).mean(), 1e-12))


def measure_tier(
    tier: dict[str, Any], codec: Any, layout: KVLayout, chunks: np.ndarray, repeat: int
) -> dict[str, Any]:
    """Store then load every chunk through a tier; raw KV GB/s, best of ``repeat``."""
    label = tier.get("label", tier["type"])
    tier = {name: value for name, value in tier.items() if name != "label"}
    entry = dict(tier) if codec is None else {**tier, "codec": codec}
    store_s = load_s = float("inf")
    stored_bytes = 0
    for round_index in range(repeat):
        if "root_dir" in tier:  # a fresh directory: every round writes every chunk
            entry["root_dir"] = os.path.join(tier["root_dir"], f"{id(entry)}-{round_index}")
        harness = TierHarness(entry, layout, num_slots=2 * len(chunks))
        try:
            slots = list(range(len(chunks)))
            harness.buffer.array[: len(chunks)] = chunks
            keys = harness.keys(len(chunks))
            harness.store(keys[:1], [0])  # the workers run before the clock starts
            keys = keys[1:] + harness.keys(1)  # every timed chunk is new to the tier
            encoded_before = harness.tier.stats.codec_bytes_out
            start = time.perf_counter()
            stored = harness.store(keys, slots)
            store_s = min(store_s, time.perf_counter() - start)
            start = time.perf_counter()
            targets = [len(chunks) + s for s in slots]
            loaded = harness.load(keys, targets)
            load_s = min(load_s, time.perf_counter() - start)
            if not (stored.success and loaded.success):
                raise SystemExit(f"{tier['type']} with {codec}: a transfer failed")
            # What the tier stored per chunk (a variable-size codec's average).
            encoded = harness.tier.stats.codec_bytes_out - encoded_before
            stored_bytes = encoded // len(chunks) if encoded else harness.tier.stored_bytes
            harness.tier.discard(keys)  # a shared store keeps no round's chunks
        finally:
            harness.close()
    return {
        "tier": label,
        "codec": "none" if codec is None else codec_label(codec),
        "stored_bytes_per_chunk": stored_bytes,
        "store_gbps": round(chunks.nbytes / store_s / 1e9, 3),
        "load_gbps": round(chunks.nbytes / load_s / 1e9, 3),
    }


def against_raw(rows: list[dict[str, Any]]) -> None:
    """Each row's store and load speed as a fraction of its tier's with no codec."""
    raw = {row["tier"]: row for row in rows if row["codec"] == "none"}
    for row in rows:
        base = raw[row["tier"]]
        row["store_vs_none"] = round(row["store_gbps"] / base["store_gbps"], 3)
        row["load_vs_none"] = round(row["load_gbps"] / base["load_gbps"], 3)


@contextmanager
def served_tier(kind: str) -> Iterator[dict[str, Any]]:
    """A ``kind`` tier entry on its own server, started on loopback for the run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' servers
    from tests.support.servers import MooncakeMaster, RedisServer, S3Server

    if kind == "redis":
        with RedisServer() as redis:
            yield {"type": "redis", "url": redis.url, **WHOLE_JOBS}
    elif kind == "obj":
        with S3Server() as s3:
            bucket = s3.create_bucket("kvtier-bench-codecs")
            yield {"type": "obj", **s3.tier_options(bucket), **WHOLE_JOBS}
    else:
        with MooncakeMaster() as master:
            # The tier lends the pool a segment that holds one round's chunks.
            yield {**master.tier_options(), "global_segment_size": "256MiB", **WHOLE_JOBS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None, help="directory for the fs tier")
    parser.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="JSON",
        help='another tier entry to measure, e.g. \'{"type": "redis", "url": "redis://..."}\' '
        "(repeatable); it gets no codec, each fixed-size one, and lossless where it takes it",
    )
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        choices=SERVED_TIERS,
        help="also measure this tier on a server of its own, started on loopback (repeatable)",
    )
    parser.add_argument(
        "--save-kv",
        type=Path,
        help="also save the KV chunks as .npy (for kvtier simulate --codec NAME --kv PATH)",
    )
    parser.add_argument("--quick", action="store_true", help="256 tokens, one round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tokens, repeat = (256, 1) if args.quick else (args.tokens, args.repeat)
    layout, chunks = demo_kv(tokens, args.chunk_tokens)
    if args.save_kv is not None:
        import ml_dtypes

        shape = (len(chunks), *layout.chunk_shape)
        np.save(args.save_kv, chunks.view(ml_dtypes.bfloat16).reshape(shape))
    codecs = [measure_codec(codec, layout, chunks, repeat) for codec in CODECS]
    with tempfile.TemporaryDirectory(dir=args.root) as root, ExitStack() as servers:
        tiers = [
            {"type": "memory", "max_bytes": "1GiB"},
            # Every codec call on a helper thread, waited for at most 5 s
            # (what a codec that may hang costs; kvtier's own are called directly).
            {
                "type": "memory",
                "max_bytes": "1GiB",
                "codec_timeout_s": 5,
                "label": "memory-bounded",
            },
            {"type": "fs", "root_dir": root, "shared": False},
            *(json.loads(entry) for entry in args.tier),
            *(servers.enter_context(served_tier(kind)) for kind in args.server),
        ]
        tier_rows = [
            measure_tier(tier, codec, layout, chunks, repeat)
            for tier in tiers
            for codec in (None, *TIER_CODECS)
        ]
    against_raw(tier_rows)
    report = {
        "kv": {
            "model": "kvtier demo default (random init)",
            "tokens": int(chunks.shape[0] * args.chunk_tokens),
            "chunk_bytes": layout.slot_bytes,
            "chunks": int(chunks.shape[0]),
            "cores": os.cpu_count(),
        },
        "codecs": codecs,
        "tiers": tier_rows,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print(f"KV: {report['kv']}")
    print(f"{'codec':28} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'pays <':>7}  exact")
    for row in codecs:
        print(
            f"{row['codec']:28} {row['ratio']:6.2f} {row['encode_gbps']:9.3f} "
            f"{row['decode_gbps']:9.3f} {row['pays_below_gbps']:7.3f}  {row['exact']}"
        )
    print(
        f"{'tier':14} {'codec':8} {'stored/chunk':>12} {'store GB/s':>10} {'load GB/s':>10} "
        f"{'store/none':>10} {'load/none':>10}"
    )
    for row in tier_rows:
        print(
            f"{row['tier']:14} {row['codec']:8} {row['stored_bytes_per_chunk']:12} "
            f"{row['store_gbps']:10.3f} {row['load_gbps']:10.3f} "
            f"{row['store_vs_none']:10.2f} {row['load_vs_none']:10.2f}"
        )


if __name__ == "__main__":
    main()
