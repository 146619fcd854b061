"""Page copies between an engine's paged KV cache and primary slots, on any
device, with torch alone (not the engine): run by run on the CPU, on a
dedicated copy stream ordered by events on an accelerator.

See docs/vllm.md for the two routes between device and slots.
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
class PendingCopy:
    """A step's copies between the device and the slots, possibly still running.

    The slots a copy reads or writes stay in use until :meth:`finish` returns.
    """

    #: Whether the device copies have ended (always true on the CPU).
    ready: Callable[[], bool] = lambda: True
    #: Waits for the device copies, then lands what they brought (if anything).
    complete: Callable[[], None] = lambda: None
    failed_early: bool = False
    _result: bool | None = field(default=None, init=False)

    @classmethod
    def failed(cls) -> PendingCopy:
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
                    logger.exception("kvtier: copying pages failed")
                    self._result = False
        return self._result


class SlotOrder(NamedTuple):
    """A copy's pages in slot-row order, for moving them as runs of rows.

    Page ``i`` of layer ``l`` is staged at ``staged[l][i]``; staged rows
    ``first_staged .. +count`` are slot rows ``first_row .. +count`` for each
    ``(first_row, first_staged, count)`` in ``runs``.
    """

    staged: torch.Tensor
    runs: list[tuple[int, int, int]]

    @classmethod
    def of(cls, index: CopyIndex) -> SlotOrder:
        rows = index.rows.flatten()
        order = torch.argsort(rows)
        staged = torch.empty_like(order)
        staged[order] = torch.arange(len(order))
        # Runs found with tensor ops: a step moves thousands of pages.
        ordered = rows[order]
        starts = torch.cat(
            (torch.zeros(1, dtype=torch.long), torch.nonzero(ordered.diff() != 1).flatten() + 1)
        )[: len(ordered)]
        counts = torch.diff(starts, append=torch.tensor([len(ordered)]))
        runs = list(zip(ordered[starts].tolist(), starts.tolist(), counts.tolist(), strict=True))
        return cls(staged.view(index.rows.shape), runs)


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
        #: The slots' (address, bytes) while the device may DMA to and from them.
        self._registered: tuple[int, int] | None = None

    @property
    def asynchronous(self) -> bool:
        return self._stream is not None

    @property
    def direct(self) -> bool:
        """Whether copies DMA straight between the device and registered slots."""
        return self._registered is not None

    def attach(self, slot_rows: torch.Tensor) -> bool:
        """Register the slots' memory with CUDA so copies skip the host staging.

        Pins every page of the slots (they are the CPU tier's memory, resident
        anyway); done once, at start-up, since it takes a while on large
        buffers. Whether it took: any other device, or a refusal, keeps the
        staged route. Call :meth:`close` before the slots are unmapped.
        """
        if self._registered is not None or self.device.type != "cuda":
            return self._registered is not None
        address, size = slot_rows.data_ptr(), slot_rows.numel() * slot_rows.element_size()
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(address, size, 0)
        if error != cudart.cudaError.success:
            logger.warning(
                "kvtier: cannot register the slots with CUDA (%s); copies go through "
                "pinned staging",
                error,
            )
            return False
        self._registered = (address, size)
        return True

    def close(self) -> None:
        """Unregister the slots (every copy must have finished)."""
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered[0])
            self._registered = None

    def _on_slots(self, slot_rows: torch.Tensor) -> bool:
        if self._registered is None:
            return False
        address, size = self._registered
        begin = slot_rows.data_ptr()
        return address <= begin and begin + slot_rows.numel() * slot_rows.element_size() <= (
            address + size
        )

    def load(
        self, layers: list[LayerPages], index: CopyIndex, slot_rows: torch.Tensor
    ) -> PendingCopy:
        """Copy slot pages into engine blocks; on a device, the forward pass waits for them.

        ``slot_rows`` is the primary buffer as host ``uint8`` rows of one page
        each; it is read until the returned copy has finished.
        """
        if self._stream is None:
            return _copy_on_host(layers, index, slot_rows, into_slots=False)
        module = self._module
        compute = module.current_stream(self.device)
        direct = self._on_slots(slot_rows)
        # Staged: the slots are read here, on the host, and are free once this returns.
        host_rows = None if direct else _gather_rows(layers, index, slot_rows)
        # Blocks just allocated may still be read by work queued before.
        self._stream.wait_stream(compute)
        with module.stream(self._stream):
            # Allocated on the copy stream, so freed memory is reused in its order.
            device_ids = self._to_device(index.block_ids)
            if host_rows is None:
                order = SlotOrder.of(index)
                staging = self._staging(order, slot_rows)
                for row, staged, count in order.runs:
                    staging[staged : staged + count].copy_(
                        slot_rows[row : row + count], non_blocking=True
                    )
                positions = self._to_device(order.staged)
                for pages, at in zip(layers, positions, strict=True):
                    pages.scatter(device_ids, staging.view(pages.dtype).index_select(0, at))
            else:
                for pages, rows in zip(layers, host_rows, strict=True):
                    pages.scatter(device_ids, rows.to(self.device, non_blocking=True))
            loaded = module.Event()
            loaded.record(self._stream)
        compute.wait_event(loaded)
        if not direct:
            return PendingCopy()
        return PendingCopy(ready=loaded.query, complete=loaded.synchronize)

    def start_store(
        self, layers: list[LayerPages], index: CopyIndex, slot_rows: torch.Tensor
    ) -> PendingCopy:
        """Start copying engine blocks into slots; :meth:`PendingCopy.finish` lands them."""
        if self._stream is None:
            return _copy_on_host(layers, index, slot_rows, into_slots=True)
        module = self._module
        compute = module.current_stream(self.device)
        direct = self._on_slots(slot_rows)
        self._stream.wait_stream(compute)  # the forward pass computed these pages
        with module.stream(self._stream):
            device_ids = self._to_device(index.block_ids)
            if direct:
                order = SlotOrder.of(index)
                staging = self._staging(order, slot_rows)
                positions = self._to_device(order.staged)
                for pages, at in zip(layers, positions, strict=True):
                    staging.view(pages.dtype).index_copy_(0, at, pages.gather(device_ids))
            else:
                gathered = [pages.gather(device_ids) for pages in layers]
            read = module.Event()
            read.record(self._stream)
            if direct:
                for row, staged, count in order.runs:
                    slot_rows[row : row + count].copy_(
                        staging[staged : staged + count], non_blocking=True
                    )
            else:
                host_rows = [
                    torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(
                        rows, non_blocking=True
                    )
                    for rows in gathered
                ]
            copied = module.Event()
            copied.record(self._stream)
        # The engine may hand the blocks to another request next step: its forward
        # pass must not overwrite them before the gather read them.
        compute.wait_event(read)
        if direct:
            return PendingCopy(ready=copied.query, complete=copied.synchronize)

        layer_rows = index.rows

        def complete() -> None:
            copied.synchronize()
            for layer, rows in enumerate(host_rows):
                slot_rows.view(rows.dtype).index_copy_(0, layer_rows[layer], rows)

        return PendingCopy(ready=copied.query, complete=complete)

    def _to_device(self, values: torch.Tensor) -> torch.Tensor:
        return values.pin_memory().to(self.device, non_blocking=True)

    def _staging(self, order: SlotOrder, slot_rows: torch.Tensor) -> torch.Tensor:
        """Device rows for a copy's pages in slot order."""
        return torch.empty(
            (order.staged.numel(), slot_rows.shape[1]), dtype=torch.uint8, device=self.device
        )


def _copy_on_host(
    layers: list[LayerPages], index: CopyIndex, slot_rows: torch.Tensor, *, into_slots: bool
) -> PendingCopy:
    """Copy between engine blocks and slot rows run by run, done when it returns."""
    runs = index.runs()
    for pages, shift in zip(layers, index.layer_rows.tolist(), strict=True):
        rows = slot_rows.view(pages.dtype)
        copy = pages.write_run if into_slots else pages.read_run
        for row, block, count in runs:
            copy(block, rows[shift + row : shift + row + count])
    return PendingCopy()


def _gather_rows(
    layers: list[LayerPages], index: CopyIndex, slot_rows: torch.Tensor
) -> list[torch.Tensor]:
    """Each layer's slot rows, gathered on the host straight into pinned memory."""
    gathered = []
    for rows, pages in zip(index.rows, layers, strict=True):
        words = slot_rows.view(pages.dtype)
        pinned = torch.empty((len(rows), words.shape[1]), dtype=pages.dtype, pin_memory=True)
        gathered.append(torch.index_select(words, 0, rows, out=pinned))
    return gathered
