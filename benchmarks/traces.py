"""Where the benchmarks find the recorded traces they replay.

Mooncake's synthetic trace (FAST'25 release) is not shipped with kvtier:
docs/policies-and-specs.md says how to fetch it. It is looked for in
``$KVTIER_TRACES``, then in ``traces/`` and ``../shared/traces/`` beside the
checkout, and checked against its known digest.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE_FILE = "mooncake-synthetic.jsonl.gz"
#: sha256 of the decompressed trace: FAST25-release/traces/synthetic_trace.jsonl.
MOONCAKE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


def trace_dirs() -> list[Path]:
    env = os.environ.get("KVTIER_TRACES")
    return [Path(env)] if env else [ROOT / "traces", ROOT.parent / "shared" / "traces"]


def mooncake_trace() -> Path | None:
    """The Mooncake synthetic trace, gzipped or not, if present; ``ValueError``
    if a file of that name holds other content."""
    for folder in trace_dirs():
        for name in (MOONCAKE_FILE, "synthetic_trace.jsonl"):
            path = folder / name
            if path.is_file():
                check(path)
                return path
    return None


def check(path: Path) -> None:
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    with gzip.open(path, "rb") if gzipped else path.open("rb") as data:
        digest = hashlib.file_digest(data, "sha256").hexdigest()
    if digest != MOONCAKE_SHA256:
        raise ValueError(f"{path}: not Mooncake's synthetic trace (sha256 {digest})")
