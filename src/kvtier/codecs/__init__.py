"""Chunk codecs: what a secondary tier stores for each chunk.

``none`` (the default) stores a chunk's bytes as they are; ``lossless``
stores them smaller and gives them back exactly; ``fp8``, ``int8`` and
``int4`` are lossy, an opt-in per tier. See docs/codecs.md.
"""

from kvtier.codecs.base import Codec, CodecLayoutError, CodecOptions
from kvtier.codecs.factory import (
    CodecConfig,
    codec_config,
    codec_registry,
    register_codec,
)
from kvtier.codecs.stage import CodecMismatchError, CodecStage

__all__ = [
    "Codec",
    "CodecConfig",
    "CodecLayoutError",
    "CodecMismatchError",
    "CodecOptions",
    "CodecStage",
    "codec_config",
    "codec_registry",
    "register_codec",
]
