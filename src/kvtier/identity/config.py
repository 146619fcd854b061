"""A digest of a model's configuration: the part of its identity that is not weights.

Engines hand over their resolved configuration as a plain mapping (Hugging
Face's ``config.to_dict()``, plus whatever the engine resolves beside it:
dtype, quantization, revision). Bookkeeping that never changes the KV bytes
is dropped, so that the same model configured the same way gets the same
digest on every machine, whatever directory it was loaded from.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
from collections.abc import Collection, Mapping
from typing import Any

#: Top-level config entries that never change the KV bytes of a given set of
#: weights: bookkeeping, output switches, training-only settings, and the
#: checkpoint's dtype (engines record the dtype they compute in).
IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "id2label",
        "label2id",
        "problem_type",
        "initializer_range",
        "attention_dropout",
        "chunk_size_feed_forward",
    }
)

# Nested configs (a multimodal model's text_config) carry bookkeeping too;
# keys starting with "_" (such as "_name_or_path") are dropped at every level.
_NESTED_IGNORED = frozenset({"transformers_version"})

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def config_digest(
    config: Mapping[str, Any], *, ignored: Collection[str] = IGNORED_CONFIG_KEYS
) -> str:
    """A short hex digest of every entry of ``config`` that can change the KV bytes.

    ``ignored`` names top-level entries to leave out (defaults to
    :data:`IGNORED_CONFIG_KEYS`); entries whose name starts with ``_`` are
    left out at every level. Values are canonicalised: mappings by key,
    enums by value, dtypes and classes by name, dataclasses and pydantic
    models by their fields.
    """
    entries = {
        str(key): _canonical(value)
        for key, value in config.items()
        if key not in ignored and not str(key).startswith("_")
    }
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=12, person=b"kvtier-config").hexdigest()


def _canonical(value: Any) -> Any:
    """A JSON-ready form of ``value`` that is equal for equal configurations."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, Mapping):
        return {
            str(key): _canonical(item)
            for key, item in value.items()
            if not str(key).startswith("_") and key not in _NESTED_IGNORED
        }
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, set | frozenset):
        items = [_canonical(item) for item in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # a transformers PretrainedConfig, nested
        return _canonical(to_dict())
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):  # a pydantic model
        return _canonical(model_dump())
    if dataclasses.is_dataclass(value):
        return {
            field.name: _canonical(getattr(value, field.name, None))
            for field in dataclasses.fields(value)
            if not field.name.startswith("_")
        }
    # A dtype, a device, anything else: its text, without memory addresses
    # (which differ between processes and would only cost cache hits).
    return _ADDRESS.sub("", repr(value))
