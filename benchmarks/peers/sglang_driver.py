"""SGLang 0.5.23's HiCache file backend, ``HiCacheFile``, driven through its own API.

System: ``sglang-file``. ``HiCacheFile`` writes each page whole through the
page cache (``numpy.tofile`` to a temporary name, then a rename) and reads it
back with ``readinto``; it is synchronous, called by SGLang's HiCache
controller from one storage thread, as here: one ``batch_set`` of every chunk
(CPU tensors), then one ``batch_get`` into preallocated tensors. Run by
``bench_peers.py`` in ``.venv-sglang``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from common import serve


class SGLangFileDriver:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.system != "sglang-file":
            raise ValueError(f"unknown system {args.system!r}; expected 'sglang-file'")
        self.args = args
        self.backend: Any = None

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        config = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="kvtier-bench",
            extra_config={"file_storage_path": directory},
        )
        self.backend = HiCacheFile(config)
        size = len(payloads[0])
        self.keys = [f"{index:032x}" for index in range(len(payloads))]
        self.values = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
        self.targets = [torch.zeros(size, dtype=torch.uint8) for _ in payloads]

    def store(self) -> None:
        if not self.backend.batch_set(self.keys, self.values):
            raise RuntimeError("HiCacheFile batch_set failed")

    def load(self) -> Sequence[Any]:
        loaded = self.backend.batch_get(self.keys, self.targets)
        return [None if tensor is None else tensor.numpy() for tensor in loaded]

    def clear(self) -> None:
        self.backend = None


if __name__ == "__main__":
    serve(SGLangFileDriver, __doc__.split("\n\n")[0])
