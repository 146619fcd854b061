"""What the storage backend reads from SGLang: its options, kvtier's config, the page layout.

SGLang hands a backend its ``--hicache-storage-backend-extra-config`` dict
(``HiCacheStorageConfig.extra_config``), which also carries SGLang's own keys
(``backend_name``, ``module_path``, ``interface_v1``, ...). The backend's own
keys all start with ``kvtier``; a misspelt one fails at start with the
nearest valid key instead of being silently ignored.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import ConfigDict, Field

from kvtier.config import KVTierConfig, load_config, validate_options
from kvtier.errors import ConfigError, LayoutMismatchError
from kvtier.identity import (
    AdapterIdentities,
    ModelIdentity,
    config_digest,
    declared_weights,
    identify_weights,
    locate_model,
    weights_identity,
)
from kvtier.layout import KVLayout
from kvtier.options import Options

#: Where SGLang's users write these keys, for error paths.
EXTRA_CONFIG = "hicache_storage_backend_extra_config"

#: Keys of the extra config that SGLang itself (or its dynamic factory) reads.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


class StorageOptions(Options):
    """The backend's own keys in SGLang's storage backend extra config."""

    model_config = ConfigDict(extra="ignore")

    kvtier: dict[str, Any] | None = None
    """The kvtier configuration document, inline."""

    kvtier_config_file: str | None = None
    """Path of a JSON or YAML kvtier configuration (instead of ``kvtier``)."""

    kvtier_model_id: str | None = None
    """Model identity in the page namespace; defaults to SGLang's model name."""

    kvtier_lookup_timeout_s: float = Field(default=5.0, ge=0)
    """How long an existence check may wait for promotions from secondary tiers
    before it reports the pages that are ready (the rest count as misses)."""


def storage_options(extra_config: Mapping[str, Any] | None) -> StorageOptions:
    """Validate the backend's keys of ``extra_config``; SGLang's own keys pass through."""
    extra = dict(extra_config or {})
    own = set(StorageOptions.model_fields)
    problems = []
    for key in sorted(set(extra) - own - SGLANG_KEYS, key=str):
        close = difflib.get_close_matches(str(key), sorted(own), n=1)
        if str(key).startswith("kvtier") or close:
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(
                (
                    f"{EXTRA_CONFIG}.{key}",
                    f"unknown key{hint} Valid keys: {', '.join(sorted(own))}.",
                )
            )
    if problems:
        raise ConfigError(problems)
    options = validate_options(StorageOptions, extra, EXTRA_CONFIG)
    return cast(StorageOptions, options)


def kvtier_config(options: StorageOptions) -> KVTierConfig:
    """The kvtier configuration the options name (defaults if none), validated."""
    if options.kvtier is not None and options.kvtier_config_file is not None:
        raise ConfigError(
            [(EXTRA_CONFIG, "set either 'kvtier' (inline) or 'kvtier_config_file', not both")]
        )
    if options.kvtier_config_file is not None:
        return load_config(options.kvtier_config_file)  # errors name the file
    try:
        return load_config(options.kvtier or {})
    except ConfigError as error:
        # Inline, the document sits under the ``kvtier`` key of SGLang's flag.
        where = f"{EXTRA_CONFIG}.kvtier"
        raise ConfigError(
            [(f"{where}.{path}" if path else where, message) for path, message in error.problems]
        ) from None


def with_page_tokens(config: KVTierConfig, page_tokens: int) -> KVTierConfig:
    """``config`` with one kvtier chunk per SGLang page.

    A chunk is the unit of lookup and transfer and SGLang's page is the unit
    it asks for, so they must be the same; an explicit ``chunk_tokens`` that
    differs is an error, not silently replaced.
    """
    if "chunk_tokens" in config.model_fields_set and config.chunk_tokens != page_tokens:
        raise ConfigError(
            [
                (
                    "chunk_tokens",
                    f"{config.chunk_tokens} differs from SGLang's page size of {page_tokens} "
                    f"tokens; leave chunk_tokens unset or set it to {page_tokens}",
                )
            ]
        )
    return config.model_copy(update={"chunk_tokens": page_tokens})


@dataclass(frozen=True)
class ModelFacts:
    """The model part of the page namespace: a name, and what identifies its KV."""

    #: A readable name: the declared ``kvtier_model_id``, else the architecture.
    name: str
    #: ``config`` and ``weights`` entries of the layout (:class:`ModelIdentity`).
    extra: tuple[tuple[str, str], ...]


def model_facts(storage_config: Any, host_pool: Any, declared_id: str | None) -> ModelFacts:
    """What identifies the KV of the model SGLang serves, the same way for every
    integration (:mod:`kvtier.identity`): a digest of the model's ``config.json``
    and an identity of its weights files, found from SGLang's model path.

    SGLang hands storage backends its model path (tagged with the host pool's
    page format, which the layout records anyway). A model kvtier cannot find
    on disk (or in the hub cache) fails closed: without ``kvtier_model_id``
    nothing would tell its weights apart after an in-place update.
    """
    name = getattr(storage_config, "model_name", None)
    tag = getattr(host_pool, "storage_format_tag", None)
    if name and tag and name.endswith(f"-{tag}"):
        name = name[: -len(tag) - 1]
    server_args = launch_server_args()
    settings = kv_server_settings(server_args)
    # The snapshot SGLang loaded: of its --revision, in its --download-dir.
    revision = getattr(server_args, "revision", None)
    cache_dirs = _cache_dirs(getattr(server_args, "download_dir", None))
    directory = locate_model(name, revision=revision, cache_dirs=cache_dirs) if name else None
    config: dict[str, Any] = {}
    if directory is not None and (directory / "config.json").is_file():
        config = json.loads((directory / "config.json").read_text())
    load_format = str(getattr(settings.get("load_format"), "value", settings.get("load_format")))
    if declared_id is not None:
        weights = declared_weights(declared_id)
    elif settings and load_format not in FILE_LOAD_FORMATS:
        raise ConfigError(
            [
                (
                    f"{EXTRA_CONFIG}.kvtier_model_id",
                    f"SGLang loads the weights with --load-format {load_format}, not from "
                    "files kvtier can read, so kvtier cannot tell when they change; set "
                    "kvtier_model_id (and change it whenever the weights change)",
                )
            ]
        )
    else:
        found = (
            identify_weights(name, revision=revision, cache_dirs=cache_dirs)
            if directory is not None and name
            else None
        )
        if found is None:
            what = f"{name!r} is neither a local model directory nor a cached hub snapshot"
            raise ConfigError(
                [
                    (
                        f"{EXTRA_CONFIG}.kvtier_model_id",
                        f"SGLang's model {what if name else 'has no name'}, so kvtier cannot "
                        "tell when its weights change; set kvtier_model_id (and change it "
                        "whenever the weights change)",
                    )
                ]
            )
        weights = found.token
    architectures = config.get("architectures") or ["model"]
    if settings:  # read inside a server only: outside one there is none to read
        config = {**config, "kvtier_sglang_server": settings}
    if load_format == "dummy":  # random weights: this process's own KV
        weights = f"dummy:{uuid.uuid4().hex}"
    identity = ModelIdentity(config_digest(config), weights)
    extra = identity.layout_extra + adapter_facts(launch_lora_paths(server_args))
    return ModelFacts(declared_id or str(architectures[0]), extra)


#: SGLang launch arguments that change the KV a model computes from the same
#: files: on-the-fly quantisation (``--quantization``, ModelOpt's), compute
#: and KV dtypes, config overrides and how the config is parsed, the context
#: length (SGLang hands it to the model in its config), causal or embedding
#: attention, remote code, the revision, and how and from where weights load.
KV_SERVER_ARGS = (
    "dtype",
    "quantization",
    "quantization_param_path",
    "kv_cache_dtype",
    "qsa_indexer_dtype",
    "json_model_override_args",
    "model_config_parser",
    "decrypted_config_file",
    "context_length",
    "is_embedding",
    "trust_remote_code",
    "revision",
    "load_format",
    "model_loader_extra_config",
    "custom_weight_loader",
    "model_impl",
    "modelopt_quant",
    "modelopt_checkpoint_restore_path",
    "quantize_and_serve",
    "rl_quant_profile",
    "kt_method",
    "kt_weight_path",
)

#: Arguments naming files (or directories) whose content counts, not their path.
FILE_SERVER_ARGS = (
    "quantization_param_path",
    "decrypted_config_file",
    "modelopt_checkpoint_restore_path",
    "kt_weight_path",
)

#: Load formats that read the weights from the model's files (or its hub
#: snapshot); the others (another instance, remote storage, IPC, private
#: loaders) need ``kvtier_model_id``. ``dummy``: random weights, never shared.
FILE_LOAD_FORMATS = frozenset(
    {
        "None",
        "auto",
        "pt",
        "safetensors",
        "instanttensor",
        "npcache",
        "dummy",
        "sharded_state",
        "presharded",
        "gguf",
        "bitsandbytes",
        "mistral",
        "layered",
        "fastsafetensors",
    }
)


def _cache_dirs(download_dir: Any) -> tuple[str | None, ...]:
    return (str(download_dir), None) if download_dir else (None,)


def launch_server_args() -> Any:
    """The arguments SGLang's server was launched with, or ``None`` outside a
    server (a backend built by hand: no arguments were published)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError):
        return None


def kv_server_settings(server_args: Any) -> dict[str, Any]:
    """:data:`KV_SERVER_ARGS` as given at launch (JSON overrides parsed, the
    files of :data:`FILE_SERVER_ARGS` by the identity of their content)."""
    if server_args is None:
        return {}
    settings = {name: getattr(server_args, name, None) for name in KV_SERVER_ARGS}
    overrides = settings["json_model_override_args"]
    if isinstance(overrides, str) and overrides.strip():
        with contextlib.suppress(ValueError):  # kept as written: still one digest per text
            settings["json_model_override_args"] = json.loads(overrides)
    for name in FILE_SERVER_ARGS:
        path = settings[name]
        if isinstance(path, str) and path and Path(path).exists():
            settings[name] = weights_identity(path).token
    return settings


def launch_lora_paths(server_args: Any) -> Any:
    """SGLang's ``--lora-paths`` as the server was launched with them, or
    ``None`` outside a server or with LoRA off."""
    if server_args is None or getattr(server_args, "enable_lora", None) is False:
        return None
    return getattr(server_args, "lora_paths", None)


def adapter_facts(lora_paths: Any) -> tuple[tuple[str, str], ...]:
    """The identities of the LoRA adapters SGLang loads at launch, for the namespace.

    SGLang seeds the page hashes of an adapter's requests with the adapter's
    id, and for an adapter of ``--lora-paths`` that id derives from its name
    and path alone: servers holding other files under one name and path
    would share pages. A backend sees page hashes only, so the identities of
    these adapters' files (:class:`AdapterIdentities`) enter the namespace of
    every page, with their names and paths: servers share pages exactly when
    they launch with the same adapters. (Adapters loaded later through
    SGLang's API get random ids, so their pages are never shared.) An adapter
    whose files cannot be identified fails the start.
    """
    identities = AdapterIdentities()
    facts = []
    for name, path in sorted(preloaded_adapters(lora_paths)):
        token = identities.token(name, 0, path)
        if token is None:
            raise ConfigError(
                [
                    (
                        "lora_paths",
                        f"kvtier cannot identify LoRA adapter {name!r} at {path!r} (neither a "
                        "local path nor in the local Hugging Face cache), so it cannot tell "
                        "when its files change; download it first, or run without kvtier",
                    )
                ]
            )
        facts.append(f"{name}\0{path}\0{token}")
    return (("lora", "\n".join(facts)),) if facts else ()


def preloaded_adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """``(name, path)`` of each adapter in SGLang's ``lora_paths``: strings
    ``NAME=PATH`` or ``PATH``, dicts, a ``{name: path}`` mapping, or the
    ``LoRARef`` records SGLang parses them into."""
    items = list(lora_paths.items()) if isinstance(lora_paths, Mapping) else (lora_paths or [])
    adapters = []
    for item in items:
        if isinstance(item, tuple):
            name, path = item
        elif isinstance(item, str):
            name, _, path = item.partition("=")
            path = path or name
        elif isinstance(item, Mapping):
            name, path = item["lora_name"], item["lora_path"]
        else:
            name, path = item.lora_name, item.lora_path
        adapters.append((str(name), str(path)))
    return adapters


def shard_facts(storage_config: Any) -> tuple[tuple[str, str], ...]:
    """Which slice of the model's KV this rank holds.

    Every TP rank holds other heads of an MHA model, so the TP rank and size
    are part of the namespace; an MLA model's KV is the same on every TP rank
    (SGLang's ``is_mla_model``), so its ranks share pages. Pipeline stages
    hold other layers; context-parallel ranks other slices of each page.
    """
    config = storage_config
    facts = [("pp", f"{config.pp_rank}/{config.pp_size}")]
    if not config.is_mla_model:
        facts.append(("tp", f"{config.tp_rank}/{config.tp_size}"))
    if getattr(config, "attn_cp_size", 1) > 1:
        facts.append(("attn_cp", f"{config.attn_cp_rank}/{config.attn_cp_size}"))
    if getattr(config, "dcp_size", 1) > 1:
        facts.append(("dcp", f"{config.dcp_rank}/{config.dcp_size}"))
        facts.append(("tp_size", str(config.tp_size)))
        facts.append(("logical_page_size", str(config.logical_page_size)))
    return tuple(facts)


def page_bytes(host_pool: Any) -> int:
    """Bytes of one page as the host pool reads and writes it flat."""
    page = host_pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def page_layout(host_pool: Any, storage_config: Any, model: ModelFacts) -> KVLayout:
    """The :class:`KVLayout` of one SGLang page: a kvtier chunk is one page.

    The host pool's layout (``layer_first``, ``page_first``, ...) decides the
    byte order of a flat page, so it goes into the namespace with the pool
    class, the dtype and this rank's shard: two deployments that differ in
    any of them share nothing. An MHA pool is described by its real geometry;
    other pools (MLA, ...) by their page size in bytes.
    """
    import sglang

    tokens = int(host_pool.page_size)
    nbytes = page_bytes(host_pool)
    dtype = str(host_pool.dtype).removeprefix("torch.")
    layout_name = str(host_pool.layout)
    major_minor = ".".join(str(sglang.__version__).split(".")[:2])
    extra = (
        *model.extra,
        ("engine", f"sglang-{major_minor}"),
        ("host_pool", type(host_pool).__name__),
        ("host_layout", layout_name),
        ("page_dtype", dtype),
        ("page_bytes", str(nbytes)),
        *shard_facts(storage_config),
    )
    heads = getattr(host_pool, "head_num", None)
    head_dim = getattr(host_pool, "head_dim", None)
    if heads and head_dim and head_dim == getattr(host_pool, "v_head_dim", None):
        try:
            layout = KVLayout(
                model_id=model.name,
                num_layers=int(host_pool.layer_num),
                num_kv_heads=int(heads),
                head_dim=int(head_dim),
                dtype=dtype,
                chunk_tokens=tokens,
                kv_order=f"sglang-page:{layout_name}",
                extra=extra,
            )
        except ValueError:  # a dtype kvtier does not name: the bytes path below
            pass
        else:
            if layout.slot_bytes == nbytes:
                return layout
    if nbytes % (2 * tokens):
        raise LayoutMismatchError(
            f"SGLang's {type(host_pool).__name__} pages are {nbytes} bytes, which kvtier "
            f"cannot split into K and V halves of {tokens} tokens"
        )
    # Not plain K/V heads: the page travels as opaque bytes, described by the
    # facts above rather than interpreted.
    return KVLayout(
        model_id=model.name,
        num_layers=1,
        num_kv_heads=1,
        head_dim=nbytes // (2 * tokens),
        dtype="uint8",
        chunk_tokens=tokens,
        kv_order=f"sglang-page-bytes:{layout_name}",
        extra=extra,
    )
