"""A cold prefix through each codec (``bench_cold.py --codec NAME``).

With ``--codec`` the prefix is KV-like bf16 values
(:func:`kvtier.codecs.samples.kv_like`; random bytes would leave a lossless
codec nothing to find), stored and loaded once per codec in each run, with
``none`` always among them as the reference. Each codec's loaded prefix is
checked against what its tier serves: the stored bytes for an exact codec,
its own round trip of them for a lossy one. Per codec the report gives the
load time (p50), GB/s of raw KV, the load time over ``none``'s in the same
run, the stored ratio (raw bytes over the bytes the tier holds) and the
decode share: of the tier's workers' time in reads and decodes, the part
spent decoding; and the tier speed below which the codec starts to pay
(:func:`pays_below_gbps`). A ``--baseline-src`` kvtier loads the same
prefix with ``none``.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

#: The reference every codec is measured against, always in the run.
REFERENCE = "none"


def codec_names(values: list[str] | None) -> list[str] | None:
    """``--codec``'s names (repeated or comma-separated), ``none`` first; None without any."""
    if not values:
        return None
    names = [REFERENCE]
    for value in values:
        for name in (part.strip() for part in value.split(",")):
            if name and name not in names:
                names.append(name)
    return names


def system_name(codec: str | None) -> str:
    """The run's name for kvtier through ``codec``: plain ``kvtier`` for ``none``."""
    return "kvtier" if codec in (None, REFERENCE) else f"kvtier:{codec}"


def tier_entry(entry: dict[str, Any], codec: str | None) -> dict[str, Any]:
    """``entry`` with ``codec`` configured (``none`` is left as the default)."""
    return entry if codec in (None, REFERENCE) else {**entry, "codec": codec}


def prefix_rows(layout: Any, chunks: int, seed: int, kv: bool) -> tuple[Any, Any]:
    """``(tokens, rows)`` of one prefix: random bytes, or KV-like values with ``kv``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**31, chunks * layout.chunk_tokens)
    if not kv:
        return tokens, rng.integers(0, 256, (chunks, layout.slot_bytes), dtype=np.uint8)
    from kvtier.codecs.samples import kv_like

    rows = np.empty((chunks, layout.slot_bytes), dtype=np.uint8)
    for index in range(chunks):
        rows[index] = np.frombuffer(kv_like(layout, seed * chunks + index), np.uint8)
    return tokens, rows


def served_rows(rows: Any, layout: Any, codec: str | None) -> Any:
    """What a tier with ``codec`` serves for ``rows``: the rows, or a lossy codec's round trip."""
    import numpy as np

    from kvtier.codecs import CodecStage, codec_config

    if codec in (None, REFERENCE):
        return rows
    stage = CodecStage(codec_config(codec).build(layout), layout)
    if not stage.lossy:
        return rows
    return np.stack([np.frombuffer(stage.round_trip(row), np.uint8) for row in rows])


def stored_ratio(tier: Any) -> float:
    """Raw bytes over the bytes the tier's codec stored (1.0 for ``none``)."""
    stats = tier.stats  # kvtier releases before codecs count no codec bytes
    raw, stored = getattr(stats, "codec_bytes_in", 0), getattr(stats, "codec_bytes_out", 0)
    return raw / stored if stored else 1.0


def pays_below_gbps(run: dict[str, Any], reference: dict[str, Any]) -> float:
    """The speed of ``none``'s load (GB/s of raw KV) below which this codec's
    load of the same prefix is the faster: ``none``'s time taken to scale with
    the bytes moved, and the codec's time beyond moving ``1/ratio`` of them
    (decoding, its larger share of fixed costs) to stay. ``inf`` (reported as
    ``None``): faster already; ``0`` where it stores no fewer bytes (``none``)."""
    ratio = run["stored_ratio"]
    if ratio <= 1:
        return 0.0
    gigabytes = reference["gbps"] * reference["total_s"]
    extra_s = run["total_s"] - reference["total_s"] / ratio
    return gigabytes * (1 - 1 / ratio) / extra_s if extra_s > 0 else math.inf


def codec_row(
    rounds: list[dict[str, Any]], reference: list[dict[str, Any]], summary: Any
) -> dict[str, Any]:
    """One codec's figures from its runs and ``none``'s in the same runs."""
    median = statistics.median
    paired = [r["total_s"] / n["total_s"] for r, n in zip(rounds, reference, strict=True)]
    shares = [r["decode_s"] / ((r["decode_s"] + r["io_s"]) or 1.0) for r in rounds]
    pays = median(pays_below_gbps(r, n) for r, n in zip(rounds, reference, strict=True))
    return {
        "load_s": summary([r["total_s"] for r in rounds]),
        "time_vs_none": summary(paired),
        "stored_ratio": round(median(r["stored_ratio"] for r in rounds), 3),
        "decode_share": round(median(shares), 3),
        "pays_below_gbps": round(pays, 3) if math.isfinite(pays) else None,
    }


def label(name: str) -> str:
    """A system's name in the codec table: its codec's, or ``baseline``."""
    return REFERENCE if name == "kvtier" else name.partition(":")[2] or name


def pays_text(codec: dict[str, Any]) -> str:
    if codec["stored_ratio"] <= 1:
        return "-"  # saves no bytes: pays at no speed
    pays = codec["pays_below_gbps"]
    return "always" if pays is None else f"{pays:.2f}"


def codec_table(result: dict[str, Any]) -> list[str]:
    """The report's lines for one chunk size's codecs (none when not measured)."""
    rows = [(n, r) for n, r in result.items() if isinstance(r, dict) and "codec" in r]
    if not rows:
        return []
    lines = [
        f"  {'codec':<10} {'load p50 s':>10} {'GB/s':>6} {'time/none (spread)':>18} "
        f"{'stored ratio':>12} {'decode share':>12} {'pays below GB/s':>15}"
    ]
    for name, row in rows:
        codec = row["codec"]
        lines.append(
            f"  {label(name):<10} {codec['load_s']['p50']:>10.3f} "
            f"{row['gbps']['p50']:>6.2f} {codec['time_vs_none']['p50']:>10.2f}x "
            f"({codec['time_vs_none']['spread']:>4.0%}) "
            f"{codec['stored_ratio']:>11.2f}x {codec['decode_share']:>12.0%} "
            f"{pays_text(codec):>15}"
        )
    return lines
