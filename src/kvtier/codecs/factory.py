"""``CodecFactory``: a tier's ``codec`` entry, resolved like tiers and policies.

``codec: NAME`` or ``codec: {type: NAME, module_path: ..., ...options}``:
built-ins by name, then installed entry points (group ``kvtier.codecs``),
then ``module_path`` (trusted input, confined by ``KVTIER_ALLOWED_MODULES``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.codecs.base import Codec, CodecOptions
from kvtier.codecs.stage import MAX_NAME_BYTES
from kvtier.layout import KVLayout
from kvtier.plugins import PluginRegistry

codec_registry: PluginRegistry[Codec] = PluginRegistry(
    kind="codec",
    base=Codec,
    entry_point_group="kvtier.codecs",
    builtins=[
        ("none", "kvtier.codecs.exact", "NoneCodec"),
        ("lossless", "kvtier.codecs.exact", "LosslessCodec"),
        ("fp8", "kvtier.codecs.quantized", "Fp8Codec"),
        ("int8", "kvtier.codecs.quantized", "Int8Codec"),
        ("int4", "kvtier.codecs.quantized", "Int4Codec"),
    ],
)


def register_codec(name: str, module_path: str, class_name: str) -> None:
    """Register a codec under ``name`` (``ValueError`` if taken)."""
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"codec name {name!r} is longer than {MAX_NAME_BYTES} bytes")
    codec_registry.register(name, module_path, class_name)


@dataclass(frozen=True)
class CodecConfig:
    """One validated ``codec`` entry of a secondary tier."""

    codec_type: str
    module_path: str | None
    codec_class: type[Codec]
    options: CodecOptions

    def build(self, layout: KVLayout) -> Codec:
        """The codec for ``layout``; :class:`~kvtier.codecs.base.CodecLayoutError`
        when it cannot encode it."""
        return self.codec_class(layout, self.options, name=self.codec_type)

    def as_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": self.codec_type,
            **self.options.model_dump(exclude_unset=True),
        }
        if self.module_path is not None:
            entry["module_path"] = self.module_path
        return entry


def split_codec_entry(raw: Any, entry: str) -> tuple[str, str | None, dict[str, Any]]:
    """``(type, module_path, options)`` of a ``codec`` entry; ``ValueError``
    naming what is wrong (the caller adds the path)."""
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"expected a codec name or a mapping with 'type', got {type(raw).__name__}"
        )
    options = dict(raw)
    codec_type = options.pop("type", None)
    module_path = options.pop("module_path", None)
    if not isinstance(codec_type, str) or not codec_type:
        raise ValueError("'type' is required: the codec's registered name or class name")
    if len(codec_type.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"codec type {codec_type!r} is longer than {MAX_NAME_BYTES} bytes")
    if module_path is not None and not isinstance(module_path, str):
        raise ValueError("module_path: expected a module name string")
    return codec_type, module_path, options


def codec_config(raw: Any, *, entry: str = "codec") -> CodecConfig:
    """Resolve and validate a raw ``codec`` entry (pydantic's
    ``ValidationError`` for bad options, plugin errors for bad names)."""
    codec_type, module_path, options = split_codec_entry(raw, entry)
    cls = codec_registry.resolve(codec_type, module_path, entry=entry)
    return CodecConfig(codec_type, module_path, cls, cls.Options.model_validate(options))
