"""What the scheduler tells the worker each step, and what the worker reports back.

Both travel between processes (pickled by vLLM), so they hold plain ints,
strings and tuples only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
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


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Steps whose copies ended, with whether their loads and stores succeeded."""

    #: step -> (loads succeeded, stores succeeded)
    finished: dict[int, tuple[bool, bool]] = field(default_factory=dict)
    #: The worker has mapped the shared buffer (its name may now be removed).
    attached: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierWorkerMetadata")
        merged = dict(self.finished)
        for step, (loads_ok, stores_ok) in other.finished.items():
            mine = merged.get(step, (True, True))
            merged[step] = (mine[0] and loads_ok, mine[1] and stores_ok)
        return KVTierWorkerMetadata(merged, self.attached and other.attached)
