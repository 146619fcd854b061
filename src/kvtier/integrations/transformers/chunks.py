"""Copies between a ``transformers`` cache and kvtier chunks.

A ``transformers`` cache holds, per layer, keys and values of shape
``(batch, kv_heads, tokens, head_dim)``. A kvtier chunk is a ``uint8`` slot
of ``layout.slot_bytes`` bytes viewed as ``(layers, 2, chunk_tokens,
kv_heads, head_dim)``. Both directions copy whole blocks with ``Tensor.copy_``
(no Python loop over tokens or heads), straight from or into the slot.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache

from kvtier.errors import LayoutMismatchError
from kvtier.layout import KVLayout

_LAYOUT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    try:
        return _LAYOUT_DTYPES[layout.dtype]
    except KeyError:
        raise LayoutMismatchError(f"layout dtype {layout.dtype!r} has no torch KV dtype") from None


def slot_tensor(slot: np.ndarray, layout: KVLayout) -> torch.Tensor:
    """A slot's bytes as a ``(layers, 2, chunk_tokens, kv_heads, head_dim)`` tensor (no copy)."""
    if slot.dtype != np.uint8 or slot.size != layout.slot_bytes:
        raise LayoutMismatchError(
            f"a slot of {slot.size} {slot.dtype} does not hold a {layout.slot_bytes}-byte chunk"
        )
    return torch.from_numpy(slot.reshape(-1)).view(torch_dtype(layout)).view(layout.chunk_shape)


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """An empty cache of the kind the model builds for itself."""
    try:
        return DynamicCache(config=config)
    except TypeError:  # releases whose DynamicCache takes no config
        return DynamicCache()


def cache_tensors(cache: Cache, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` of a batch-1 cache, checked against ``layout``."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(cache).__name__} has no per-layer 'layers'; kvtier needs transformers>=4.56"
        )
    if len(layers) != layout.num_layers:
        raise LayoutMismatchError(
            f"cache has {len(layers)} layers, layout {layout.model_id!r} has {layout.num_layers}"
        )
    tensors = []
    expected = (1, layout.num_kv_heads, layout.head_dim)
    for index, layer in enumerate(layers):
        keys, values = layer.keys, layer.values
        if keys is None or values is None:
            raise LayoutMismatchError(f"cache layer {index} is empty")
        for name, tensor in (("keys", keys), ("values", values)):
            shape = (tensor.shape[0], tensor.shape[1], tensor.shape[3])
            if tensor.dim() != 4 or shape != expected or tensor.dtype != torch_dtype(layout):
                raise LayoutMismatchError(
                    f"cache layer {index} {name}: shape {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected (1, {layout.num_kv_heads}, tokens, {layout.head_dim}) "
                    f"{torch_dtype(layout)} (batch size 1)"
                )
        tensors.append((keys, values))
    return tensors


class ChunkWriter:
    """Fills slots from a cache: ``writer(i, slot)`` copies chunk ``i`` of the cache.

    A :data:`~kvtier.facade.ChunkCopier` for :meth:`kvtier.KVCache.store`.
    Only full chunks exist: asking for one beyond the cached tokens is an error.
    """

    def __init__(self, cache: Cache, layout: KVLayout) -> None:
        self.layout = layout
        self.layers = cache_tensors(cache, layout)
        self.num_tokens = min(keys.shape[2] for keys, _ in self.layers)

    @property
    def full_chunks(self) -> int:
        return self.num_tokens // self.layout.chunk_tokens

    def __call__(self, index: int, slot: np.ndarray) -> None:
        if not 0 <= index < self.full_chunks:
            raise IndexError(
                f"chunk {index}: the cache holds {self.full_chunks} full chunks "
                f"({self.num_tokens} tokens)"
            )
        start = index * self.layout.chunk_tokens
        stop = start + self.layout.chunk_tokens
        chunk = slot_tensor(slot, self.layout)
        with torch.no_grad():
            for layer, (keys, values) in enumerate(self.layers):
                chunk[layer, 0].copy_(keys[0, :, start:stop].transpose(0, 1))
                chunk[layer, 1].copy_(values[0, :, start:stop].transpose(0, 1))


class ChunkReader:
    """Gathers up to ``num_tokens`` tokens of KV from slots: ``reader(i, slot)``,
    chunk after chunk from the first.

    A :data:`~kvtier.facade.ChunkCopier` for :meth:`kvtier.KVCache.load` and
    :meth:`~kvtier.KVCache.load_prefix`. The last chunk may be copied in part,
    so a prefix need not end on a chunk boundary. :meth:`to_cache` hands the
    :attr:`filled` tokens to the model.
    """

    def __init__(
        self, layout: KVLayout, num_tokens: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        self.layout = layout
        self.num_tokens = num_tokens
        # (layers, K/V, heads, tokens, dim): each layer's K and V come out contiguous.
        self.kv = torch.empty(
            (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim),
            dtype=torch_dtype(layout),
            device=device,
        )
        self._filled = 0

    @property
    def chunks(self) -> int:
        """Chunks to load: the last one may be used in part."""
        return -(-self.num_tokens // self.layout.chunk_tokens)

    @property
    def filled(self) -> int:
        """Tokens gathered so far, from the first on."""
        return self._filled

    def __call__(self, index: int, slot: np.ndarray) -> None:
        start = index * self.layout.chunk_tokens
        take = min(self.layout.chunk_tokens, self.num_tokens - start)
        if take <= 0:
            raise IndexError(f"chunk {index} lies beyond the {self.num_tokens} tokens to load")
        if start != self._filled:
            raise ValueError(f"chunk {index} out of order: {self._filled} tokens gathered")
        chunk = slot_tensor(slot, self.layout)
        with torch.no_grad():
            self.kv[:, :, :, start : start + take].copy_(chunk[:, :, :take].permute(0, 1, 3, 2, 4))
        self._filled += take

    def to_cache(self, config: PretrainedConfig) -> DynamicCache:
        """A fresh cache holding the :attr:`filled` tokens gathered."""
        if not self._filled:
            raise RuntimeError(f"gathered none of {self.num_tokens} tokens")
        # Fewer than room for (a shorter prefix found): the tokens gathered, contiguous.
        kv = self.kv if self._filled == self.num_tokens else self.kv[..., : self._filled, :].clone()
        cache = new_cache(config)
        for layer in range(self.layout.num_layers):
            cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        return cache
