"""Exact codecs: ``none`` (the bytes as they are) and ``lossless``.

``lossless`` splits each element into byte planes (for bf16 the sign and
high exponent bits in one plane, the mantissa's low byte in the other), so
the exponent plane, which repeats much, compresses; then zstd or lz4. It
gives back the input bytes, always; a chunk that would not shrink is kept raw.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Literal, cast

import numpy as np
from pydantic import Field

from kvtier.codecs.base import Codec, CodecOptions
from kvtier.errors import MissingDependencyError
from kvtier.layout import KVLayout

_RAW, _PACKED = 0, 1
#: The unsigned word of each element width.
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class NoneCodec(Codec):
    """The chunk's bytes, unchanged: what every tier stores by default."""

    #: Tiers store such chunks with no codec header at all, as they always did.
    identity: ClassVar[bool] = True
    returns_promptly: ClassVar[bool] = True

    def max_encoded_bytes(self) -> int:
        return self.layout.slot_bytes

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        out[: len(chunk)] = chunk
        return len(chunk)

    def decode(self, data: memoryview, out: memoryview) -> None:
        if len(data) != len(out):
            raise ValueError(f"{len(data)} bytes for a {len(out)}-byte chunk")
        out[:] = data


class LosslessOptions(CodecOptions):
    compressor: Literal["zstd", "lz4"] = "zstd"
    """Entropy coder after the byte-plane split."""

    level: int = Field(default=1, ge=-7, le=19)
    """zstd level (negative: faster, larger); lz4 ignores it. Higher levels
    gain little on KV and cost much encode speed (see docs/codecs.md)."""


class LosslessCodec(Codec):
    """Byte planes, then zstd or lz4: exact, and smaller where the KV allows."""

    Options: ClassVar[type[CodecOptions]] = LosslessOptions
    fixed_size: ClassVar[bool] = False
    returns_promptly: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, options: CodecOptions | None = None, **kwargs: Any):
        super().__init__(layout, options, **kwargs)
        self._opts = opts = cast(LosslessOptions, self.options)
        self._width = layout.dtype_bytes
        self._local = threading.local()
        try:
            if opts.compressor == "zstd":
                import zstandard

                self._zstd = zstandard
            else:
                import lz4.block

                self._lz4 = lz4.block
        except ImportError as exc:
            raise MissingDependencyError(
                "zstandard" if opts.compressor == "zstd" else "lz4", "codecs"
            ) from exc

    def max_encoded_bytes(self) -> int:
        return 1 + self.layout.slot_bytes

    def _planes(self, chunk: memoryview) -> np.ndarray:
        """Byte ``i`` of every element, for each ``i``, one plane after the other."""
        # Shifts over whole words, not a strided transpose: several times faster.
        words = np.frombuffer(chunk, _WORDS[self._width])
        planes = np.empty((self._width, len(words)), np.uint8)
        for index in range(self._width):
            planes[index] = words >> (8 * index)
        return planes

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        planes = self._planes(chunk) if self._width > 1 else np.frombuffer(chunk, np.uint8)
        packed = self._compress(planes)
        target = np.frombuffer(out, np.uint8)
        if len(packed) >= len(chunk):  # incompressible: kept raw
            target[0] = _RAW
            target[1 : 1 + len(chunk)] = np.frombuffer(chunk, np.uint8)
            return 1 + len(chunk)
        target[0] = _PACKED
        target[1 : 1 + len(packed)] = np.frombuffer(packed, np.uint8)
        return 1 + len(packed)

    def decode(self, data: memoryview, out: memoryview) -> None:
        if len(data) < 1:
            raise ValueError("empty lossless chunk")
        mode, body = data[0], data[1:]
        target = np.frombuffer(out, np.uint8)
        if mode == _RAW:
            if len(body) != len(out):
                raise ValueError(f"raw chunk of {len(body)} bytes for a {len(out)}-byte slot")
            target[:] = np.frombuffer(body, np.uint8)
            return
        if mode != _PACKED:
            raise ValueError(f"unknown lossless mode {mode}")
        planes = np.frombuffer(self._decompress(body, len(out)), np.uint8)
        if len(planes) != len(out):
            raise ValueError(f"decoded to {len(planes)} bytes, a chunk is {len(out)}")
        if self._width == 1:
            target[:] = planes
            return
        planes = planes.reshape(self._width, -1)
        words = np.frombuffer(out, _WORDS[self._width])
        words[:] = planes[0]
        for index in range(1, self._width):
            words |= planes[index].astype(words.dtype) << (8 * index)

    def _compress(self, data: np.ndarray) -> bytes:
        options = self._opts
        if options.compressor == "lz4":
            return bytes(self._lz4.compress(data, store_size=False))
        # A compressor object serves one thread at a time: one per worker.
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._zstd.ZstdCompressor(level=options.level)
            self._local.compressor = compressor
        return bytes(compressor.compress(np.ascontiguousarray(data).data))

    def _decompress(self, body: memoryview, size: int) -> bytes:
        if self._opts.compressor == "lz4":
            return bytes(self._lz4.decompress(body, uncompressed_size=size))
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._zstd.ZstdDecompressor()
            self._local.decompressor = decompressor
        return bytes(decompressor.decompress(body, max_output_size=size))
