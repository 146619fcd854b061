"""LMCache 0.5.6's storage, driven through its own ``StorageManager``.

Systems: ``lmcache-disk`` (``LocalDiskBackend``, buffered files),
``lmcache-disk-odirect`` (the same with ``use_odirect``) and ``lmcache-redis``
(``RemoteBackend`` over its redis connector). Chunks are ``MemoryObj``s
allocated from LMCache's CPU backend (``local_cpu`` off, so that it is only
the allocator, as with an engine offloading to disk or redis); a store is
``batched_put`` until the backend has written every chunk (on disk: each key
is in the disk index; redis: no put task left); a load is the backend's own
``batched_get_blocking``. Run by ``bench_peers.py`` in ``.venv-lmcache``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from common import serve

SYSTEMS = ("lmcache-disk", "lmcache-disk-odirect", "lmcache-redis")
GiB = 1 << 30
CHUNK_TOKENS = 256


class LMCacheDriver:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.system not in SYSTEMS:
            raise ValueError(f"unknown system {args.system!r}; expected one of {SYSTEMS}")
        self.args = args
        self.manager: Any = None
        self.redis_managers: dict[int, Any] = {}
        self.chunk = self.volume = 0
        self.objects: list[Any] = []
        self.loaded: list[Any] = []
        self.round = 0

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        self.chunk, self.volume = len(payloads[0]), len(payloads[0]) * len(payloads)
        if self.args.system == "lmcache-redis":
            # One connection per chunk size for the whole run: closing it can
            # hang in LMCache's event loop, so none is closed.
            if self.chunk not in self.redis_managers:
                self.redis_managers[self.chunk] = self._open(directory, torch, redis=True)
            self.manager = self.redis_managers[self.chunk]
        else:
            self.manager = self._open(directory, torch, redis=False)
        self.keys = [
            CacheEngineKey("kvtier-bench", 1, 0, self.round * len(payloads) + index, torch.uint8)
            for index in range(len(payloads))
        ]
        self.round += 1
        hidden = self.chunk // (2 * CHUNK_TOKENS)
        shape = torch.Size([2, 1, CHUNK_TOKENS, hidden])
        self.objects = []
        for payload in payloads:
            obj = self.manager.allocate(shape, torch.uint8, fmt=MemoryFormat.KV_2LTD)
            if obj is None:
                raise MemoryError("LMCache's CPU allocator is full")
            obj.tensor.view(-1).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self.objects.append(obj)

    def _open(self, directory: str, torch: Any, redis: bool) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        # Room for the round's chunks twice over (stored, then loaded back).
        cpu_gib = 2.5 * self.volume / GiB + 0.05
        options: dict[str, Any] = {
            "chunk_size": CHUNK_TOKENS,
            "local_cpu": False,
            "max_local_cpu_size": cpu_gib,
            "extra_config": {"disk_io_threads": self.args.threads},
        }
        if redis:
            options.update(remote_url=self.args.redis_url.rsplit("/", 1)[0], remote_serde="naive")
        else:
            options.update(
                local_disk=directory + "/", max_local_disk_size=2 * self.volume / GiB + 0.05
            )
            options["extra_config"]["use_odirect"] = self.args.system.endswith("odirect")
        config = LMCacheEngineConfig.from_defaults(**options)
        hidden = self.chunk // (2 * CHUNK_TOKENS)
        metadata = LMCacheMetadata(
            model_name="kvtier-bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 2, CHUNK_TOKENS, 1, hidden),
        )
        return StorageManager(config, metadata, EventManager())

    @property
    def backend(self) -> Any:
        """The storage backend under test: the manager's one besides the CPU allocator."""
        [name] = [n for n in self.manager.storage_backends if n != "LocalCPUBackend"]
        return self.manager.storage_backends[name]

    def store(self) -> None:
        # batched_put hands each object to the backends and drops the caller's reference.
        self.manager.batched_put(self.keys, self.objects)
        self.objects = []
        # Stored: the disk backend indexes a key once its file is written; the
        # redis connector writes a key's bytes, then its metadata, which
        # contains() asks for. (Its batched put leaves no put task to wait on.)
        pending = list(self.keys)
        while pending:
            pending = [key for key in pending if not self.backend.contains(key)]
            if pending:
                time.sleep(0.0005)

    def load(self) -> Sequence[Any]:
        self.loaded = self.backend.batched_get_blocking(self.keys)
        return [None if obj is None else obj.byte_array for obj in self.loaded]

    def clear(self) -> None:
        for obj in self.loaded:
            if obj is not None:
                obj.ref_count_down()
        self.loaded = []
        if self.args.system == "lmcache-redis":
            # Its redis connector has no remove(): empty the database instead.
            import redis as redis_client

            redis_client.Redis.from_url(self.args.redis_url).flushdb()
        else:
            self.manager.close()
        self.manager = None


if __name__ == "__main__":
    serve(LMCacheDriver, __doc__.split("\n\n")[0])
