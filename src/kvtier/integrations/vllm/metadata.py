"""What the scheduler tells the worker each step, and what the worker reports back.

Both travel between processes (pickled by vLLM), so they hold plain ints,
strings and tuples only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class SharedBuffer:
    """Where the primary tier's slots live: enough for the worker to map them."""

    name: str
    num_slots: int
    slot_bytes: int


@dataclass
class PageCopies:
    """Page copies between vLLM blocks and primary slots, one entry per page.

    Entry ``i`` moves vLLM block ``block_ids[i]`` of every layer to or from
    position ``positions[i]`` (the block's index inside its chunk) of slot
    ``slots[i]``. Flat lists let the worker move a whole step's pages with one
    gather and one scatter per layer.
    """

    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)

    def add(self, slot: int, position: int, block_id: int) -> None:
        self.slots.append(slot)
        self.positions.append(position)
        self.block_ids.append(block_id)

    def add_run(self, slot: int, first_position: int, block_ids: Sequence[int]) -> None:
        """Blocks at consecutive positions of one slot, from ``first_position``:
        a chunk's pages in three list extends, where :meth:`add` is a call per page."""
        self.slots.extend(repeat(slot, len(block_ids)))
        self.positions.extend(range(first_position, first_position + len(block_ids)))
        self.block_ids.extend(block_ids)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's work for the worker."""

    step: int
    buffer: SharedBuffer
    #: Slots → vLLM blocks, done before the forward pass.
    loads: PageCopies = field(default_factory=PageCopies)
    #: vLLM blocks → slots, done after the forward pass computed them.
    stores: PageCopies = field(default_factory=PageCopies)
    #: Blocks promised to vLLM that kvtier could not pin: reported as load errors.
    failed_block_ids: list[int] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.stores or self.failed_block_ids)


@dataclass(frozen=True)
class StepResult:
    """How one step's copies ended on the ranks that have reported it so far."""

    loads_ok: bool
    stores_ok: bool
    #: Ranks whose report this merges; the step is done when every rank's is in.
    ranks: int = 1

    def merge(self, other: StepResult) -> StepResult:
        # One failing rank fails the step's chunks for every rank: a chunk
        # is only whole with every rank's part.
        return StepResult(
            self.loads_ok and other.loads_ok,
            self.stores_ok and other.stores_ok,
            self.ranks + other.ranks,
        )


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Steps whose copies ended on a worker (or several, once vLLM aggregated them)."""

    finished: dict[int, StepResult] = field(default_factory=dict)
    #: Ranks that have newly mapped the shared buffer.
    attached: frozenset[int] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierWorkerMetadata")
        merged = dict(self.finished)
        for step, result in other.finished.items():
            merged[step] = merged[step].merge(result) if step in merged else result
        return KVTierWorkerMetadata(merged, self.attached | other.attached)


@dataclass(frozen=True)
class KVTierHandshake(KVConnectorHandshakeMetadata):
    """A worker's answer at engine start-up: which slots it mapped, if any."""

    rank: int
    buffer_name: str | None
