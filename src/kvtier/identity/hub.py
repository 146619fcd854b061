"""Where a model named by a Hugging Face repository id lives in the local cache."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def locate_model(
    name_or_path: str,
    *,
    revision: str | None = None,
    cache_dirs: Iterable[str | os.PathLike[str] | None] = (None,),
) -> Path | None:
    """The local directory or file of a model, or ``None`` if it cannot be found.

    ``name_or_path`` is a local path, or a Hugging Face repository id whose
    snapshot at ``revision`` (default: ``main`` as last downloaded) is looked
    up in each of ``cache_dirs`` in turn (``None``: the default cache). Never
    touches the network.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    for cache_dir in cache_dirs:
        try:
            found = snapshot_download(
                repo_id=name_or_path,
                revision=revision,
                cache_dir=None if cache_dir is None else str(cache_dir),
                local_files_only=True,
            )
        except Exception:  # not cached there, or not a repository id at all
            continue
        return Path(found)
    return None
