"""Page copies between an engine's paged KV cache and primary slots, on any device.

Needs torch alone (not the engine), so ``scripts/device_check.py`` runs it on
any machine with an accelerator. The same torch ops serve every device. On
the CPU pages move run by run: pages that follow each other both in the
slots and in the engine's cache move with one plain copy, straight between
slot and page (a gather then a scatter would move every byte twice, through
a temporary). On an accelerator (CUDA, or any torch device module with
streams and events) every copy runs on a dedicated copy stream, ordered
against the compute stream with events, and moves through pinned host
memory, so the compute stream never waits on a host copy:

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
    """One layer's KV tensor seen as ``[num_blocks, ...page]`` without copying.

    The pages are viewed in the widest integer type their rows allow (8-byte
    words for any usual page): torch copies rows element by element, so
    moving a page as 8-byte words instead of bytes is many times faster.
    """

    def __init__(self, name: str, tensor: torch.Tensor, num_blocks: int, page_bytes: int) -> None:
        dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
        if not dims:
            raise ValueError(
                f"KV cache of {name} has shape {tuple(tensor.shape)}: no dimension "
                f"of num_blocks={num_blocks}"
            )
        found = tensor.numel() // num_blocks * tensor.element_size()
        if found != page_bytes:
            raise ValueError(f"KV cache of {name}: {found} bytes per block, expected {page_bytes}")
        # The block dimension is the outermost one of that size (the CPU and
        # flash layouts put it first or right after the K/V dimension).
        self.pages = _widest(tensor.movedim(dims[0], 0), page_bytes)
        self.page_shape = tuple(self.pages.shape[1:])
        #: The type pages (and the slot rows they travel through) are copied as.
        self.dtype = self.pages.dtype
        self.device = tensor.device

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Pages of ``block_ids`` as rows ``[n, page]`` of :attr:`dtype` on the KV's device."""
        return self.pages.index_select(0, block_ids).reshape(len(block_ids), -1)

    def scatter(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows ``[n, page]`` of :attr:`dtype` on the KV's device into ``block_ids``."""
        self.pages.index_copy_(0, block_ids, rows.reshape(len(block_ids), *self.page_shape))

    def read_run(self, first_block: int, rows: torch.Tensor) -> None:
        """Copy ``n`` consecutive rows ``[n, page]`` into the ``n`` blocks from ``first_block``."""
        count = len(rows)
        self.pages[first_block : first_block + count].copy_(rows.view(count, *self.page_shape))

    def write_run(self, first_block: int, rows: torch.Tensor) -> None:
        """Copy the ``n`` blocks from ``first_block`` into ``n`` consecutive rows ``[n, page]``."""
        count = len(rows)
        rows.view(count, *self.page_shape).copy_(self.pages[first_block : first_block + count])


def _widest(pages: torch.Tensor, page_bytes: int) -> torch.Tensor:
    for wide in (torch.int64, torch.int32, torch.int16):
        if page_bytes % wide.itemsize == 0:
            try:
                return pages.view(wide)
            except RuntimeError:  # the innermost dimension is too narrow or strided
                continue
    return pages


class CopyIndex(NamedTuple):
    """Which pages move: page ``i`` of layer ``l`` is KV block ``block_ids[i]``
    and slot row ``layer_rows[l] + page_rows[i]``.

    Each layer's pages lie in the slots as layer 0's do, shifted by a row
    offset, so pages that run on together do so in every layer: the runs are
    found once per copy, not once per layer.
    """

    page_rows: torch.Tensor
    layer_rows: torch.Tensor
    block_ids: torch.Tensor

    @classmethod
    def for_chunks(
        cls,
        slots: list[int],
        positions: list[int],
        block_ids: list[int],
        *,
        rows_per_slot: int,
        part_row: int,
        num_layers: int,
        blocks_per_chunk: int,
    ) -> CopyIndex:
        """Pages laid out in slots as ``slot[part][layer][position]``, one row each.

        Entry ``i`` is KV block ``block_ids[i]`` at position ``positions[i]`` of
        slot ``slots[i]``; a slot is ``rows_per_slot`` rows and this copier's
        part of it starts ``part_row`` rows in, holding ``num_layers ×
        blocks_per_chunk`` pages.
        """
        first = torch.tensor(slots, dtype=torch.long) * rows_per_slot + part_row
        first += torch.tensor(positions, dtype=torch.long)
        layers = torch.arange(num_layers, dtype=torch.long) * blocks_per_chunk
        return cls(first, layers, torch.tensor(block_ids, dtype=torch.long))

    @property
    def rows(self) -> torch.Tensor:
        """Slot rows ``[layer, page]``."""
        return self.layer_rows[:, None] + self.page_rows[None, :]

    def runs(self) -> list[tuple[int, int, int]]:
        """The pages as ``(first row, first block, count)`` runs consecutive both
        in the slots and in the KV cache; rows are layer 0's, add ``layer_rows[l]``."""
        return contiguous_runs(self.page_rows.tolist(), self.block_ids.tolist())


def contiguous_runs(rows: list[int], blocks: list[int]) -> list[tuple[int, int, int]]:
    """Pairs ``rows[i] ↔ blocks[i]`` as ``(first row, first block, count)``
    runs in which both sides go up by one from pair to pair."""
    runs: list[tuple[int, int, int]] = []
    for row, block in zip(rows, blocks, strict=True):
        if runs:
            first_row, first_block, count = runs[-1]
            if row == first_row + count and block == first_block + count:
                runs[-1] = (first_row, first_block, count + 1)
                continue
        runs.append((row, block, 1))
    return runs


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


class Transfers:
    """Runs page copies: inline on the CPU, on a copy stream on an accelerator.

    Slots are reached as ``slot_rows``: the primary buffer viewed as host
    ``uint8`` rows of one page each (a slot is a whole number of pages), so
    every layer's pages move with one gather or scatter of rows.
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

    def load(self, layers: list[LayerPages], index: CopyIndex, slot_rows: torch.Tensor) -> None:
        """Copy slot pages into engine blocks; on a device, the forward pass waits for them.

        ``slot_rows`` is the primary buffer as host ``uint8`` rows of one page each.
        """
        if self._stream is None:
            runs = index.runs()
            for pages, shift in zip(layers, index.layer_rows.tolist(), strict=True):
                rows = slot_rows.view(pages.dtype)
                for row, block, count in runs:
                    pages.read_run(block, rows[shift + row : shift + row + count])
            return
        module = self._module
        compute = module.current_stream(self.device)
        # The slots are read here, on the host, so they may be unpinned as
        # soon as this returns; pinned rows make the upload asynchronous.
        layer_rows = index.rows
        host_rows = [
            slot_rows.view(pages.dtype).index_select(0, layer_rows[layer]).pin_memory()
            for layer, pages in enumerate(layers)
        ]
        # Blocks just allocated may still be read by work queued before.
        self._stream.wait_stream(compute)
        with module.stream(self._stream):
            # Allocated on the copy stream, so freed memory is reused in its order.
            device_ids = index.block_ids.pin_memory().to(self.device, non_blocking=True)
            for pages, rows in zip(layers, host_rows, strict=True):
                pages.scatter(device_ids, rows.to(self.device, non_blocking=True))
            loaded = module.Event()
            loaded.record(self._stream)
        compute.wait_event(loaded)

    def start_store(
        self, layers: list[LayerPages], index: CopyIndex, slot_rows: torch.Tensor
    ) -> PendingStore:
        """Start copying engine blocks into slots; :meth:`PendingStore.finish` lands them."""
        if self._stream is None:
            runs = index.runs()
            for pages, shift in zip(layers, index.layer_rows.tolist(), strict=True):
                rows = slot_rows.view(pages.dtype)
                for row, block, count in runs:
                    pages.write_run(block, rows[shift + row : shift + row + count])
            return PendingStore()
        module = self._module
        compute = module.current_stream(self.device)
        self._stream.wait_stream(compute)  # the forward pass computed these pages
        with module.stream(self._stream):
            device_ids = index.block_ids.pin_memory().to(self.device, non_blocking=True)
            gathered = [pages.gather(device_ids) for pages in layers]
            read = module.Event()
            read.record(self._stream)
            host_rows = []
            for rows in gathered:
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                host_rows.append(host)
            copied = module.Event()
            copied.record(self._stream)
        # The engine may hand the blocks to another request next step: its forward
        # pass must not overwrite them before the gather read them.
        compute.wait_event(read)

        layer_rows = index.rows

        def complete() -> None:
            copied.synchronize()
            for layer, rows in enumerate(host_rows):
                slot_rows.view(rows.dtype).index_copy_(0, layer_rows[layer], rows)

        return PendingStore(ready=copied.query, complete=complete)
