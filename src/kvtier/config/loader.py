"""The configuration's loader: one document, validated completely before anything starts.

A document is a dict, or a JSON or YAML file. :func:`load_config` checks every
key, resolves every tier, policy and spec class (out-of-tree ones included:
each declares typed options) and reports *all* problems at once, each with
its path (``secondary_tiers[1].root_dri``) and the nearest valid key.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import (
    BaseModel,
    SecretBytes,
    SecretStr,
    ValidationError,
)

from kvtier.codecs import CodecConfig, codec_registry
from kvtier.codecs.factory import split_codec_entry
from kvtier.config.model import IndexConfig, KVTierConfig, TierConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.fleet.factory import index_registry
from kvtier.plugins import PluginRegistry
from kvtier.policies.factory import policy_registry
from kvtier.specs.factory import spec_registry
from kvtier.tiers.factory import tier_registry

__all__ = ["load_config", "validate_options", "validate_tier"]

Problems = list[tuple[str, str]]
T = TypeVar("T")


def load_config(
    source: KVTierConfig | Mapping[str, Any] | str | Path | None = None,
) -> KVTierConfig:
    """Validate a configuration given as a dict, a JSON/YAML path, or ``None`` for defaults."""
    if isinstance(source, KVTierConfig):
        return source
    label = None
    if source is None:
        document: Any = {}
    elif isinstance(source, (str, Path)):
        label = str(source)
        document = _read_document(Path(source))
    else:
        document = source
    if not isinstance(document, Mapping):
        raise ConfigError([("", f"expected a mapping, got {type(document).__name__}")], label)

    problems: Problems = []
    document = dict(document)
    raw_index = document.pop("index", None)
    cluster_index = _validate_index(raw_index, problems) if raw_index is not None else None
    raw_tiers = document.pop("secondary_tiers", [])
    tiers: list[TierConfig] = []
    if not isinstance(raw_tiers, list):
        problems.append(("secondary_tiers", f"expected a list, got {type(raw_tiers).__name__}"))
    else:
        for index, raw in enumerate(raw_tiers):
            tier = _validate_tier(raw, f"secondary_tiers[{index}]", problems)
            if tier is not None:
                tiers.append(tier)
    try:
        config = KVTierConfig.model_validate(
            {**document, "secondary_tiers": tuple(tiers), "index": cluster_index}
        )
    except ValidationError as exc:
        problems.extend(_problems_from(exc, KVTierConfig, ""))
    else:
        # Resolved here, so a bad name fails before anything starts; the
        # registries keep the classes for the spec and the policy to build.
        _resolve_or_note(
            lambda: policy_registry.resolve(
                config.eviction_policy, config.cache_policy_module_path, entry="eviction_policy"
            ),
            "eviction_policy",
            problems,
        )
        _resolve_or_note(
            lambda: spec_registry.resolve(
                config.spec_name, config.spec_module_path, entry="spec_name"
            ),
            "spec_name",
            problems,
        )
        problems.extend(config.problems())
    if problems:
        raise ConfigError(problems, label)
    return config


def _read_document(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([("", f"cannot read config file: {exc}")], str(path)) from exc
    try:
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_json_object)
        return yaml.load(text, _YAMLLoader) or {}  # a SafeLoader: no object tags
    except (ValueError, yaml.YAMLError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(
            [("", f"not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}")], str(path)
        ) from exc


# A key given twice is a mistake (two ``max_bytes``, one edited), which both
# parsers would settle silently by keeping the last value.


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"key {key!r} given twice in one object")
        document[key] = value
    return document


class _YAMLLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice in one mapping
    (merged keys, ``<<``, may still be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:
                continue  # unhashable: the base class names it
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found key {key!r} given twice (first at line {first.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def validate_tier(raw: Any, path: str) -> TierConfig:
    """One secondary-tier entry validated on its own (class resolved, options
    typed), raising :class:`ConfigError` with every problem under ``path``."""
    problems: Problems = []
    tier = _validate_tier(raw, path, problems)
    if tier is None:
        raise ConfigError(problems)
    return tier


def _validate_tier(raw: Any, path: str, problems: Problems) -> TierConfig | None:
    codec = None
    if isinstance(raw, Mapping) and "codec" in raw:
        raw = dict(raw)
        codec = _validate_codec(raw.pop("codec"), f"{path}.codec", problems)
        if codec is None:
            return None
    plugin = _validate_plugin(raw, path, problems, tier_registry, "tier", ("codec",))
    return TierConfig(*plugin, codec) if plugin is not None else None


def _validate_index(raw: Any, problems: Problems) -> IndexConfig | None:
    plugin = _validate_plugin(raw, "index", problems, index_registry, "cluster index")
    return IndexConfig(*plugin) if plugin is not None else None


def _validate_plugin(
    raw: Any,
    path: str,
    problems: Problems,
    registry: PluginRegistry[Any],
    what: str,
    other_keys: tuple[str, ...] = (),
) -> tuple[str, str | None, type, Any] | None:
    """An entry's ``(type, module_path, class, validated options)``, or ``None``
    with its problems noted: a ``secondary_tiers`` entry, the ``index`` section.
    ``other_keys``: keys of the entry taken before (offered as suggestions)."""
    if not isinstance(raw, Mapping):
        problems.append((path, f"expected a mapping with 'type', got {type(raw).__name__}"))
        return None
    options = dict(raw)
    plugin_type = options.pop("type", None)
    module_path = options.pop("module_path", None)
    if not isinstance(plugin_type, str) or not plugin_type:
        problems.append((f"{path}.type", f"required: the {what}'s registered name or class name"))
        return None
    if module_path is not None and not isinstance(module_path, str):
        problems.append((f"{path}.module_path", "expected a module name string"))
        return None
    try:
        cls = registry.resolve(plugin_type, module_path, entry=path)
    except (KVTierError, TypeError) as exc:
        problems.append((f"{path}.type", str(exc).removeprefix(f"{path}: ")))
        return None
    try:
        validated = cls.Options.model_validate(options)
    except ValidationError as exc:
        problems.extend(
            _problems_from(exc, cls.Options, path, extra_keys=("type", "module_path", *other_keys))
        )
        return None
    return plugin_type, module_path, cls, validated


def _validate_codec(raw: Any, path: str, problems: Problems) -> CodecConfig | None:
    """A tier's ``codec`` entry (a name, or a mapping) resolved and its options
    validated like any plugin's, or ``None`` with the problems noted under
    ``path`` (``secondary_tiers[0].codec.bits``)."""
    try:
        codec_type, module_path, options = split_codec_entry(raw, path)
    except ValueError as exc:
        problems.append((path, str(exc)))
        return None
    entry = {"type": codec_type, "module_path": module_path, **options}
    plugin = _validate_plugin(entry, path, problems, codec_registry, "codec")
    return CodecConfig(*plugin) if plugin is not None else None


def _resolve_or_note(
    resolve: Callable[[], type[T]], path: str, problems: Problems
) -> type[T] | None:
    """The class ``resolve`` finds, or ``None`` with the problem noted at ``path``."""
    try:
        return resolve()
    except (KVTierError, TypeError) as exc:
        problems.append((path, str(exc).removeprefix(f"{path}: ")))
        return None


def validate_options(model: type[BaseModel], raw: Mapping[str, Any], path: str) -> BaseModel:
    """Validate ``raw`` against ``model``, raising :class:`ConfigError` with paths."""
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(_problems_from(exc, model, path)) from None


def _problems_from(
    exc: ValidationError, model: type[BaseModel], prefix: str, extra_keys: Iterable[str] = ()
) -> Problems:
    problems: Problems = []
    for error in exc.errors():
        loc = error["loc"]
        path = _join(prefix, loc)
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            valid = _field_names(model, loc[:-1]) + list(extra_keys if len(loc) == 1 else ())
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            message = "unknown key" + (f"; did you mean {close[0]!r}?" if close else "")
            message += f" Valid keys: {', '.join(sorted(valid))}."
        elif "input" in error and error["type"] not in ("missing",):
            # Never echo a secret (a peer secret, a password) into logs.
            shown = (
                "(value hidden)"
                if _is_secret(model, loc)
                else f"(got {_redacted(model, loc, error['input'])!r})"
            )
            message += " " + shown
        if error["type"].startswith("byte_size"):
            message += "; write a size such as 8GiB, 512MiB or 1073741824"
        problems.append((path, message))
    return problems


_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@")


def _redacted(model: type[BaseModel], loc: tuple[int | str, ...], value: Any) -> Any:
    """``value`` (found at ``loc`` of ``model``) with every secret in it masked.

    A model-level check reports its whole entry as the input, so the secret
    fields inside a mapping and the password of a URL (``redis://:pw@host``)
    anywhere in it are masked too.
    """
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\1***@", value)
    if isinstance(value, Mapping):
        return {
            key: "***" if _is_secret(model, (*loc, key)) else _redacted(model, (*loc, key), item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_redacted(model, (*loc, i), item) for i, item in enumerate(value))
    return value


def _join(prefix: str, loc: tuple[int | str, ...]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _is_secret(model: type[BaseModel], loc: tuple[int | str, ...]) -> bool:
    """Whether ``loc`` names a ``SecretStr``/``SecretBytes`` field (optional or not)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return False
        current = field.annotation
        kinds = typing.get_args(current) or (current,)
        if any(isinstance(k, type) and issubclass(k, (SecretStr, SecretBytes)) for k in kinds):
            return True
    return False


def _field_names(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        current = annotation
    return list(getattr(current, "model_fields", {}))
