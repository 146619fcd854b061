"""AIBrix KV cache 0.8.0's L2 connectors, driven through their own API.

Systems: ``aibrix-shfs`` (``SHFS``: a file per chunk, written whole through
the page cache to a temporary name, then renamed) and ``aibrix-rocksdb``
(``ROCKSDB``: one value per chunk in a RocksDB database through rocksdict).
Each is built by ``Connector.create(ConnectorConfig(...))`` with its root
directory in its environment variable, as AIBrix configures it; chunks are
``MemoryRegion``s over one CPU slab, and every chunk's async ``put`` (or
``get``) is issued at once on an event loop, their blocking I/O running on a
``--threads`` thread pool (the connectors' executor). Run by
``bench_peers.py`` in ``.venv-aibrix``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import serve

BACKENDS = {"aibrix-shfs": "SHFS", "aibrix-rocksdb": "ROCKSDB"}


class AIBrixDriver:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.system not in BACKENDS:
            raise ValueError(f"unknown system {args.system!r}; expected one of {list(BACKENDS)}")
        self.args = args
        self.executor = ThreadPoolExecutor(args.threads)
        self.connector: Any = None

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        import torch
        from aibrix_kvcache.l2.connectors import Connector, ConnectorConfig
        from aibrix_kvcache.memory import MemoryRegion

        class SlabRegion(MemoryRegion):
            """A chunk of this driver's slab; the slab outlives every region."""

            def destroy_unsafe(self) -> None:
                pass

        backend = BACKENDS[self.args.system]
        os.environ[f"AIBRIX_KV_CACHE_OL_{backend}_ROOT"] = directory
        self.connector = Connector.create(
            ConnectorConfig(
                backend_name=backend,
                namespace="kvtier-bench",
                partition_id="0",
                executor=self.executor,
            )
        )
        status = self.connector.open()
        if not status.is_ok():
            raise RuntimeError(f"{backend} open: {status}")
        self.size = size = len(payloads[0])
        count = len(payloads)
        self.stored = torch.empty(count * size, dtype=torch.uint8)
        self.loaded = torch.zeros(count * size, dtype=torch.uint8)
        self.keys = [index.to_bytes(8, "big") + bytes(8) for index in range(count)]
        self.store_regions = [SlabRegion(self.stored, i * size, size) for i in range(count)]
        self.load_regions = [SlabRegion(self.loaded, i * size, size) for i in range(count)]
        for region, payload in zip(self.store_regions, payloads, strict=True):
            region.fill(payload)

    async def _all(self, method: str, regions: list[Any]) -> None:
        call = getattr(self.connector, method)
        statuses = await asyncio.gather(
            *(call(k, r) for k, r in zip(self.keys, regions, strict=True))
        )
        failed = [status for status in statuses if not status.is_ok()]
        if failed:
            raise RuntimeError(f"{len(failed)} {method}s failed; first: {failed[0]}")

    def store(self) -> None:
        asyncio.run(self._all("put", self.store_regions))

    def load(self) -> Sequence[Any]:
        asyncio.run(self._all("get", self.load_regions))
        size = self.size
        return [self.loaded[i * size : (i + 1) * size].numpy() for i in range(len(self.keys))]

    def clear(self) -> None:
        self.connector.close()
        self.connector = None


if __name__ == "__main__":
    serve(AIBrixDriver, __doc__.split("\n\n")[0])
