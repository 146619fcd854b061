"""SGLang's own pieces for the kvtier HiCache storage tests, built on the CPU.

Run as a script (``python sglang_pages.py SPEC OUT``) it is a fresh SGLang
rank: it builds a host pool and the kvtier backend through SGLang's factory
from a JSON spec, looks the spec's pages up, copies the ones it finds into
its host pool with the zero-copy API, and writes their SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

PAGE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 64


def host_pool(layout: str = "layer_first", *, heads: int = HEADS, page: int = PAGE) -> Any:
    """SGLang's MHA device pool on the CPU and the host pool HiCache builds over it."""
    device = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    info = device.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS,
    )


def mla_host_pool(layout: str = "layer_first") -> Any:
    """SGLang's MLA device pool on the CPU and its host pool (one latent vector per token)."""
    device = MLATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
        override_kv_cache_dim=device.kv_cache_dim,
    )


def write_weights(directory: Path, values: bytes) -> None:
    """A one-tensor ``model.safetensors`` holding ``values`` (a multiple of 4 bytes)."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(values) // 4], "data_offsets": [0, len(values)]}}
    ).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + values)


def model_dir(name: str = "tiny-llama") -> str:
    """A local model directory SGLang would serve: ``config.json`` and weights.

    The same ``name`` gives the same files in every process (a fresh rank of
    the same deployment finds the same model); another name, other weights.
    """
    directory = Path(tempfile.gettempdir()) / "kvtier-sglang-models" / name
    if not (directory / "config.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        write_weights(directory, hashlib.sha256(name.encode()).digest())
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "name": name}
        (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def storage_config(
    extra: dict[str, Any],
    *,
    model: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
) -> HiCacheStorageConfig:
    """What SGLang's cache controller hands a storage backend."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model_dir() if model is None else model or None,
        extra_config=extra,
    )


def extra_config(kvtier: dict[str, Any] | None = None, **keys: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` as docs/sglang.md writes it."""
    extra: dict[str, Any] = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1,
        **keys,
    }
    if kvtier is not None:
        extra["kvtier"] = kvtier
    return extra


def attach(pool: Any, extra: dict[str, Any], **config: Any) -> HiCacheStorage:
    """Build the backend as SGLang's cache controller attaches storage."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_hashes(tokens: list[int], page: int = PAGE) -> list[str]:
    """SGLang's own page hashes of ``tokens`` (each one chains the prefix)."""
    hashes = get_hash_str(tokens, None, page_size=page)
    assert isinstance(hashes, list)
    return hashes


def page_digest(pool: Any, start: int) -> str:
    data = pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def _main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    pool = host_pool(spec["layout"])
    backend = attach(pool, spec["extra"], **spec.get("config", {}))
    try:
        keys = spec["keys"]
        found = backend.batch_exists(keys)
        indices = torch.arange(PAGE * 8, PAGE * (8 + len(keys)), dtype=torch.int64)
        loaded = backend.batch_get_v1(keys[:found], indices[: found * PAGE])
        digests = [page_digest(pool, PAGE * (8 + i)) for i in range(found)]
    finally:
        backend.close()
    Path(out_file).write_text(json.dumps({"found": found, "loaded": loaded, "digests": digests}))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
