"""Drive a lone tier through store, lookup and load: shared by ``kvtier bench``
and ``kvtier check`` (and usable by tools without an engine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.codecs.samples import kv_like
from kvtier.config.model import KVTierConfig
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.layout import KVLayout
from kvtier.tiers.base import JobResult, Lookup, SecondaryTier, TransferJob
from kvtier.tiers.drive import resolve_lookup, run_job


def probe_layout(chunk_tokens: int, slot_kib: int, *, floats: bool = False) -> KVLayout:
    """A synthetic layout whose chunks are ``slot_kib`` KiB (for tools without an engine).

    ``floats``: bf16 KV, as codecs that quantise need, instead of raw bytes.
    """
    # One layer, one head: K and V take 2 elements per token per head_dim unit.
    width = 2 if floats else 1
    per_token = max(1, slot_kib * 1024 // chunk_tokens // 2 // width)
    return KVLayout(
        model_id="kvtier-probe",
        num_layers=1,
        num_kv_heads=1,
        head_dim=per_token,
        dtype="bfloat16" if floats else "uint8",
        chunk_tokens=chunk_tokens,
    )


def needs_floats(settings: KVTierConfig) -> bool:
    """Whether any tier has a codec: probe chunks are then bf16 KV, which every
    built-in codec takes (raw bytes are no valid input to a quantising one)."""
    return any(tier.codec is not None for tier in settings.secondary_tiers)


def codec_facts(tier: SecondaryTier) -> dict[str, Any]:
    """The tier's codec and what it made of the chunks it stored so far."""
    stage = tier.codec_stage
    stats = tier.stats
    facts: dict[str, Any] = {
        "codec": stage.name,
        "lossy": stage.lossy,
        "params": stage.codec.params(),
        "bytes_in": stats.codec_bytes_in,
        "bytes_out": stats.codec_bytes_out,
        "ratio": round(stats.codec_bytes_in / stats.codec_bytes_out, 3)
        if stats.codec_bytes_out
        else None,
        "failures": stats.codec_failures,
        "refused": stats.codec_refused,
    }
    return facts


def codec_speed(tier: SecondaryTier, layout: KVLayout, chunks: int = 4) -> dict[str, float]:
    """The tier's codec on one thread, on probe chunks: MB/s of raw KV decoded,
    and the tier speed (MB/s per decoding worker) below which it pays on loads:
    ``decode * (1 - 1/ratio)``."""
    stage = tier.codec_stage
    rng = np.random.default_rng()
    samples = [kv_like(layout, int(seed)) for seed in rng.integers(0, 2**31, chunks)]
    if layout.dtype == "uint8":
        samples = [rng.integers(0, 256, layout.slot_bytes, dtype=np.uint8).tobytes()]
    buffer = stage.scratch(1)[0]
    out = memoryview(bytearray(layout.slot_bytes))
    # Once untimed: the first call pays for the coder's set-up and page faults.
    stage.decode(buffer[: stage.encode(memoryview(samples[0]), buffer)], out)
    encoded = decode_s = 0.0
    for sample in samples:
        length = stage.encode(memoryview(sample), buffer)
        encoded += length
        started = time.perf_counter()
        stage.decode(buffer[:length], out)
        decode_s += time.perf_counter() - started
    raw = len(samples) * layout.slot_bytes
    decode = raw / decode_s / 1e6
    return {
        "decode_mb_per_s": round(decode, 1),
        "pays_below_mb_per_s": round(decode * (1 - encoded / raw), 1),
    }


PHASES = ("store", "lookup", "load")
#: Bytes at the start of each chunk that carry its index, so loads are checked.
_STAMP = 8


@dataclass
class Phase:
    """One phase on one tier: per-operation latencies and totals."""

    latencies: list[float] = field(default_factory=list)
    chunks: int = 0
    nbytes: int = 0
    failures: int = 0
    seconds: float = 0.0

    def summary(self, baseline_mb_per_s: float) -> dict[str, Any]:
        p50, p90, p99 = (
            np.percentile(self.latencies, [50, 90, 99]) * 1e3 if self.latencies else [0.0] * 3
        )
        mb_per_s = self.nbytes / self.seconds / 1e6 if self.seconds else 0.0
        return {
            "ops": len(self.latencies),
            "chunks": self.chunks,
            "bytes": self.nbytes,
            "failures": self.failures,
            "seconds": self.seconds,
            "chunks_per_s": self.chunks / self.seconds if self.seconds else 0.0,
            "mb_per_s": mb_per_s,
            "vs_copy": mb_per_s / baseline_mb_per_s if baseline_mb_per_s else 0.0,
            "latency_ms": {"p50": float(p50), "p90": float(p90), "p99": float(p99)},
        }


def bench_tier(
    tier: SecondaryTier,
    slots: np.ndarray,
    layout: KVLayout,
    *,
    chunks: int,
    batch: int,
    timeout: float,
    advance: Callable[[str, int], None] = lambda phase, n: None,
) -> dict[str, Phase]:
    """Store, look up and load ``chunks`` fresh chunks; ``slots`` holds ``2 * batch`` slots.

    Stores read slots ``[0, batch)``; loads land in ``[batch, 2 * batch)``,
    zeroed first, so a load can only pass with the tier's own bytes.
    """
    rng = np.random.default_rng()
    tokens = rng.integers(0, 2**31, chunks * layout.chunk_tokens)
    keys = chunk_keys(layout.namespace, tokens, layout.chunk_tokens)
    stage = tier.codec_stage
    if stage.identity or layout.dtype == "uint8":
        base = rng.integers(0, 256, (batch, slots.shape[1]), dtype=np.uint8)
    else:  # values a quantising codec takes: finite floats, shaped like KV
        seeds = rng.integers(0, 2**31, batch)
        base = np.stack([np.frombuffer(kv_like(layout, int(s)), np.uint8) for s in seeds])
    phases = {name: Phase() for name in PHASES}
    batches = [list(range(start, min(start + batch, chunks))) for start in range(0, chunks, batch)]

    def stamped(index: int) -> np.ndarray:
        row = base[index % batch].copy()
        row[:_STAMP] = np.frombuffer(index.to_bytes(_STAMP, "little"), dtype=np.uint8)
        return row

    def served(index: int) -> np.ndarray:
        """What a load must give: the stored bytes, as the tier's codec decodes them."""
        if not stage.lossy:
            return stamped(index)
        return np.frombuffer(stage.round_trip(stamped(index).tobytes()), np.uint8)

    def timed_job(
        phase: Phase, job_keys: list[ChunkKey], job_slots: list[int], loading: bool
    ) -> JobResult:
        started = time.perf_counter()
        result = run_job(
            tier, TransferJob(tuple(job_keys), tuple(job_slots)), loading=loading, timeout=timeout
        )
        elapsed = time.perf_counter() - started
        phase.latencies.append(elapsed)
        phase.seconds += elapsed
        phase.chunks += len(result.succeeded)
        phase.nbytes += len(result.succeeded) * slots.shape[1]
        phase.failures += len(job_keys) - len(result.succeeded)
        return result

    store = phases["store"]
    for indexes in batches:
        for position, index in enumerate(indexes):
            slots[position] = stamped(index)
        timed_job(store, [keys[i] for i in indexes], list(range(len(indexes))), loading=False)
        advance("store", len(indexes))
    tier.drain()

    lookup = phases["lookup"]
    for key in keys:
        started = time.perf_counter()
        answer = resolve_lookup(tier, key, timeout=timeout)
        elapsed = time.perf_counter() - started
        lookup.latencies.append(elapsed)
        lookup.seconds += elapsed
        if answer is Lookup.HIT:
            lookup.chunks += 1
        else:
            lookup.failures += 1
        advance("lookup", 1)

    load = phases["load"]
    for indexes in batches:
        targets = list(range(batch, batch + len(indexes)))
        slots[targets] = 0
        result = timed_job(load, [keys[i] for i in indexes], targets, loading=True)
        for index, target in zip(indexes, targets, strict=True):
            if keys[index] in result.succeeded and not np.array_equal(slots[target], served(index)):
                load.failures += 1  # bytes differ: counted, never trusted
                load.chunks -= 1
                load.nbytes -= slots.shape[1]
        advance("load", len(indexes))
    tier.drain()
    tier.discard(keys)  # leave no probe chunks in a tier that engines share
    return phases
