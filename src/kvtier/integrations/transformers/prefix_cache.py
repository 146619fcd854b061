"""``PrefixCache``: a ``transformers`` causal LM served by kvtier.

Per request: count the prompt's cached prefix (promoting chunks from
secondary tiers), load it into a fresh model cache, prefill only the rest,
and afterwards store the sequence's full chunks. Partial trailing chunks are
never stored; the next request that shares them recomputes them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from kvtier.config import KVTierConfig, load_config
from kvtier.facade import KVCache
from kvtier.inputs import token_array
from kvtier.integrations.transformers.chunks import ChunkReader, ChunkWriter, new_cache
from kvtier.integrations.transformers.generate import Generation, greedy_generate, prefill
from kvtier.integrations.transformers.layout import layout_for_model
from kvtier.layout import KVLayout

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class PrefixLoad:
    """What kvtier had for a prompt, and the model cache it filled."""

    #: A fresh model cache holding the KV of the first ``reused_tokens`` tokens.
    cache: Cache = field(repr=False)
    #: Prompt tokens to skip in prefill.
    reused_tokens: int
    #: Prompt tokens kvtier holds (whole chunks). A prompt held entirely still
    #: has its last token recomputed: the model needs it to produce logits.
    hit_tokens: int
    #: Per secondary tier, in configuration order: chunks promoted from it.
    promoted_chunks: tuple[int, ...]


class PrefixCache:
    """kvtier around one ``transformers`` model (batch size 1, greedy decoding).

    ``config`` is a kvtier configuration (dict, file, or ``None`` for a CPU
    tier alone). ``model_id`` names the model in the chunk namespace; the
    default is the config's name or path. Requests may run on several threads
    at once (the model permitting); ``promoted_chunks`` then also counts
    promotions of requests running beside it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: KVTierConfig | Mapping[str, Any] | str | Path | None = None,
        *,
        model_id: str | None = None,
    ) -> None:
        self.model = model
        settings = load_config(config)
        self.layout: KVLayout = layout_for_model(
            model, chunk_tokens=settings.chunk_tokens, model_id=model_id
        )
        self.kv = KVCache(settings, self.layout)

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    def load(self, token_ids: TokenIds) -> PrefixLoad:
        """Bring the cached prefix of ``token_ids`` into a fresh model cache.

        Waits for promotions from secondary tiers. Reuses at most all tokens
        but the last, which the model must compute to give the next logits.
        """
        ids = _as_ids(token_ids)
        self.kv.step()  # collect finished transfers first: they free primary slots
        before = self._promoted_so_far()
        cache: Cache = new_cache(self.model.config)
        # Every full chunk, but the last token, which the model must compute.
        most = min(len(ids) - 1, len(ids) // self.chunk_tokens * self.chunk_tokens)
        if most > 0:
            reader = ChunkReader(self.layout, most, device=self.model.device)
            # Each chunk copied in as soon as it is in memory, while the rest
            # of a long prefix is still read; pinned until then, so no other
            # request's store can evict it first (a request of its own).
            hit = self.kv.load_prefix(ids, reader)
            reuse = reader.filled
            if reuse:
                cache = reader.to_cache(self.model.config)
        else:
            hit, reuse = self.kv.cached_prefix(ids), 0
        promoted = tuple(b - a for a, b in zip(before, self._promoted_so_far(), strict=True))
        return PrefixLoad(cache, reuse, hit, promoted)

    def store(self, token_ids: TokenIds, cache: Cache) -> int:
        """Offload the full chunks of ``token_ids`` that ``cache`` holds the KV of.

        ``cache`` holds the KV of ``token_ids`` from the first token on (it
        may hold fewer tokens: only what it holds is stored). Returns the
        number of new chunks stored.
        """
        ids = _as_ids(token_ids)
        writer = ChunkWriter(cache, self.layout)
        full = min(len(ids), writer.num_tokens) // self.chunk_tokens
        stored = self.kv.store(ids, writer, num_chunks=full)
        self.kv.step()
        return stored

    def prefill(
        self, token_ids: TokenIds, *, store: bool = True
    ) -> tuple[torch.Tensor, PrefixLoad]:
        """The logits after ``token_ids``, prefilling only what kvtier did not hold.

        Returns the logits and the :class:`PrefixLoad`, whose cache now holds
        the whole prompt. With ``store``, the prompt's new full chunks are stored.
        """
        ids = _as_ids(token_ids)
        prefix = self.load(ids)
        logits, cache = prefill(self.model, ids, prefix.cache)
        if store:
            self.store(ids, cache)
        return logits, prefix

    def generate(
        self,
        token_ids: TokenIds,
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        store: bool = True,
    ) -> Generation:
        """Greedy generation with the cached prefix reused.

        The time to first token includes the lookup, any promotion and the
        load. With ``store``, the full chunks of the prompt and the generated
        tokens (those the cache holds) are stored afterwards, so the next turn
        of a conversation reuses the reply too.
        """
        ids = _as_ids(token_ids)
        started = time.perf_counter()
        prefix = self.load(ids)
        result = greedy_generate(
            self.model,
            ids,
            max_new_tokens,
            cache=prefix.cache,
            eos_token_id=eos_token_id,
            started=started,
        )
        stored = 0
        if store and result.cache is not None:
            stored = self.store(ids + result.tokens[:-1], result.cache)
        return replace(
            result,
            reused_tokens=prefix.reused_tokens,
            hit_tokens=prefix.hit_tokens,
            promoted_chunks=prefix.promoted_chunks,
            stored_chunks=stored,
        )

    def close(self) -> None:
        """Drain transfers in flight and stop the tiers."""
        self.kv.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _promoted_so_far(self) -> list[int]:
        return [tier.stats["chunks_loaded"] for tier in self.kv.status.tiers]


def _as_ids(token_ids: TokenIds) -> list[int]:
    """Integer token ids of one sequence (a ``(1, n)`` tensor is a batch of one)."""
    if isinstance(token_ids, torch.Tensor) and token_ids.dim() == 2 and token_ids.shape[0] == 1:
        token_ids = token_ids[0]
    ids: list[int] = token_array(token_ids, "token_ids").tolist()
    if not ids:
        raise ValueError("token ids are empty: a prompt needs at least one token")
    return ids
