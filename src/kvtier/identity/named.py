"""Weights named the way engines name them: a local path or a Hugging Face repository id."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from kvtier.identity.hub import locate_model
from kvtier.identity.weights import WeightsIdentity, weights_identity

logger = logging.getLogger(__name__)


def identify_weights(
    name_or_path: str,
    *,
    revision: str | None = None,
    cache_dirs: Iterable[str | os.PathLike[str] | None] = (None,),
    full_read: bool = False,
) -> WeightsIdentity | None:
    """:func:`weights_identity` of a model named by path or Hugging Face repository id.

    Finds it with :func:`locate_model` (no network); ``None`` when it is in
    neither place. Logs what it read and how long it took.
    """
    path = locate_model(name_or_path, revision=revision, cache_dirs=cache_dirs)
    if path is None:
        return None
    began = time.perf_counter()
    weights = weights_identity(path, full_read=full_read)
    logger.info(
        "kvtier: weights of %s identified from %d files (%.1f GB%s): read %.1f MB in %.2f s",
        name_or_path,
        weights.files,
        weights.total_bytes / 1e9,
        f", revision {weights.revision}" if weights.revision else "",
        weights.bytes_read / 1e6,
        time.perf_counter() - began,
    )
    return weights
