"""A Hugging Face cache laid out on disk, for tests of model identity."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def hub_snapshot(cache: Path, repo_id: str, source: Path, commit: str) -> Path:
    """Put the files of ``source`` into ``cache`` as ``repo_id`` at ``commit``.

    Lays them out as ``huggingface_hub`` does: content-named blobs, a
    snapshot directory of symbolic links to them, and ``refs/main``.
    Returns the snapshot directory.
    """
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
