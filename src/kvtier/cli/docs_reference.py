"""The configuration reference, rendered as Markdown from the typed option
declarations (attribute docstrings) of the config and of every registered
tier, so it cannot drift from the code. Reading a tier's ``Options`` never
imports its backend client; a tier module that does not import is listed
with the reason.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvtier.codecs import codec_registry
from kvtier.config import KVTierConfig
from kvtier.fleet.factory import index_registry
from kvtier.plugins import PluginRegistry
from kvtier.policies.factory import policy_registry
from kvtier.specs.factory import spec_registry
from kvtier.tiers.factory import tier_registry

#: Keys of every ``secondary_tiers`` entry, whatever its type.
ENTRY_KEYS = {
    "type": "The tier's registered name, entry point name, or class name (with ``module_path``).",
    "module_path": "Module to import an out-of-tree tier class from; configuration that names "
    "one is trusted input (see ``KVTIER_ALLOWED_MODULES``).",
    "codec": "How the tier stores each chunk: a codec name (``lossless``, ``fp8``...) or a "
    "mapping ``{type: NAME, ...options}``; unset is ``none``, the chunk's bytes "
    "(see Chunk codecs below).",
}

_ENTRY_TYPES = {"type": "str", "module_path": "str or null", "codec": "str, mapping or null"}

_UNITS = ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)
_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


@dataclass(frozen=True)
class OptionRow:
    """One documented key."""

    key: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class PluginDoc:
    """A registered tier, policy or spec, and its options when it has any."""

    name: str
    target: str
    summary: str
    options: type[BaseModel] | None
    error: str | None = None


def format_size(size: int) -> str:
    """``1073741824`` -> ``1GiB``; sizes that are no whole unit stay in bytes."""
    for unit, scale in _UNITS:
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def describe_type(annotation: Any) -> str:
    """A reader's name for a field's type (``size``, ``int or null``...)."""
    if annotation is type(None):
        return "null"
    if annotation is ByteSize:
        return "size"
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args)
    if origin in (dict, typing.Mapping) or annotation is dict:
        return "mapping"
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {describe_type(inner[0])}" if inner else "list"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def describe_default(field: FieldInfo) -> str:
    """The default as it would be written in YAML, or ``required``."""
    if field.is_required():
        return "required"
    factory = field.default_factory
    value = factory() if factory is not None else field.default  # type: ignore[call-arg]
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, ByteSize):
        return f"`{format_size(int(value))}`"
    if isinstance(value, PurePath):
        return f"`{value}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _bounds(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for attr, symbol in _BOUNDS:
            bound = getattr(item, attr, None)
            if bound is not None:
                found.append(f"{symbol} {bound}")
    return ", ".join(found)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def option_rows(model: type[BaseModel], prefix: str = "") -> list[OptionRow]:
    """Every key of ``model``, nested sections flattened to ``section.key``."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        type_text = describe_type(annotation)
        bounds = _bounds(field)
        rows.append(
            OptionRow(
                key=key,
                type=f"{type_text}, {bounds}" if bounds else type_text,
                default=describe_default(field),
                description=_cell(field.description or ""),
            )
        )
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(option_rows(annotation, prefix=f"{key}."))
    return rows


def options_table(rows: list[OptionRow]) -> str:
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r.key}` | {_cell(r.type)} | {r.default} | {r.description} |" for r in rows]
    return "\n".join(lines)


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return _cell(doc.split("\n\n")[0])


def plugin_docs(registry: PluginRegistry[Any], *, installed: bool = False) -> list[PluginDoc]:
    """Every name registered in ``registry``, resolved (never constructed); with
    ``installed``, then every name installed packages declare as an entry point."""
    targets = {name: registry.registered_target(name) for name in registry.registered_names()}
    out_of_tree = set()
    if installed:
        for name, target in sorted(registry.installed_targets().items()):
            if name not in targets:
                targets[name] = target
                out_of_tree.add(name)
    docs = []
    for name, target in targets.items():
        origin = "Installed from another package (an entry point). " if name in out_of_tree else ""
        try:
            cls = registry.resolve(name)
        except Exception as exc:  # a module that does not import: say so, go on
            cause = exc.__cause__ or exc
            error = f"{type(cause).__name__}: {cause}"
            docs.append(PluginDoc(name, target, origin.strip(), None, error))
            continue
        options = getattr(cls, "Options", None)
        if not (isinstance(options, type) and issubclass(options, BaseModel)):
            options = None
        docs.append(PluginDoc(name, target, origin + _summary(cls), options))
    return docs


def config_reference(heading_level: int = 2, *, installed: bool = False) -> str:
    """The whole reference as Markdown, its sections at ``heading_level``.

    With ``installed``, tiers, policies and specs that installed packages
    declare as entry points are listed too (``kvtier config-reference``);
    without, kvtier's own only (the user guide).
    """
    h2, h3 = "#" * heading_level, "#" * (heading_level + 1)
    top = [r for r in option_rows(KVTierConfig) if r.key != "secondary_tiers"]
    parts = [
        f"{h2} Top-level keys",
        options_table(top),
        f"{h2} Secondary tiers",
        "`secondary_tiers` is a list of tier entries, looked up in order. Every entry "
        "takes these keys, and the keys of its type below:",
        options_table(
            [
                OptionRow(key, _ENTRY_TYPES[key], d, _cell(text))
                for key, text in ENTRY_KEYS.items()
                for d in ["required" if key == "type" else "unset"]
            ]
        ),
    ]
    parts += _plugin_sections(tier_registry, h3, installed)
    parts += [
        f"{h2} Cluster index",
        "`index` (unset: none) names the store where nodes publish which chunks they hold, "
        "for routers and the `p2p` tier: `type`, `module_path` for an out-of-tree index "
        "(as for tiers), and the keys of its type:",
    ]
    parts += _plugin_sections(index_registry, h3, installed)
    parts.append(f"{h2} Chunk codecs")
    parts.append(
        "Values of a tier's `codec` (its `type`), each with the options a mapping may "
        "give it. Lossy codecs are an opt-in per tier: see the Chunk codecs guide."
    )
    parts += _plugin_sections(codec_registry, h3, installed)
    for title, key, registry in (
        ("Eviction policies", "eviction_policy", policy_registry),
        ("Offloading specs", "spec_name", spec_registry),
    ):
        parts.append(f"{h2} {title}")
        parts.append(f"Values of `{key}` that need no module path:")
        lines = ["| Name | Class | Description |", "| --- | --- | --- |"]
        for doc in plugin_docs(registry, installed=installed):
            text = doc.summary if doc.error is None else f"(does not import here: {doc.error})"
            lines.append(f"| `{doc.name}` | `{doc.target}` | {_cell(text)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _plugin_sections(registry: PluginRegistry[Any], h3: str, installed: bool) -> list[str]:
    """A section per registered plugin with options (tiers, cluster indexes)."""
    parts = []
    for doc in plugin_docs(registry, installed=installed):
        parts.append(f"{h3} `{doc.name}`")
        parts.append(f"Class `{doc.target}`." + (f" {doc.summary}" if doc.summary else ""))
        if doc.error is not None:
            parts.append(f"It does not import here, so its options are not listed: "
                         f"{_cell(doc.error)}")  # fmt: skip
        elif doc.options is None or not doc.options.model_fields:
            parts.append("No options.")
        else:
            parts.append(options_table(option_rows(doc.options)))
    return parts


__all__ = [
    "ENTRY_KEYS",
    "OptionRow",
    "PluginDoc",
    "config_reference",
    "describe_default",
    "describe_type",
    "format_size",
    "option_rows",
    "options_table",
    "plugin_docs",
]
