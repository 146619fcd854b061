"""KV-like chunks for tools and tests that have no engine at hand.

Values are normal with a few outlier channels in the keys, as real models'
keys carry; encoded in the layout's dtype.
"""

from __future__ import annotations

import numpy as np

from kvtier.layout import KVLayout


def kv_like(layout: KVLayout, seed: int = 0) -> bytes:
    """A chunk of ``layout`` holding KV-like float values (outlier channels in K)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(layout.chunk_shape).astype(np.float32)
    outliers = rng.choice(layout.head_dim, size=max(1, layout.head_dim // 16), replace=False)
    values[:, 0, :, :, outliers] *= 12.0  # keys carry a few large channels, as in real models
    return encode_floats(values, layout)


def encode_floats(values: np.ndarray, layout: KVLayout) -> bytes:
    """``values`` (float32) in the layout's dtype, as bytes."""
    if layout.dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16).tobytes()
    return values.astype(layout.dtype).tobytes()


def decode_floats(data: bytes | bytearray, layout: KVLayout) -> np.ndarray:
    """A chunk's bytes as float32 values of ``chunk_shape``."""
    raw = np.frombuffer(data, layout.numpy_dtype)
    if layout.dtype == "bfloat16":
        import ml_dtypes

        raw = raw.view(ml_dtypes.bfloat16)
    return raw.astype(np.float32).reshape(layout.chunk_shape)
