"""Identities of LoRA adapters: a prefix's KV depends on the adapter that computed it.

Engines that share a tier may load different files under one adapter name
(an adapter retrained and deployed under its old name, on one engine
before another), so neither the name nor the path tells two adapters apart:
their files do. An adapter is identified as model weights are
(:func:`~kvtier.identity.weights.weights_identity`: sizes, times and
sampled content), once per adapter the engine loads, and again whenever the
engine is told to reload it in place.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from kvtier.identity.named import identify_weights
from kvtier.identity.weights import WeightsIdentity

logger = logging.getLogger(__name__)

#: What an engine loads an adapter by: its name, its id, and its path or repository id.
AdapterRef = tuple[str, int, str]


class AdapterIdentities:
    """The identity of each LoRA adapter an engine serves, found from its files.

    :meth:`token` is ``None`` for an adapter whose files cannot be found on
    this machine (a repository id not in the local Hugging Face cache) or
    read: KV of its requests must then be left to the engine, never shared.
    Adapters are identified once per ``(name, id, path)``, as an engine loads
    them once; ``reload=True`` (an engine told to load the adapter again in
    place) identifies the files again.

    Files that change under a loaded adapter without that reload make it
    ambiguous (nothing outside the engine sees when it reads them again):
    its token is ``None`` until a reload. Each :meth:`token` checks the
    files' ``stat``, never reads them.
    """

    def __init__(self, cache_dirs: Iterable[str | os.PathLike[str] | None] = (None,)) -> None:
        self._cache_dirs = tuple(cache_dirs)
        self._found: dict[AdapterRef, WeightsIdentity | None] = {}

    def token(self, name: str, adapter_id: int, path: str, *, reload: bool = False) -> str | None:
        """The identity of the adapter's files, or ``None`` if they cannot be
        identified or changed since the engine loaded them."""
        ref = (name, adapter_id, path)
        if reload or ref not in self._found:
            self._found[ref] = self._find(name, path)
        found = self._found[ref]
        if found is None:
            return None
        if found.stamp.changed():
            logger.warning(
                "kvtier: LoRA adapter %r: its files at %r changed since it was loaded, "
                "and the engine was not told to reload it: which version it runs is "
                "unknown, so its requests are left to the engine until it is reloaded",
                name,
                path,
            )
            self._found[ref] = None
            return None
        return found.token

    def _find(self, name: str, path: str) -> WeightsIdentity | None:
        try:
            found = identify_weights(path, cache_dirs=self._cache_dirs) if path else None
        except (OSError, ValueError) as exc:
            logger.warning(
                "kvtier: LoRA adapter %r: cannot identify %s (%s); its requests are "
                "left to the engine, not offloaded",
                name,
                path,
                exc,
            )
            return None
        if found is None:
            logger.warning(
                "kvtier: LoRA adapter %r: %r is neither a local path nor in the local "
                "Hugging Face cache, so its files cannot be identified; its requests "
                "are left to the engine, not offloaded",
                name,
                path,
            )
            return None
        return found
