"""The worker half of the connector: page copies between vLLM's KV cache and the slots.

Runs in vLLM's worker process beside the model. Every copy is one gather
and one scatter per layer over the step's pages, with torch ops, so the same
code moves pages of CPU tensors and of device tensors (a device gather is
followed by one transfer to or from host memory).
"""

from __future__ import annotations

import logging

import torch

from kvtier.primary import SlotBuffer

from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, PageCopies, SharedBuffer
from .settings import VllmGeometry

logger = logging.getLogger(__name__)


class _LayerPages:
    """One layer's KV tensor seen as ``[num_blocks, ...page]`` without copying."""

    def __init__(self, name: str, tensor: torch.Tensor, shape: VllmGeometry) -> None:
        dims = [d for d, size in enumerate(tensor.shape) if size == shape.num_blocks]
        if not dims:
            raise ValueError(
                f"KV cache of {name} has shape {tuple(tensor.shape)}: no dimension "
                f"of num_blocks={shape.num_blocks}"
            )
        # The block dimension is the outermost one of that size (the CPU and
        # flash layouts put it first or right after the K/V dimension).
        self.pages = tensor.movedim(dims[0], 0)
        page_bytes = tensor.numel() // shape.num_blocks * tensor.element_size()
        if page_bytes != shape.page_bytes:
            raise ValueError(
                f"KV cache of {name}: {page_bytes} bytes per block, expected {shape.page_bytes}"
            )
        self.page_shape = tuple(self.pages.shape[1:])
        self.dtype = tensor.dtype
        self.device = tensor.device

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Pages of ``block_ids`` as host ``uint8`` rows ``[n, page_bytes]``."""
        pages = self.pages.index_select(0, block_ids.to(self.device))
        return pages.to("cpu").contiguous().view(torch.uint8).reshape(len(block_ids), -1)

    def scatter(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write host ``uint8`` rows ``[n, page_bytes]`` into the pages of ``block_ids``."""
        pages = rows.contiguous().view(self.dtype).reshape(len(block_ids), *self.page_shape)
        self.pages.index_copy_(0, block_ids.to(self.device), pages.to(self.device))


class WorkerSide:
    """Copies pages as the step's metadata says; reports what ended and how."""

    def __init__(self, shape: VllmGeometry) -> None:
        self.shape = shape
        self._layers: list[_LayerPages] = []
        self._buffer: SlotBuffer | None = None
        self._slots: torch.Tensor | None = None  # [num_slots, layers, blocks_per_chunk, page]
        self._broken: str | None = None
        self._attached_reported = False
        self._finished: dict[int, tuple[bool, bool]] = {}
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.shape.layer_names if name not in kv_caches]
        if missing:
            self._broken = f"no KV cache registered for layers {missing}"
            logger.error("kvtier: %s; offloading disabled", self._broken)
            return
        try:
            self._layers = [
                _LayerPages(name, kv_caches[name], self.shape) for name in self.shape.layer_names
            ]
        except ValueError as exc:
            self._broken = str(exc)
            logger.error("kvtier: %s; offloading disabled", exc)

    # Per step ---------------------------------------------------------------

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        self._load_errors.update(meta.failed_block_ids)
        if not meta.loads:
            return
        ok = self._copy(meta, meta.loads, loading=True)
        if not ok:
            self._load_errors.update(meta.loads.block_ids)
        self._finished[meta.step] = (ok, True)

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        if not meta.stores:
            return
        ok = self._copy(meta, meta.stores, loading=False)
        loads_ok = self._finished.get(meta.step, (True, True))[0]
        self._finished[meta.step] = (loads_ok, ok)

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        attached = self._buffer is not None and not self._attached_reported
        if not self._finished and not attached:
            return None
        self._attached_reported = self._attached_reported or attached
        finished, self._finished = self._finished, {}
        return KVTierWorkerMetadata(finished, attached)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._slots = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    # Machinery ---------------------------------------------------------------

    def _copy(self, meta: KVTierConnectorMetadata, copies: PageCopies, *, loading: bool) -> bool:
        slots = self._attach(meta.buffer)
        if slots is None:
            return False
        try:
            slot_index = torch.tensor(copies.slots, dtype=torch.long)
            position = torch.tensor(copies.positions, dtype=torch.long)
            block_ids = torch.tensor(copies.block_ids, dtype=torch.long)
            for layer, pages in enumerate(self._layers):
                if loading:
                    pages.scatter(block_ids, slots[slot_index, layer, position])
                else:
                    slots[slot_index, layer, position] = pages.gather(block_ids)
        except Exception:
            logger.exception(
                "kvtier: %s of %d pages failed", "load" if loading else "store", len(copies)
            )
            return False
        return True

    def _attach(self, buffer: SharedBuffer) -> torch.Tensor | None:
        if self._broken is None and not self._layers:
            # Copying no layers would "succeed" and offload empty slots.
            self._broken = "vLLM registered no KV caches with the connector"
            logger.error("kvtier: %s; offloading disabled", self._broken)
        if self._broken is not None:
            return None
        if self._slots is not None:
            return self._slots
        expected = self.shape.num_layers * self.shape.blocks_per_chunk * self.shape.page_bytes
        if buffer.slot_bytes != expected:
            self._broken = (
                f"primary slots are {buffer.slot_bytes} bytes but this worker's chunk is "
                f"{expected} bytes"
            )
            logger.error("kvtier: %s; offloading disabled", self._broken)
            return None
        try:
            self._buffer = SlotBuffer.attach(buffer.name, buffer.num_slots, buffer.slot_bytes)
        except (OSError, ValueError) as exc:
            self._broken = f"cannot map shared memory {buffer.name!r}: {exc}"
            logger.error("kvtier: %s; offloading disabled", self._broken)
            return None
        flat = torch.frombuffer(self._buffer.view.cast("B"), dtype=torch.uint8)
        self._slots = flat.view(
            buffer.num_slots, self.shape.num_layers, self.shape.blocks_per_chunk, -1
        )
        return self._slots
