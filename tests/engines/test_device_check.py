"""``scripts/device_check.py`` on the CPU, and proof that it catches copy bugs.

Each mutation below is injected into kvtier's page copies; the check must
fail with it and pass without it. The mirrored one maps rows wrong the same
way on store and on load, so pages still come back intact from a round
trip: only a check against independent references can see it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import pytest

if TYPE_CHECKING:
    import torch

torch = pytest.importorskip("torch")

from kvtier.integrations import page_copies  # noqa: E402
from kvtier.integrations.page_copies import CopyIndex, LayerPages, Transfers  # noqa: E402
from tests.support.device_check_script import device_check  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def check() -> ModuleType:
    return device_check()


def test_the_whole_check_passes_on_the_cpu(
    check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    assert check.main(["--device", "cpu", "--quick", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "pages: 96 cases" in out
    assert "model:" in out and "FAIL" not in out


# Mutations ----------------------------------------------------------------------


def _swapped_rows(rows: torch.Tensor) -> torch.Tensor:
    """Neighbouring rows swapped: every slot has an even number of rows, so all stay inside."""
    return rows ^ 1


def mirrored(monkeypatch: pytest.MonkeyPatch) -> None:
    """One wrong row mapping inside the copies, shared by store and load (both device paths)."""
    real_runs = page_copies.contiguous_runs

    def runs(rows: list[int], blocks: list[int]) -> list[tuple[int, int, int]]:
        return real_runs([row ^ 1 for row in rows], blocks)

    monkeypatch.setattr(page_copies, "contiguous_runs", runs)
    real_rows = cast(property, CopyIndex.rows).fget  # mypy types it as its getter
    assert real_rows is not None
    monkeypatch.setattr(CopyIndex, "rows", property(lambda index: _swapped_rows(real_rows(index))))


def mirrored_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's slot index lays a part's layers out in reverse, for store and load alike."""
    real = inspect.getattr_static(CopyIndex, "for_chunks").__func__

    def reversed_layers(cls: type[CopyIndex], *args: Any, **kwargs: Any) -> CopyIndex:
        index = real(cls, *args, **kwargs)
        return index._replace(layer_rows=index.layer_rows.flip(0))

    monkeypatch.setattr(CopyIndex, "for_chunks", classmethod(reversed_layers))


def store_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores alone put pages into the wrong rows."""
    real = Transfers.start_store

    def start_store(self: Transfers, layers: Any, index: CopyIndex, slots: Any) -> Any:
        return real(self, layers, index._replace(page_rows=_swapped_rows(index.page_rows)), slots)

    monkeypatch.setattr(Transfers, "start_store", start_store)


def load_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads alone put pages into the wrong blocks."""
    real = Transfers.load

    def load(self: Transfers, layers: Any, index: CopyIndex, slots: Any) -> Any:
        return real(self, layers, index._replace(block_ids=index.block_ids.roll(1)), slots)

    monkeypatch.setattr(Transfers, "load", load)


def load_one_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads alone flip one bit of the first page of every run."""
    real = LayerPages.read_run

    def read_run(self: LayerPages, first_block: int, rows: torch.Tensor) -> None:
        real(self, first_block, rows)
        self.pages[first_block][(0,) * (self.pages.dim() - 1)] ^= 1

    monkeypatch.setattr(LayerPages, "read_run", read_run)


MUTATIONS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "mirrored-rows": mirrored,
    "mirrored-index": mirrored_index,
    "store-rows": store_rows,
    "load-blocks": load_blocks,
    "load-one-byte": load_one_byte,
}
LAYOUTS = ["blocks-first", "kv-first", "LBNHC", "BLHNC"]


def _case(check: ModuleType, layout: str, tp: int = 2) -> Any:
    return check.PageCase(check.LAYOUTS[layout], torch.bfloat16, 16, tp)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_copy_bug_fails_the_check(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, layout: str, mutation: str
) -> None:
    case = _case(check, layout)
    assert check.check_pages(case, check.QUICK_PAGES, CPU, seed=3) == []
    MUTATIONS[mutation](monkeypatch)
    failures = check.check_pages(case, check.QUICK_PAGES, CPU, seed=3)
    assert failures, f"{mutation} went unnoticed in {layout}"
    assert all(f.startswith(case.label) for f in failures)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_mirrored_bug_survives_a_round_trip(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Why the check compares with references: a round trip alone looks right."""
    mirrored(monkeypatch)
    case = _case(check, layout, tp=1)
    sizes = check.QUICK_PAGES
    per_chunk = sizes.chunk_tokens // case.block_size
    num_blocks = sizes.chunks * per_chunk
    reference = torch.randint(
        0,
        256,
        (sizes.layers, num_blocks, 2, 16, sizes.heads, sizes.head_dim * 2),
        dtype=torch.uint8,
    )
    stored = check._Engine(case, reference, slice(None), CPU)
    page_bytes = reference[0, 0].numel()
    rows = sizes.chunks * sizes.layers * per_chunk
    slots = torch.zeros(rows, page_bytes, dtype=torch.uint8)
    index = CopyIndex.for_chunks(
        torch.arange(sizes.chunks).repeat_interleave(per_chunk).tolist(),
        torch.arange(per_chunk).repeat(sizes.chunks).tolist(),
        torch.randperm(num_blocks).tolist(),
        rows_per_slot=sizes.layers * per_chunk,
        part_row=0,
        num_layers=sizes.layers,
        blocks_per_chunk=per_chunk,
    )
    transfers = Transfers(CPU)
    assert transfers.start_store(stored.pages(num_blocks, page_bytes), index, slots).finish()
    loaded = check._Engine(case, torch.zeros_like(reference), slice(None), CPU)
    transfers.load(loaded.pages(num_blocks, page_bytes), index, slots)
    assert torch.equal(loaded.memory, stored.memory)


def test_a_mirrored_bug_makes_the_script_exit_non_zero(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    all_cases = check.page_cases()
    monkeypatch.setattr(check, "page_cases", lambda **_: all_cases[:4])
    assert check.main(["--device", "cpu", "--quick", "--skip-model", "--repeat", "1"]) == 0
    mirrored(monkeypatch)
    assert check.main(["--device", "cpu", "--quick", "--skip-model", "--repeat", "1"]) == 1
    out = capsys.readouterr().out
    assert "pages: 4 cases" in out and "FAIL blocks-first" in out


def test_a_part_that_raises_fails_the_run_but_the_others_still_report(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    all_cases = check.page_cases()
    monkeypatch.setattr(check, "page_cases", lambda **_: all_cases[:2])

    def broken(*args: Any) -> None:
        raise AttributeError("module 'torch' has no attribute 'xyz'")

    monkeypatch.setattr(check, "check_model", broken)
    assert check.main(["--device", "cpu", "--quick", "--repeat", "1"]) == 1
    out = capsys.readouterr().out
    assert "pages: 2 cases" in out and ": OK in" in out
    assert "bandwidth" in out and "LBNHC" in out
    assert "FAIL model: AttributeError: module 'torch' has no attribute 'xyz'" in out
