"""What the connector reads from vLLM's configuration: kvtier's config and the KV layout.

Both connector roles (scheduler and worker, often in different processes)
derive the same :class:`VllmGeometry` from the same ``kv_cache_config``, so
they agree on where every byte of a chunk goes without talking.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import Field

from kvtier.config import KVTierConfig, load_config, validate_options
from kvtier.errors import ConfigError, LayoutMismatchError
from kvtier.inputs import unwritable_file_problem
from kvtier.layout import KVLayout
from kvtier.options import Options

from .identity import model_identity, model_name
from .shared_memory import engine_buffer_name


class ConnectorOptions(Options):
    """The connector's own keys in ``kv_connector_extra_config``."""

    # The connector owns its extra config (Options forbids unknown keys): a
    # misspelt key is a start-up error naming the nearest valid one, not a
    # silent fallback to defaults.
    kvtier: dict[str, Any] | None = None
    """The kvtier configuration document, inline."""

    kvtier_config_file: str | None = None
    """Path of a JSON or YAML kvtier configuration (instead of ``kvtier``)."""

    kvtier_model_id: str | None = None
    """Declares the weights' identity instead of reading their files; whoever sets
    it must change it whenever the weights change (see docs/vllm.md)."""

    kvtier_weights_identity: Literal["sampled", "full"] = "sampled"
    """How the weight files are identified: sampled (sizes, times, headers and
    windows of every tensor) or by reading every byte at start-up."""

    kvtier_lookup_timeout_s: float = Field(default=5.0, ge=0)
    """How long a request may wait for promotions from secondary tiers before it
    goes ahead with the chunks that are ready (the rest is recomputed)."""

    kvtier_idle_wait_s: float = Field(default=0.05, ge=0)
    """While the engine has no other request, how long a lookup waits in place
    for the promotions it started before vLLM's next step asks again (``0``:
    never wait; a request waiting on promotions then costs an engine step per ask)."""

    kvtier_stats_file: str | None = None
    """Write the connector's and every tier's counters here (JSON) at shutdown."""

    kvtier_kv_events: bool = True
    """Publish every chunk a kvtier tier stores or drops as a vLLM KV-cache event
    (``BlockStored`` / ``BlockRemoved``), when vLLM's ``kv_events_config`` turns
    KV-cache events on."""

    kvtier_kv_events_media: dict[str, str] = Field(default_factory=dict)
    """The ``medium`` of a tier's events, by tier: ``cpu`` (the primary tier), a
    secondary tier's type, or ``type:n`` where a type repeats. Unnamed tiers
    are ``kvtier:<tier>``."""

    kvtier_kv_events_max_chunks: int = Field(default=16384, ge=1)
    """Chunks whose vLLM block hashes are remembered, to announce their removal
    (about 1.8 KB each for 256-token chunks)."""

    kvtier_kv_events_max_queued: int = Field(default=65536, ge=1)
    """Tier changes held between two engine steps; more are dropped and counted."""


@dataclass(frozen=True)
class VllmGeometry:
    """How one kvtier chunk maps onto vLLM's paged KV cache.

    A primary slot holds every worker's share of the chunk: one part per
    rank, pipeline stage by stage and, within a stage, tensor-parallel rank
    by rank. A rank's part holds its ``layers × blocks_per_chunk`` vLLM pages
    in that order (``part[layer][block]``); a page is whatever bytes vLLM
    keeps for one block of one layer on that rank (its share of the KV
    heads), copied verbatim, so the page format goes into the layout's
    namespace instead of being interpreted. The scheduler side never looks
    inside a slot, so its bookkeeping and every secondary tier see one chunk
    whatever the parallel layout.
    """

    #: The layers whose pages this process's KV cache holds (its pipeline stage).
    layer_names: tuple[str, ...]
    block_size: int
    blocks_per_chunk: int
    #: Bytes of one page of one layer on one rank.
    page_bytes: int
    num_blocks: int
    tensor_parallel_size: int = 1
    #: Layers of each pipeline stage; empty means one stage of ``layer_names``.
    stage_layers: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        """Layers of this process's stage."""
        return len(self.layer_names)

    @property
    def stages(self) -> tuple[int, ...]:
        return self.stage_layers or (self.num_layers,)

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * len(self.stages)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk: every rank's part."""
        return (
            sum(self.stages) * self.tensor_parallel_size * self.blocks_per_chunk * self.page_bytes
        )

    def part(self, pp_rank: int, tp_rank: int) -> tuple[int, int]:
        """``(offset, bytes)`` of one rank's part of a slot."""
        if not (0 <= pp_rank < len(self.stages) and 0 <= tp_rank < self.tensor_parallel_size):
            raise ValueError(
                f"rank (pp={pp_rank}, tp={tp_rank}) outside pipeline_parallel_size="
                f"{len(self.stages)}, tensor_parallel_size={self.tensor_parallel_size}"
            )
        layer_bytes = self.blocks_per_chunk * self.page_bytes
        before = sum(self.stages[:pp_rank]) * self.tensor_parallel_size
        before += tp_rank * self.stages[pp_rank]
        return before * layer_bytes, self.stages[pp_rank] * layer_bytes


def connector_options(extra_config: Mapping[str, Any] | None) -> ConnectorOptions:
    options = validate_options(ConnectorOptions, extra_config or {}, "kv_connector_extra_config")
    return cast(ConnectorOptions, options)


def check_stats_file(options: ConnectorOptions) -> None:
    """Fail at start on a stats file no file can be written at: it is written
    at shutdown, too late to say so."""
    path = options.kvtier_stats_file
    problem = None if path is None else unwritable_file_problem(path)
    if problem is not None:
        raise ConfigError([("kv_connector_extra_config.kvtier_stats_file", problem)])


def kvtier_config(options: ConnectorOptions) -> KVTierConfig:
    """The kvtier configuration named by the connector options (defaults if none)."""
    if options.kvtier is not None and options.kvtier_config_file is not None:
        raise ConfigError(
            [
                (
                    "kv_connector_extra_config",
                    "set either 'kvtier' (inline) or 'kvtier_config_file', not both",
                )
            ]
        )
    if options.kvtier_config_file is not None:
        return load_config(options.kvtier_config_file)
    return load_config(options.kvtier or {})


def with_shared_memory(config: KVTierConfig, engine_id: str | None) -> KVTierConfig:
    """The config with a ``shared_memory_name`` workers can find, unless one is set.

    Without an ``engine_id`` (vLLM always sets one) workers map the slots at
    their first copy instead of at start-up.
    """
    if config.shared_memory_name is not None:
        return config
    name = engine_buffer_name(engine_id or uuid.uuid4().hex, os.getpid())
    return config.model_copy(update={"shared_memory_name": name})


def geometry(vllm_config: Any, kv_cache_config: Any, chunk_tokens: int) -> VllmGeometry:
    """The chunk geometry for this engine; rejects what kvtier cannot serve."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise LayoutMismatchError(
            f"kvtier's vLLM connector supports models with one KV cache group "
            f"(full attention); this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    # A sliding-window or chunked-local cache hands the blocks of tokens
    # outside its window back (vLLM's block table then names a shared null
    # block there): pages stored from them would not be those tokens' KV.
    if not isinstance(spec, FullAttentionSpec):
        raise LayoutMismatchError(
            f"kvtier's vLLM connector serves full-attention KV caches; this model's is "
            f"{type(spec).__name__}, which drops the pages of tokens outside its window"
        )
    # A layer attending both ways (a prefix LM) computes a prefix's KV from the
    # tokens after it too; vLLM turns its own prefix caching off for it.
    if getattr(spec, "non_causal", False):
        raise LayoutMismatchError(
            "kvtier's vLLM connector serves causal models; this one has non-causal "
            "attention layers, whose KV of a prefix depends on the tokens after it"
        )
    block_size = int(spec.block_size)
    if chunk_tokens % block_size:
        raise ConfigError(
            [
                (
                    "chunk_tokens",
                    f"{chunk_tokens} is not a multiple of vLLM's block_size={block_size}; "
                    f"use e.g. {max(1, chunk_tokens // block_size) * block_size}",
                )
            ]
        )
    layer_names = tuple(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    return VllmGeometry(
        layer_names=layer_names,
        block_size=block_size,
        blocks_per_chunk=chunk_tokens // block_size,
        page_bytes=int(spec.page_size_bytes),
        num_blocks=int(kv_cache_config.num_blocks),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        stage_layers=_stage_layers(vllm_config, len(layer_names)),
    )


def _stage_layers(vllm_config: Any, own_layers: int) -> tuple[int, ...]:
    """Layers of each pipeline stage, as vLLM splits them.

    Each process sees only its own stage's layers; every process must still
    agree on the whole slot, so the split is recomputed from the model.
    """
    stages = int(vllm_config.parallel_config.pipeline_parallel_size)
    if stages == 1:
        return (own_layers,)
    from vllm.distributed.utils import get_pp_indices

    total = int(vllm_config.model_config.get_total_num_hidden_layers())
    split = []
    for stage in range(stages):
        start, end = get_pp_indices(total, stage, stages)
        split.append(end - start)
    if own_layers not in split:
        raise LayoutMismatchError(
            f"this pipeline stage has {own_layers} KV cache layers, but vLLM splits the "
            f"model's {total} layers into stages of {split}; kvtier serves pipeline "
            f"parallelism only where every layer has one KV cache"
        )
    return tuple(split)


def kv_layout(
    vllm_config: Any,
    kv_cache_config: Any,
    chunk_tokens: int,
    model_id: str | None = None,
    *,
    full_read: bool = False,
) -> tuple[KVLayout, VllmGeometry]:
    """The :class:`KVLayout` of this engine's KV cache, and its chunk geometry.

    vLLM's page format depends on the platform, the attention backend and, on
    the CPU, the instruction set its kernels were picked for (which transposes
    keys inside a page); all of it goes into ``kv_order`` and ``extra`` so
    that engines with incompatible page formats never share a chunk. The
    model's identity (resolved config and weights, or ``model_id`` declared
    for the weights) goes into ``extra`` so that other weights never do either.
    """
    import torch
    import vllm

    shape = geometry(vllm_config, kv_cache_config, chunk_tokens)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    element_bytes = torch.empty((), dtype=spec.dtype).element_size()
    expected_page = 2 * spec.num_kv_heads * spec.head_size * shape.block_size * element_bytes
    if shape.page_bytes != expected_page:
        raise LayoutMismatchError(
            f"vLLM's KV page is {shape.page_bytes} bytes, not the {expected_page} bytes of "
            f"plain K and V ({spec.num_kv_heads} heads × {spec.head_size} dims × "
            f"{shape.block_size} tokens × {dtype}); padded or quantised caches are not "
            f"supported"
        )
    device, backend, isa = _page_format(vllm_config, spec, shape.block_size)
    major_minor = ".".join(str(vllm.__version__).split(".")[:2])
    identity = model_identity(vllm_config, model_id=model_id, full_read=full_read)
    layout = KVLayout(
        model_id=model_id or model_name(vllm_config.model_config),
        # The whole chunk: every stage's layers, every tensor-parallel rank's heads.
        num_layers=sum(shape.stages),
        num_kv_heads=int(spec.num_kv_heads) * shape.tensor_parallel_size,
        head_dim=int(spec.head_size),
        dtype=dtype,
        chunk_tokens=chunk_tokens,
        kv_order=(
            f"vllm-pages:stage,tp_rank,layer,block[{shape.blocks_per_chunk}],"
            f"page[{shape.page_bytes}]"
        ),
        extra=(
            *identity.layout_extra,
            ("engine", f"vllm-{major_minor}"),
            ("device", device),
            ("attention_backend", backend),
            ("attention_isa", isa),
            ("block_size", str(shape.block_size)),
            ("kv_cache_dtype", str(vllm_config.cache_config.cache_dtype)),
            # Layers left unquantised hold other bytes than the quantised ones.
            (
                "kv_cache_dtype_skip_layers",
                ",".join(getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", ())),
            ),
            # Each rank's pages hold its share of the heads (and a stage's
            # layers): another parallel layout means other bytes per slot part.
            ("tensor_parallel_size", str(shape.tensor_parallel_size)),
            ("pipeline_parallel_size", str(len(shape.stages))),
            # Context parallelism spreads each block's tokens over ranks, so a
            # rank's page holds other tokens than without it.
            *_context_parallel(vllm_config.parallel_config),
        ),
    )
    if layout.slot_bytes != shape.slot_bytes:
        raise LayoutMismatchError(
            f"layout slot_bytes={layout.slot_bytes} differs from {sum(shape.stages)} layers × "
            f"{shape.tensor_parallel_size} ranks × {shape.blocks_per_chunk} blocks × "
            f"{shape.page_bytes}-byte pages"
        )
    return layout, shape


def _context_parallel(parallel: Any) -> tuple[tuple[str, str], ...]:
    """Namespace entries of the context-parallel layout (none without it)."""
    fields = (
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
        "cp_kv_cache_interleave_size",
    )
    values = {field: int(getattr(parallel, field, 1) or 1) for field in fields}
    if values[fields[0]] == values[fields[1]] == 1:
        # No context parallelism (the interleave size means nothing then):
        # the namespace stays as it was before these entries existed.
        return ()
    return tuple((field, str(value)) for field, value in values.items())


def _page_format(vllm_config: Any, spec: Any, block_size: int) -> tuple[str, str, str]:
    """(device type, attention backend, kernel ISA) — what decides a page's byte order."""
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend = str(getattr(configured, "name", configured) or "auto")
    isa = "n/a"
    if current_platform.is_cpu():
        backend = "CPU_ATTN"
        isa = _cpu_attention_isa(spec, block_size, vllm_config.cache_config.cache_dtype)
    return device, backend, isa


def _cpu_attention_isa(spec: Any, block_size: int, cache_dtype: str) -> str:
    """The kernel family vLLM's CPU attention picks; it decides how a page is packed."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(spec.dtype, block_size, spec.head_size, cache_dtype))
    except Exception:  # vLLM's private helper moved or changed: fall back to CPU facts
        pass
    import platform

    import torch

    return (
        f"{platform.machine()}:amx={torch.cpu._is_amx_tile_supported()}"
        f":avx512={torch.cpu._is_avx512_supported()}"
    )
