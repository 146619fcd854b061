"""``KVTierHiCacheStorage``: the class SGLang's dynamic storage backend factory
builds. One SGLang page is one kvtier chunk; calls from SGLang's prefetch
and backup threads are serialised under one lock.

See docs/sglang.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvtier.facade import HeldPrefix, KVCache
from kvtier.keys import ChunkKey, chain_key

from .engine_config import (
    kvtier_config,
    model_facts,
    page_layout,
    storage_options,
    with_page_tokens,
)

logger = logging.getLogger(__name__)

#: Fills a slot (store) or reads one (load): ``fn(index_in_batch, slot_bytes)``.
_SlotCopier = Callable[[int, np.ndarray], None]

#: Pause between polls while promotions from secondary tiers are in flight.
_POLL_S = 0.0005


class KVTierHiCacheStorage(HiCacheStorage):
    """kvtier as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

    Configured by SGLang's storage backend extra config: ``{"kvtier": {...}}``
    holds a kvtier configuration inline, or ``{"kvtier_config_file": PATH}``
    names one; see :class:`~kvtier.integrations.sglang.engine_config.StorageOptions`
    for the other keys. Both of SGLang's page interfaces work: ``get`` /
    ``set`` / ``batch_*`` with page tensors, and, with ``"interface_v1": 1``,
    ``batch_get_v1`` / ``batch_set_v1`` with host pool indices.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        """Validate the options and the kvtier configuration; tiers start when
        SGLang registers its host pool (the pool decides the page layout)."""
        self.storage_config = storage_config
        self.options = storage_options(storage_config.extra_config)
        self.config = kvtier_config(self.options)
        self._lock = threading.RLock()
        self._kv: KVCache | None = None
        self.mem_pool_host: Any = None

    # Set-up -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Start kvtier for the pages of ``mem_pool_host`` (once per backend)."""
        with self._lock:
            if self._kv is not None:
                raise RuntimeError("kvtier: a host pool is already registered with this backend")
            model = model_facts(self.storage_config, mem_pool_host, self.options.kvtier_model_id)
            layout = page_layout(mem_pool_host, self.storage_config, model)
            self._kv = KVCache(with_page_tokens(self.config, layout.chunk_tokens), layout)
            self.mem_pool_host = mem_pool_host
            self._dtype = mem_pool_host.dtype
            # Pages go through the primary tier a window at a time, so a batch
            # larger than the primary tier still goes through, and half the
            # slots stay free for the write-through cascades in flight.
            self._window = max(1, self._kv.status.primary.num_slots // 2)
            logger.info(
                "kvtier HiCache storage: %d-token pages of %d bytes (%s), namespace %s, "
                "%d primary slots, secondary tiers: %s",
                layout.chunk_tokens,
                layout.slot_bytes,
                mem_pool_host.layout,
                layout.namespace.hex()[:16],
                self._kv.status.primary.num_slots,
                self._kv.status.tier_types or "none",
            )

    @property
    def kv(self) -> KVCache:
        """The kvtier cache behind this backend (after :meth:`register_mem_pool_host`)."""
        if self._kv is None:
            raise RuntimeError("kvtier: SGLang has not registered a host pool yet")
        return self._kv

    def page_keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """kvtier keys of SGLang page hashes, inside this deployment's namespace."""
        namespace = self.kv.layout.namespace
        return [chain_key(namespace, (), str(page).encode()) for page in page_hashes]

    # Page API ---------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages kvtier holds; those found in a secondary tier
        are promoted into the primary tier on the way."""
        found = 0
        for window in self._windows(self.page_keys(keys)):
            ready = self._ready(window)
            found += ready
            if ready < len(window):
                break
        return found

    def get(
        self,
        key: str,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """The leading pages kvtier holds, copied into ``target_locations``
        (flat page tensors) or new ones; ``None`` from the first missing page on."""
        page_keys = self.page_keys(keys)
        targets = list(target_locations or [None] * len(keys))
        if len(targets) != len(keys):
            raise ValueError(f"batch_get: {len(keys)} keys but {len(targets)} target locations")
        for index, target in enumerate(targets):
            if target is None:
                targets[index] = self.mem_pool_host.get_dummy_flat_data_page()
            else:
                self._check_page(f"target_locations[{index}]", target)
                if not target.is_contiguous():
                    raise ValueError(f"target_locations[{index}]: must be contiguous")

        def into_target(index: int, slot: np.ndarray) -> None:
            _bytes_of(targets[index])[:] = slot

        found = self._read(page_keys, into_target)
        return [targets[i] if i < found else None for i in range(len(keys))]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors; ``True`` when kvtier holds every page afterwards."""
        page_keys = self.page_keys(keys)
        pages = list(values or [])
        if len(pages) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {len(pages)} values")
        for index, page in enumerate(pages):
            self._check_page(f"values[{index}]", page)

        def from_value(index: int, slot: np.ndarray) -> None:
            slot[:] = _bytes_of(pages[index])

        return all(self._write(page_keys, from_value))

    # Zero-copy API (``"interface_v1": 1``) ------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy the leading pages kvtier holds straight into the host pool at
        ``host_indices`` (``page_size`` indices per page)."""
        starts = self._page_starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        pool, dtype = self.mem_pool_host, self._dtype

        def into_pool(index: int, slot: np.ndarray) -> None:
            pool.set_from_flat_data_page(starts[index], torch.from_numpy(slot).view(dtype))

        found = self._read(self.page_keys(keys), into_pool)
        return [i < found for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``."""
        starts = self._page_starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        pool = self.mem_pool_host

        def from_pool(index: int, slot: np.ndarray) -> None:
            slot[:] = _bytes_of(pool.get_data_page(starts[index], flat=True))

        return self._write(self.page_keys(keys), from_pool)

    # Lifecycle ----------------------------------------------------------------

    def clear(self) -> bool:
        """Empty the primary tier; secondary tiers keep their pages (other
        engines may share them)."""
        with self._lock:
            if self._kv is not None:
                self._kv.reset()
        return True

    def close(self) -> None:
        """Wait for the writes in flight to reach every tier, then stop them."""
        with self._lock:
            if self._kv is not None:
                self._kv.close()
                self._kv = None

    # Machinery ----------------------------------------------------------------

    def _ready(self, keys: Sequence[ChunkKey]) -> int:
        """Leading ``keys`` ready in the primary tier, after waiting (at most
        ``kvtier_lookup_timeout_s``) for promotions from secondary tiers."""
        with self._held(keys) as found:
            return found.num_chunks

    def _held(self, keys: Sequence[ChunkKey]) -> HeldPrefix:
        """The leading ``keys`` kvtier holds, pinned, once finished transfers are
        collected and promotions waited for (see :meth:`_ready`)."""
        kv = self._collected()
        return kv.lookup(
            kv.chunks(keys), timeout=self.options.kvtier_lookup_timeout_s, poll_s=_POLL_S
        )

    def _collected(self) -> KVCache:
        """The cache, its finished transfers collected first (they free primary slots)."""
        kv = self.kv
        with self._lock:
            kv.step()
        return kv

    def _windows(self, keys: Sequence[ChunkKey]) -> list[Sequence[ChunkKey]]:
        return [keys[start : start + self._window] for start in range(0, len(keys), self._window)]

    def _read(self, keys: Sequence[ChunkKey], sink: _SlotCopier) -> int:
        """Hand the slot of each leading page kvtier holds to ``sink``; how many."""
        found = 0
        for window in self._windows(keys):
            ready = self._read_window(window, _shifted(sink, found))
            found += ready
            if ready < len(window):
                break
        return found

    def _read_window(self, keys: Sequence[ChunkKey], sink: _SlotCopier) -> int:
        # Each page handed to ``sink`` as soon as it is ready, while later ones
        # are still promoted; pinned until then, so no other thread's store
        # can evict a page before it is read.
        kv = self._collected()
        loaded = kv.load_prefix(
            kv.chunks(keys), sink, timeout=self.options.kvtier_lookup_timeout_s, poll_s=_POLL_S
        )
        return loaded // kv.chunk_tokens

    def _write(self, keys: Sequence[ChunkKey], source: _SlotCopier) -> list[bool]:
        """Fill a primary slot per new page from ``source``; they then cascade to
        every secondary tier. Per page: whether kvtier holds it now."""
        held: list[bool] = []
        for window in self._windows(keys):
            held += self._write_window(window, _shifted(source, len(held)))
        return held

    def _write_window(self, keys: Sequence[ChunkKey], source: _SlotCopier) -> list[bool]:
        kv = self.kv
        pages = kv.chunks(keys)
        with self._lock:
            kv.step()  # finished cascades unpin their slots first
            kv.store(pages, source)
            held = kv.status.holds(keys)
            if not all(held):
                # Every slot is pinned by cascades still writing: wait for them.
                kv.drain()
                kv.store(pages, source)
                held = kv.status.holds(keys)
            if not all(held):
                logger.warning(
                    "kvtier: no room in the primary tier for %d pages (%d slots); "
                    "raise cpu_bytes_to_use",
                    len(keys),
                    kv.status.primary.num_slots,
                )
            return held

    def _page_starts(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int] | None:
        """First host pool index of each page, or ``None`` (logged) if they do not fit."""
        page_tokens = self.kv.layout.chunk_tokens
        if host_indices.numel() != len(keys) * page_tokens:
            logger.error(
                "kvtier: %d pages of %d tokens need %d host indices, got %d",
                len(keys),
                page_tokens,
                len(keys) * page_tokens,
                host_indices.numel(),
            )
            return None
        return [int(index) for index in host_indices[::page_tokens].tolist()]

    def _check_page(self, what: str, page: Any) -> None:
        if not isinstance(page, torch.Tensor):
            raise TypeError(f"{what}: expected a page tensor, got {type(page).__name__}")
        nbytes = page.numel() * page.element_size()
        if nbytes != self.kv.layout.slot_bytes or page.device.type != "cpu":
            raise ValueError(
                f"{what}: a {nbytes}-byte tensor on {page.device}; this backend stores "
                f"{self.kv.layout.slot_bytes}-byte pages from host (CPU) memory"
            )


def _bytes_of(page: torch.Tensor) -> np.ndarray:
    """The bytes of a page tensor as a flat ``uint8`` array (a view when contiguous)."""
    return page.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _shifted(copier: _SlotCopier, offset: int) -> _SlotCopier:
    """``copier`` for a window that starts at page ``offset`` of the batch."""
    return lambda index, slot: copier(offset + index, slot)
