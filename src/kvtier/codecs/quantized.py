"""Lossy codecs: ``fp8``, ``int8`` and ``int4``, decoded into the layout's dtype.

In the default ``kv_order`` ``fp8`` and ``int8`` scale per token, head and
K/V and ``int4`` groups as KIVI does; in any other order (an engine's pages)
each ``group_size`` consecutive elements get a scale of their own. The
grouping is a recorded parameter: a chunk is never decoded in another.
See docs/codecs.md, "Built-in codecs".
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, cast

import numpy as np
from pydantic import Field

from kvtier.codecs.base import Codec, CodecOptions
from kvtier.errors import MissingDependencyError
from kvtier.layout import KVLayout

#: The element order these codecs read a chunk in (the layout default).
CHUNK_ORDER = "layer,kv,token,head,dim"
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")
#: Grouping names the chunk header records.
BY_VECTOR, KIVI, ELEMENTS = "token,head", "kivi", "elements"
#: Elements per scale where the order is unknown (fp8, int8): measured on a
#: trained model's KV and on vLLM's pages (docs/codecs.md).
DEFAULT_ELEMENT_GROUP = 64
_F16_MAX = float(np.finfo(np.float16).max)


def _ml_dtypes() -> Any:
    try:
        import ml_dtypes
    except ImportError as exc:
        raise MissingDependencyError("ml_dtypes", "codecs") from exc
    return ml_dtypes


class _QuantizedCodec(Codec):
    """Reads a slot as float32 values, writes decoded values back in the layout's dtype."""

    lossy: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, options: CodecOptions | None = None, **kwargs: Any):
        super().__init__(layout, options, **kwargs)
        self._shape = layout.chunk_shape
        self._count = int(np.prod(self._shape))
        self._bf16 = _ml_dtypes().bfloat16 if layout.dtype == "bfloat16" else None

    @abstractmethod
    def grouping(self, layout: KVLayout) -> tuple[str, int]:
        """The grouping used on ``layout`` and its group size (elements)."""

    def params(self) -> dict[str, Any]:
        grouping, group_size = self.grouping(self.layout)
        return {**super().params(), "grouping": grouping, "group_size": group_size}

    def check_layout(self, layout: KVLayout) -> str | None:
        if layout.dtype not in _FLOAT_DTYPES:
            return (
                f"KV dtype {layout.dtype} is not one of {', '.join(_FLOAT_DTYPES)} "
                "(KV already quantised is stored exactly: use codec none or lossless)"
            )
        cache_dtype = dict(layout.extra).get("kv_cache_dtype", "auto")
        if cache_dtype not in ("auto", *_FLOAT_DTYPES):
            # A quantised cache's pages may hold scales or other bytes beside the KV.
            return (
                f"the engine's KV cache dtype is {cache_dtype!r}, not float KV "
                "(use codec none or lossless)"
            )
        grouping, group_size = self.grouping(layout)
        if grouping == ELEMENTS and self._element_count(layout) % group_size:
            return (
                f"group_size={group_size} does not divide the chunk's "
                f"{self._element_count(layout)} elements"
            )
        return None

    @staticmethod
    def _element_count(layout: KVLayout) -> int:
        return layout.slot_bytes // layout.dtype_bytes

    def _values(self, chunk: memoryview) -> np.ndarray:
        """The chunk as float32 in ``chunk_shape``."""
        raw = np.frombuffer(chunk, self.layout.numpy_dtype)
        if self._bf16 is not None:
            raw = raw.view(self._bf16)
        return raw.astype(np.float32).reshape(self._shape)

    def _store(self, values: np.ndarray, out: memoryview) -> None:
        """Write float32 ``values`` into ``out`` in the layout's dtype."""
        target = np.frombuffer(out, self.layout.numpy_dtype)
        if len(target) != values.size:
            raise ValueError(f"{values.size} values for a slot of {len(target)}")
        if self._bf16 is not None:
            # Round to nearest even by hand: several times faster than the
            # generic cast, and the same bits for the finite values decoded here.
            bits = np.ascontiguousarray(values, np.float32).reshape(-1).view(np.uint32)
            target[:] = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return
        target[:] = values.reshape(-1)


class ScaledOptions(CodecOptions):
    group_size: int | None = Field(default=None, ge=2, le=65536)
    """Consecutive elements sharing one scale. Unset: one scale per token,
    head and K/V where the layout's ``kv_order`` is the default (a head's
    vector), else 64 elements."""


class _GroupScaledCodec(_QuantizedCodec):
    """One float32 scale per group of consecutive elements: by default a
    ``head_dim`` vector (token, head, K/V, layer) where the order is known."""

    Options: ClassVar[type[CodecOptions]] = ScaledOptions
    #: Largest magnitude the code represents (the group's maximum maps to it).
    code_max: ClassVar[float]

    def __init__(self, layout: KVLayout, options: CodecOptions | None = None, **kwargs: Any):
        super().__init__(layout, options, **kwargs)
        self._group = self.grouping(layout)[1]

    def grouping(self, layout: KVLayout) -> tuple[str, int]:
        chosen = cast(ScaledOptions, self.options).group_size
        known = layout.kv_order == CHUNK_ORDER
        if chosen is None:
            chosen = layout.head_dim if known else DEFAULT_ELEMENT_GROUP
        # In the default order a head's vector is head_dim consecutive elements.
        return (BY_VECTOR if known and chosen == layout.head_dim else ELEMENTS), chosen

    def max_encoded_bytes(self) -> int:
        return self._count + 4 * (self._count // self._group)

    @abstractmethod
    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        """Codes of values already scaled into the code's range."""

    @abstractmethod
    def _dequantize(self, codes: np.ndarray) -> np.ndarray:
        """The scaled float32 values of ``codes`` (raw bytes)."""

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        values = self._values(chunk).reshape(-1, self._group)
        amax = np.abs(values).max(axis=1, keepdims=True)
        if not np.isfinite(amax).all():
            raise ValueError("chunk holds inf or NaN values: not quantised")
        scales = np.where(amax > 0, amax / self.code_max, 1.0).astype(np.float32)
        codes = self._quantize(values / scales)
        target = np.frombuffer(out, np.uint8)
        target[: self._count] = codes.view(np.uint8).reshape(-1)
        target[self._count : self.max_encoded_bytes()] = scales.view(np.uint8).reshape(-1)
        return self.max_encoded_bytes()

    def decode(self, data: memoryview, out: memoryview) -> None:
        if len(data) != self.max_encoded_bytes():
            raise ValueError(
                f"{len(data)} bytes, a {self.name} chunk is {self.max_encoded_bytes()}"
            )
        raw = np.frombuffer(data, np.uint8)
        codes = raw[: self._count].reshape(-1, self._group)
        scales = raw[self._count :].view(np.float32).reshape(-1, 1)
        self._store(self._dequantize(codes) * scales, out)


class Fp8Codec(_GroupScaledCodec):
    """float8 e4m3, one scale per token, head and K/V: half of bf16's bytes."""

    code_max: ClassVar[float] = 448.0
    returns_promptly: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, options: CodecOptions | None = None, **kwargs: Any):
        super().__init__(layout, options, **kwargs)
        self._e4m3 = _ml_dtypes().float8_e4m3fn
        # Each of the 256 codes' value: a table look-up decodes faster than a cast.
        self._table = np.arange(256, dtype=np.uint8).view(self._e4m3).astype(np.float32)

    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        return np.clip(scaled, -448.0, 448.0).astype(self._e4m3)

    def _dequantize(self, codes: np.ndarray) -> np.ndarray:
        return self._table[codes]


class Int8Codec(_GroupScaledCodec):
    """Symmetric int8, one scale per token, head and K/V: half of bf16's bytes."""

    code_max: ClassVar[float] = 127.0
    returns_promptly: ClassVar[bool] = True

    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        return np.rint(scaled).astype(np.int8)

    def _dequantize(self, codes: np.ndarray) -> np.ndarray:
        return codes.view(np.int8).astype(np.float32)


class Int4Options(CodecOptions):
    group_size: int = Field(default=32, ge=2, le=4096)
    """Elements sharing one scale and minimum: keys group this many tokens
    of one channel, values this many channels of one token (both capped at
    the chunk's tokens and the head dimension, which they must divide); in
    a ``kv_order`` other than the default, this many consecutive elements."""


class Int4Codec(_QuantizedCodec):
    """Asymmetric 4-bit, KIVI's grouping (keys per channel, values per token)
    where the order is known, else groups of consecutive elements."""

    Options: ClassVar[type[CodecOptions]] = Int4Options
    returns_promptly: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, options: CodecOptions | None = None, **kwargs: Any):
        super().__init__(layout, options, **kwargs)
        group = cast(Int4Options, self.options).group_size
        self._kivi = self.grouping(layout)[0] == KIVI
        self._key_group = min(group, layout.chunk_tokens) if self._kivi else group
        self._value_group = min(group, layout.head_dim) if self._kivi else group
        half = self._count // 2
        self._key_params = half // self._key_group
        self._value_params = half // self._value_group

    def grouping(self, layout: KVLayout) -> tuple[str, int]:
        group = cast(Int4Options, self.options).group_size
        return (KIVI if layout.kv_order == CHUNK_ORDER else ELEMENTS), group

    def check_layout(self, layout: KVLayout) -> str | None:
        reason = super().check_layout(layout)
        if reason is not None:
            return reason
        grouping, group = self.grouping(layout)
        if grouping == ELEMENTS:
            # The first and second halves are grouped apart (K and V in the
            # default order), so each must hold whole groups.
            half = self._element_count(layout) // 2
            if half % group:
                return f"group_size={group} does not divide half the chunk's elements ({half})"
            return None
        key_group = min(group, layout.chunk_tokens)
        value_group = min(group, layout.head_dim)
        if layout.chunk_tokens % key_group:
            return f"group_size={group} does not divide chunk_tokens={layout.chunk_tokens}"
        if layout.head_dim % value_group:
            return f"group_size={group} does not divide head_dim={layout.head_dim}"
        return None

    def max_encoded_bytes(self) -> int:
        # Two codes a byte, then scale and minimum (float16) per group.
        return self._count // 2 + 4 * (self._key_params + self._value_params)

    def _grouped(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys as ``(groups, key_group)`` along tokens, values as ``(groups,
        value_group)`` along channels: the reduction axis last. Without
        KIVI's grouping, each half of the chunk in consecutive groups."""
        if not self._kivi:
            flat = values.reshape(2, -1)
            return flat[0].reshape(-1, self._key_group), flat[1].reshape(-1, self._value_group)
        layers, _, tokens, heads, dim = self._shape
        keys = values[:, 0].reshape(layers, tokens // self._key_group, self._key_group, heads, dim)
        keys = keys.transpose(0, 1, 3, 4, 2).reshape(-1, self._key_group)
        vals = values[:, 1].reshape(-1, self._value_group)
        return keys, vals

    def _ungrouped(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        if not self._kivi:
            return np.concatenate((keys.reshape(-1), vals.reshape(-1)))
        layers, _, tokens, heads, dim = self._shape
        keys = keys.reshape(layers, tokens // self._key_group, heads, dim, self._key_group)
        keys = keys.transpose(0, 1, 4, 2, 3).reshape(layers, tokens, heads, dim)
        values = np.empty(self._shape, np.float32)
        values[:, 0] = keys
        values[:, 1] = vals.reshape(layers, tokens, heads, dim)
        return values

    @staticmethod
    def _quantize(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        low = groups.min(axis=1, keepdims=True)
        high = groups.max(axis=1, keepdims=True)
        if not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise ValueError("chunk holds inf or NaN values: not quantised")
        if max(-float(low.min()), float(high.max())) > _F16_MAX:
            raise ValueError("chunk holds values beyond float16's range: not quantised")
        low16 = low.astype(np.float16)
        scale16 = ((high - low16.astype(np.float32)) / 15.0).astype(np.float16)
        scale = scale16.astype(np.float32)
        safe = np.where(scale > 0, scale, 1.0)
        codes = np.clip(np.rint((groups - low16.astype(np.float32)) / safe), 0, 15)
        return codes.astype(np.uint8), scale16, low16

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        keys, vals = self._grouped(self._values(chunk))
        key_codes, key_scale, key_low = self._quantize(keys)
        val_codes, val_scale, val_low = self._quantize(vals)
        codes = np.concatenate((key_codes.reshape(-1), val_codes.reshape(-1)))
        packed = codes[0::2] | (codes[1::2] << 4)
        params = np.concatenate(
            [p.reshape(-1) for p in (key_scale, key_low, val_scale, val_low)]
        ).view(np.uint8)
        target = np.frombuffer(out, np.uint8)
        target[: len(packed)] = packed
        target[len(packed) : len(packed) + len(params)] = params
        return len(packed) + len(params)

    def decode(self, data: memoryview, out: memoryview) -> None:
        if len(data) != self.max_encoded_bytes():
            raise ValueError(f"{len(data)} bytes, an int4 chunk is {self.max_encoded_bytes()}")
        raw = np.frombuffer(data, np.uint8)
        packed = raw[: self._count // 2]
        codes = np.empty(self._count, np.float32)
        codes[0::2] = packed & 0x0F
        codes[1::2] = packed >> 4
        params = raw[self._count // 2 :].view(np.float16).astype(np.float32)
        kp, vp = self._key_params, self._value_params
        key_scale, key_low = params[:kp, None], params[kp : 2 * kp, None]
        val_scale, val_low = params[2 * kp : 2 * kp + vp, None], params[2 * kp + vp :, None]
        half = self._count // 2
        keys = codes[:half].reshape(-1, self._key_group) * key_scale + key_low
        vals = codes[half:].reshape(-1, self._value_group) * val_scale + val_low
        self._store(self._ungrouped(keys, vals), out)
