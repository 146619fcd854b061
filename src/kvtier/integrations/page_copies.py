"""Page copies between an engine's paged KV cache and primary slots, on any device.

Needs torch alone (not the engine), so ``scripts/device_check.py`` runs it on
any machine with an accelerator. The same torch ops serve every device. On
the CPU a copy is a plain gather or scatter. On an accelerator (CUDA, or any
torch device module with streams and events) every copy runs on a dedicated
copy stream, ordered against the compute stream with events, and moves
through pinned host memory, so the compute stream never waits on a host copy:

* store: the copy stream waits for the forward pass that computed the
  pages, gathers them on the device and copies them to pinned host memory;
  the compute stream only waits (on the device) for the gather, so blocks
  vLLM frees are not overwritten before they were read. The host rows are
  written into the slots once the copy's event has fired.
* load: the rows are gathered from the slots into pinned host memory, copied
  to the device and scattered into the pages on the copy stream; the compute
  stream waits (on the device) for that before the forward pass reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)


class LayerPages:
    """One layer's KV tensor seen as ``[num_blocks, ...page]`` without copying."""

    def __init__(self, name: str, tensor: torch.Tensor, num_blocks: int, page_bytes: int) -> None:
        dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
        if not dims:
            raise ValueError(
                f"KV cache of {name} has shape {tuple(tensor.shape)}: no dimension "
                f"of num_blocks={num_blocks}"
            )
        # The block dimension is the outermost one of that size (the CPU and
        # flash layouts put it first or right after the K/V dimension).
        self.pages = tensor.movedim(dims[0], 0)
        found = tensor.numel() // num_blocks * tensor.element_size()
        if found != page_bytes:
            raise ValueError(f"KV cache of {name}: {found} bytes per block, expected {page_bytes}")
        self.page_shape = tuple(self.pages.shape[1:])
        self.dtype = tensor.dtype
        self.device = tensor.device

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Pages of ``block_ids`` as ``uint8`` rows ``[n, page_bytes]`` on the KV's device."""
        pages = self.pages.index_select(0, block_ids)
        return pages.contiguous().view(torch.uint8).reshape(len(block_ids), -1)

    def scatter(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``uint8`` rows ``[n, page_bytes]`` on the KV's device into ``block_ids``."""
        pages = rows.contiguous().view(self.dtype).reshape(len(block_ids), *self.page_shape)
        self.pages.index_copy_(0, block_ids, pages)


@dataclass
class PendingStore:
    """A step's store: rows on their way to host memory, then into the slots."""

    #: Whether the device copies have ended (always true on the CPU).
    ready: Callable[[], bool] = lambda: True
    #: Waits for the device copies, then writes the rows into the slots.
    complete: Callable[[], None] = lambda: None
    failed_early: bool = False
    _result: bool | None = field(default=None, init=False)

    @classmethod
    def failed(cls) -> PendingStore:
        return cls(failed_early=True)

    def done(self) -> bool:
        """Whether :meth:`finish` would return without waiting (never raises)."""
        if self.failed_early or self._result is not None:
            return True
        try:
            return self.ready()
        except Exception:  # an asynchronous device error: finish() reports it
            return True

    def finish(self) -> bool:
        """Wait for the copies and land them; whether every page reached its slot."""
        if self._result is None:
            if self.failed_early:
                self._result = False
            else:
                try:
                    self.complete()
                    self._result = True
                except Exception:
                    logger.exception("kvtier: storing pages failed")
                    self._result = False
        return self._result


class CopyIndex(NamedTuple):
    """Page ``i`` moves between block ``block_ids[i]`` and page ``positions[i]`` of
    slot ``slots[i]``, for every layer."""

    slots: torch.Tensor
    positions: torch.Tensor
    block_ids: torch.Tensor

    @classmethod
    def of(cls, slots: list[int], positions: list[int], block_ids: list[int]) -> CopyIndex:
        return cls(*(torch.tensor(v, dtype=torch.long) for v in (slots, positions, block_ids)))


class Transfers:
    """Runs page copies: inline on the CPU, on a copy stream on an accelerator.

    ``slots`` is a host ``uint8`` tensor ``[num_slots, layers, pages, page_bytes]``
    (a view of the primary buffer); ``layers[i]`` is layer ``i``'s KV cache.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        module: Any = None if device.type == "cpu" else getattr(torch, device.type, None)
        if module is not None and not all(
            hasattr(module, name) for name in ("Stream", "Event", "current_stream", "stream")
        ):
            module = None
        self._module = module
        self._stream = module.Stream(device=device) if module is not None else None

    @property
    def asynchronous(self) -> bool:
        return self._stream is not None

    def load(self, layers: list[LayerPages], index: CopyIndex, slots: torch.Tensor) -> None:
        """Copy slot pages into engine blocks; on a device, the forward pass waits for them."""
        slot_index, position, block_ids = index
        if self._stream is None:
            ids = block_ids.to(self.device)
            for layer, pages in enumerate(layers):
                pages.scatter(ids, slots[slot_index, layer, position].to(self.device))
            return
        module = self._module
        compute = module.current_stream(self.device)
        # The slots are read here, on the host, so they may be unpinned as
        # soon as this returns; pinned rows make the upload asynchronous.
        host_rows = [
            slots[slot_index, layer, position].pin_memory() for layer in range(len(layers))
        ]
        # Blocks just allocated may still be read by work queued before.
        self._stream.wait_stream(compute)
        with module.stream(self._stream):
            # Allocated on the copy stream, so freed memory is reused in its order.
            device_ids = block_ids.pin_memory().to(self.device, non_blocking=True)
            for pages, rows in zip(layers, host_rows, strict=True):
                pages.scatter(device_ids, rows.to(self.device, non_blocking=True))
            loaded = module.Event()
            loaded.record(self._stream)
        compute.wait_event(loaded)

    def start_store(
        self, layers: list[LayerPages], index: CopyIndex, slots: torch.Tensor
    ) -> PendingStore:
        """Start copying engine blocks into slots; :meth:`PendingStore.finish` lands them."""
        slot_index, position, block_ids = index
        if self._stream is None:
            ids = block_ids.to(self.device)
            for layer, pages in enumerate(layers):
                slots[slot_index, layer, position] = pages.gather(ids).to("cpu")
            return PendingStore()
        module = self._module
        compute = module.current_stream(self.device)
        self._stream.wait_stream(compute)  # the forward pass computed these pages
        with module.stream(self._stream):
            device_ids = block_ids.pin_memory().to(self.device, non_blocking=True)
            gathered = [pages.gather(device_ids) for pages in layers]
            read = module.Event()
            read.record(self._stream)
            host_rows = []
            for rows in gathered:
                host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                host_rows.append(host)
            copied = module.Event()
            copied.record(self._stream)
        # The engine may hand the blocks to another request next step: its forward
        # pass must not overwrite them before the gather read them.
        compute.wait_event(read)

        def complete() -> None:
            copied.synchronize()
            for layer, rows in enumerate(host_rows):
                slots[slot_index, layer, position] = rows

        return PendingStore(ready=copied.query, complete=complete)
