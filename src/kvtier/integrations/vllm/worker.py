"""The worker half of the connector: page copies between vLLM's KV cache and the slots.

Runs in each of vLLM's worker processes beside the model. A worker owns one
part of every slot (its pipeline stage's layers, its tensor-parallel share
of the heads, see :class:`~.engine_config.VllmGeometry`) and copies only there.
Every copy is one gather and one scatter per layer over the step's pages,
with torch ops, so the same code moves pages of CPU tensors and of
accelerator tensors (see :mod:`kvtier.integrations.page_copies` for how the
latter stay off the compute stream).
"""

from __future__ import annotations

import logging

import torch

from kvtier.integrations.page_copies import CopyIndex, LayerPages, PendingCopy, Transfers
from kvtier.shared_slots import MappedSlots, map_slots

from .engine_config import VllmGeometry
from .metadata import (
    KVTierConnectorMetadata,
    KVTierHandshake,
    KVTierWorkerMetadata,
    PageCopies,
    SharedBuffer,
    StepResult,
)
from .shared_memory import engine_buffer_names, map_existing

logger = logging.getLogger(__name__)


class WorkerSide:
    """Copies this rank's pages as the step's metadata says; reports what ended and how."""

    def __init__(
        self,
        shape: VllmGeometry,
        *,
        pp_rank: int = 0,
        tp_rank: int = 0,
        engine_id: str | None = None,
        buffer_name: str | None = None,
    ) -> None:
        self.shape = shape
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.rank = pp_rank * shape.tensor_parallel_size + tp_rank
        self._part = shape.part(pp_rank, tp_rank)
        #: Where the scheduler's slots may be, to map them at start-up.
        self._names: list[str] = (
            [buffer_name] if buffer_name else engine_buffer_names(engine_id) if engine_id else []
        )
        self._layers: list[LayerPages] = []
        self._transfers: Transfers | None = None
        self._buffer: MappedSlots | None = None
        #: The mapped slots as rows of one page each.
        self._slots: torch.Tensor | None = None
        self._broken: str | None = None
        self._attached_reported = False
        self._loads: dict[int, PendingCopy] = {}
        self._stores: dict[int, PendingCopy] = {}
        self._finished: dict[int, StepResult] = {}
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.shape.layer_names if name not in kv_caches]
        if missing:
            self._disable(f"no KV cache registered for layers {missing}")
            return
        if self.shape.num_layers != self.shape.stages[self.pp_rank]:
            self._disable(
                f"pipeline stage {self.pp_rank} holds {self.shape.num_layers} layers, but the "
                f"slot layout gives it {self.shape.stages[self.pp_rank]}"
            )
            return
        try:
            self._layers = [
                LayerPages(name, kv_caches[name], self.shape.num_blocks, self.shape.page_bytes)
                for name in self.shape.layer_names
            ]
        except ValueError as exc:
            self._disable(str(exc))
            return
        if self._layers:
            self._transfers = Transfers(self._layers[0].device)

    def handshake(self) -> KVTierHandshake:
        """Map the engine's slots now, at start-up, so their name can go at once."""
        if self._slots is None and self._broken is None and self._layers:
            try:
                found = map_existing(self._names, self.shape.slot_bytes)
            except (OSError, ValueError) as exc:
                logger.warning("kvtier: cannot map the engine's shared memory yet: %s", exc)
                found = None
            if found is not None:
                self._use(found)
                self._attached_reported = True  # the handshake reports it
        name = self._buffer.shared_name if self._buffer is not None else None
        return KVTierHandshake(self.rank, name)

    # Per step ---------------------------------------------------------------

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        self._load_errors.update(meta.failed_block_ids)
        if not meta.loads:
            return
        loading = self._load(meta.buffer, meta.loads)
        if loading.failed_early:  # vLLM recomputes these blocks in this very step
            self._load_errors.update(meta.loads.block_ids)
        self._loads[meta.step] = loading

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        if not meta.stores:
            return
        slots = self._attach(meta.buffer)
        if slots is None or self._transfers is None:
            self._stores[meta.step] = PendingCopy.failed()
            return
        try:
            self._stores[meta.step] = self._transfers.start_store(
                self._layers, self._index(meta.stores), slots
            )
        except Exception:
            logger.exception("kvtier: store of %d pages failed", len(meta.stores))
            self._stores[meta.step] = PendingCopy.failed()

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        self._collect(wait_for_older_than=max(self._stores, default=-1))
        attached = self._buffer is not None and not self._attached_reported
        if not self._finished and not attached:
            return None
        self._attached_reported = self._attached_reported or attached
        finished, self._finished = self._finished, {}
        return KVTierWorkerMetadata(finished, frozenset({self.rank}) if attached else frozenset())

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finish_stores(self) -> None:
        """Wait until every copy started so far has ended (stores landed in the slots)."""
        self._collect(wait_for_older_than=max([*self._stores, *self._loads, -1]) + 1)

    def shutdown(self) -> None:
        # Copies still in flight read or write the slots: end them first.
        self.finish_stores()
        if self._transfers is not None:
            self._transfers.close()
        self._slots = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    # Machinery ---------------------------------------------------------------

    def _collect(self, wait_for_older_than: int) -> None:
        """Move ended steps to ``_finished``; copies of earlier steps are waited for.

        A step's copies end on the copy stream while the next step computes,
        so they are reported one step late at most: until then the slots they
        read or write stay pinned.
        """
        for step in sorted(set(self._loads) | set(self._stores)):
            copies = [c for c in (self._loads.get(step), self._stores.get(step)) if c is not None]
            if step >= wait_for_older_than and not all(c.done() for c in copies):
                continue
            load, store = self._loads.pop(step, None), self._stores.pop(step, None)
            self._finished[step] = StepResult(
                load.finish() if load is not None else True,
                store.finish() if store is not None else True,
            )

    def _load(self, buffer: SharedBuffer, copies: PageCopies) -> PendingCopy:
        slots = self._attach(buffer)
        if slots is None or self._transfers is None:
            return PendingCopy.failed()
        try:
            return self._transfers.load(self._layers, self._index(copies), slots)
        except Exception:
            logger.exception("kvtier: load of %d pages failed", len(copies))
            return PendingCopy.failed()

    def _disable(self, reason: str) -> None:
        self._broken = reason
        logger.error("kvtier: %s; offloading disabled", reason)

    def _attach(self, buffer: SharedBuffer) -> torch.Tensor | None:
        if self._broken is None and not self._layers:
            # Copying no layers would "succeed" and offload empty slots.
            self._disable("vLLM registered no KV caches with the connector")
        if self._broken is not None:
            return None
        if self._slots is not None and self._buffer is not None:
            if self._buffer.shared_name == buffer.name:
                return self._slots
            self._disable(
                f"mapped shared memory {self._buffer.shared_name!r} at start-up, but the "
                f"scheduler uses {buffer.name!r}"
            )
            return None
        if buffer.slot_bytes != self.shape.slot_bytes:
            self._disable(
                f"primary slots are {buffer.slot_bytes} bytes but this engine's chunk is "
                f"{self.shape.slot_bytes} bytes"
            )
            return None
        try:
            self._use(map_slots(buffer.name, buffer.num_slots, buffer.slot_bytes))
        except (OSError, ValueError) as exc:
            self._disable(f"cannot map shared memory {buffer.name!r}: {exc}")
            return None
        return self._slots

    def _use(self, mapped: MappedSlots) -> None:
        """Keep the mapping and view it as rows of one page each."""
        self._buffer = mapped
        flat = torch.frombuffer(mapped.view.cast("B"), dtype=torch.uint8)
        self._slots = flat.view(-1, self.shape.page_bytes)
        if self._transfers is not None:
            self._transfers.attach(self._slots)  # DMA straight to the slots where CUDA can

    def _index(self, copies: PageCopies) -> CopyIndex:
        """Slot rows of this rank's pages: its part of each slot, ``[layer][position]``."""
        page_bytes = self.shape.page_bytes
        return CopyIndex.for_chunks(
            copies.slots,
            copies.positions,
            copies.block_ids,
            rows_per_slot=self.shape.slot_bytes // page_bytes,
            part_row=self._part[0] // page_bytes,
            num_layers=self.shape.num_layers,
            blocks_per_chunk=self.shape.blocks_per_chunk,
        )
