"""Page copies between a paged KV cache and primary slots, on the CPU.

Every test checks bytes against an independent copy made page by page with
plain indexing, for layouts whose pages run on in both places, in neither,
and in one only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

torch = pytest.importorskip("torch")

from kvtier.integrations import page_copies  # noqa: E402
from kvtier.integrations.page_copies import (  # noqa: E402
    CopyIndex,
    LayerPages,
    Transfers,
    contiguous_runs,
)

NUM_BLOCKS, LAYERS, BLOCKS_PER_CHUNK, SLOTS = 16, 3, 2, 6
#: One page: 2 heads x 4 tokens x 8 dims of float32 (256 bytes).
PAGE_SHAPE = (2, 4, 8)
PAGE_BYTES = 2 * 4 * 8 * 4
SLOT_BYTES = LAYERS * BLOCKS_PER_CHUNK * PAGE_BYTES


def test_runs_join_pairs_that_go_up_together() -> None:
    assert contiguous_runs([4, 5, 6, 9, 10, 3], [7, 8, 9, 10, 12, 13]) == [
        (4, 7, 3),
        (9, 10, 1),
        (10, 12, 1),
        (3, 13, 1),
    ]
    assert contiguous_runs([], []) == []
    assert contiguous_runs([2, 2], [5, 6]) == [(2, 5, 1), (2, 6, 1)]


def _cache(block_first: bool) -> list[torch.Tensor]:
    """KV of every layer: blocks first (vLLM's CPU layout) or K/V first (flash)."""
    generator = torch.Generator().manual_seed(7)
    shape = (NUM_BLOCKS, *PAGE_SHAPE) if block_first else (2, NUM_BLOCKS, 1, 4, 8)
    return [torch.randn(shape, generator=generator) for _ in range(LAYERS)]


def _page(kv: torch.Tensor, block: int, block_first: bool) -> torch.Tensor:
    page = kv[block] if block_first else kv[:, block]
    return page.contiguous().view(torch.uint8).flatten()


def _index(slots: list[int], positions: list[int], blocks: list[int]) -> CopyIndex:
    """Rows as the vLLM worker lays them out: ``[layer][position]`` inside a slot."""
    per_slot = SLOT_BYTES // PAGE_BYTES
    first = torch.tensor(slots) * per_slot + torch.tensor(positions)
    layers = torch.arange(LAYERS) * BLOCKS_PER_CHUNK
    return CopyIndex(first, layers, torch.tensor(blocks))


CASES = {
    # two whole chunks on consecutive blocks: one run per chunk and layer
    "runs": ([0, 0, 3, 3], [0, 1, 0, 1], [4, 5, 6, 7]),
    # blocks out of order: every page on its own
    "scattered": ([1, 1, 2, 2], [0, 1, 0, 1], [9, 2, 14, 3]),
    # consecutive blocks, but the second chunk's slot is not next in memory
    "mixed": ([5, 5, 2], [0, 1, 0], [10, 11, 12]),
}


@pytest.mark.parametrize("block_first", [True, False], ids=["blocks-first", "kv-first"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_store_then_load_moves_each_page_to_its_row_and_back(block_first: bool, case: str) -> None:
    slots, positions, blocks = CASES[case]
    kv = _cache(block_first)
    pages = [LayerPages(f"layer{i}", t, NUM_BLOCKS, PAGE_BYTES) for i, t in enumerate(kv)]
    slot_rows = torch.zeros(SLOTS * SLOT_BYTES, dtype=torch.uint8).view(-1, PAGE_BYTES)
    index = _index(slots, positions, blocks)
    transfers = Transfers(torch.device("cpu"))

    assert transfers.start_store(pages, index, slot_rows).finish()
    for layer in range(LAYERS):
        for i, block in enumerate(blocks):
            row = slot_rows[int(index.rows[layer, i])]
            assert torch.equal(row, _page(kv[layer], block, block_first))
    untouched = torch.ones(len(slot_rows), dtype=torch.bool)
    untouched[index.rows.flatten()] = False
    assert not slot_rows[untouched].any()

    # Load the same rows into other blocks of a fresh cache.
    fresh = [torch.zeros_like(t) for t in kv]
    fresh_pages = [LayerPages(f"layer{i}", t, NUM_BLOCKS, PAGE_BYTES) for i, t in enumerate(fresh)]
    targets = [NUM_BLOCKS - 1 - b for b in blocks]
    transfers.load(fresh_pages, index._replace(block_ids=torch.tensor(targets)), slot_rows)
    for layer in range(LAYERS):
        for source, target in zip(blocks, targets, strict=True):
            assert torch.equal(
                _page(fresh[layer], target, block_first), _page(kv[layer], source, block_first)
            )
        others = [b for b in range(NUM_BLOCKS) if b not in targets]
        for block in others:
            assert not _page(fresh[layer], block, block_first).any()


def test_runs_are_found_once_per_copy_not_once_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = page_copies.contiguous_runs

    def counting(rows: list[int], blocks: list[int]) -> list[tuple[int, int, int]]:
        calls.append(len(rows))
        return real(rows, blocks)

    monkeypatch.setattr(page_copies, "contiguous_runs", counting)
    kv = _cache(True)
    pages = [LayerPages(f"layer{i}", t, NUM_BLOCKS, PAGE_BYTES) for i, t in enumerate(kv)]
    slot_rows = torch.zeros(SLOTS * SLOT_BYTES, dtype=torch.uint8).view(-1, PAGE_BYTES)
    index = _index(*CASES["mixed"])
    transfers = Transfers(torch.device("cpu"))
    assert transfers.start_store(pages, index, slot_rows).finish()
    transfers.load(pages, index, slot_rows)
    assert calls == [3, 3]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_slot_order_stages_every_page_where_its_run_of_slot_rows_takes_it(case: str) -> None:
    """The direct route's plan (CUDA only), replayed with CPU tensors: staging
    the pages in slot order and copying its runs gives each row its page."""
    slots, positions, blocks = CASES[case]
    kv = _cache(block_first=True)
    pages = [LayerPages(f"layer{i}", t, NUM_BLOCKS, PAGE_BYTES) for i, t in enumerate(kv)]
    index = _index(slots, positions, blocks)
    order = page_copies.SlotOrder.of(index)

    staging = torch.zeros(order.staged.numel(), PAGE_BYTES, dtype=torch.uint8)
    for layer_pages, at in zip(pages, order.staged, strict=True):
        staging.view(layer_pages.dtype).index_copy_(0, at, layer_pages.gather(index.block_ids))
    slot_rows = torch.zeros(SLOTS * SLOT_BYTES, dtype=torch.uint8).view(-1, PAGE_BYTES)
    for row, staged, count in order.runs:
        slot_rows[row : row + count] = staging[staged : staged + count]
    for layer in range(LAYERS):
        for i, block in enumerate(blocks):
            assert torch.equal(slot_rows[int(index.rows[layer, i])], _page(kv[layer], block, True))
    # Every staged row is copied once, and a chunk's pages of every layer are one run.
    assert sum(count for _, _, count in order.runs) == LAYERS * len(blocks)
    whole_chunks = {s for s in slots if slots.count(s) == BLOCKS_PER_CHUNK}
    assert len(order.runs) <= len(set(slots) - whole_chunks) * LAYERS + len(whole_chunks)


def test_the_direct_route_needs_cuda_and_the_staged_one_stays_elsewhere() -> None:
    transfers = Transfers(torch.device("cpu"))
    slot_rows = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)
    assert not transfers.attach(slot_rows)
    assert not transfers.direct
    transfers.close()  # nothing registered: nothing to undo
