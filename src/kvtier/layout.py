"""The shape of an engine's KV cache, and the namespace it implies."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np

#: Size of a chunk key and of a namespace digest, in bytes.
KEY_BYTES = 32

#: Bumped whenever the bytes kvtier stores for a chunk change meaning.
FORMAT_VERSION = 2

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class KVLayout:
    """Everything that decides the bytes of one chunk of KV cache.

    A chunk holds ``chunk_tokens`` consecutive tokens of one sequence across
    all layers, K and V. Two engines share chunks exactly when their layouts
    are equal, so every field here feeds the namespace digest.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int
    #: Order of the tensors inside a chunk; engines that store V before K, or
    #: K and V fused per head, must say so to never share bytes by accident.
    kv_order: str = "layer,kv,token,head,dim"
    #: Free-form engine facts that change the bytes (e.g. a quantisation scheme):
    #: ``(name, value)`` pairs of strings, each name once (a mapping is taken too).
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("model_id", "kv_order"):
            value = getattr(self, name)
            # An empty or absent model id would let every model of this shape share chunks.
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"KVLayout.{name} must be a non-empty str, got {value!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(_DTYPE_BYTES)}"
            )
        # Frozen: the checked pairs replace what was given (a list, a mapping).
        object.__setattr__(self, "extra", _extra_pairs(self.extra))

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk: one primary slot."""
        return self.bytes_per_token * self.chunk_tokens

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, chunk_tokens, kv_heads, head_dim)``: a chunk as an array."""
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @property
    def numpy_dtype(self) -> np.dtype:
        """A numpy dtype of the same width (bfloat16 travels as raw uint16)."""
        if self.dtype == "bfloat16":
            return np.dtype(np.uint16)
        if self.dtype.startswith("float8"):
            return np.dtype(np.uint8)
        return np.dtype(self.dtype)

    def describe(self) -> dict[str, object]:
        """A JSON-ready record of the layout and format version."""
        record: dict[str, object] = asdict(self)
        record["extra"] = dict(self.extra)
        record["format_version"] = FORMAT_VERSION
        return record

    @cached_property
    def namespace(self) -> bytes:
        """Digest of everything that changes the bytes; the root of every key chain."""
        canonical = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(
            canonical.encode(), digest_size=KEY_BYTES, person=b"kvtier-namespace"
        ).digest()


def _extra_pairs(extra: object) -> tuple[tuple[str, str], ...]:
    """``KVLayout.extra`` as a tuple of ``(name, value)`` string pairs, each
    name once: a name given twice, or a value that is not a string (``8``
    against ``"8"``), would key other bytes under one namespace, or the
    same bytes under two."""
    pairs = tuple(extra.items()) if isinstance(extra, Mapping) else extra
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Iterable):
        raise ValueError(f"KVLayout.extra must be (name, value) pairs of str, got {extra!r}")
    checked: list[tuple[str, str]] = []
    for pair in pairs:
        if (
            not isinstance(pair, tuple | list)
            or len(pair) != 2
            or not all(isinstance(part, str) for part in pair)
        ):
            raise ValueError(f"KVLayout.extra: {pair!r} is not a (name, value) pair of str")
        checked.append((pair[0], pair[1]))
    names = [name for name, _ in checked]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"KVLayout.extra names {twice} more than once")
    return tuple(checked)
