"""Check kvtier's copies between engine KV and its slots on a device, against references.

    python3 scripts/device_check.py [--device cuda] [--quick] [--json results.json]

Three parts, each on the given torch device (default: the first accelerator):

* **pages**: kvtier's vLLM page copies (``kvtier.integrations.page_copies``,
  with the worker's slot index) store scattered blocks into slots and load
  slots into other scattered blocks, for every page layout below, bf16, fp16
  and fp8 (where torch has it), block sizes 16 and 64, one and two
  tensor-parallel ranks. Page contents come from a seeded generator per
  (layer, block, K/V, token, head); the expected slots and the expected
  cache after a load are built from those contents with plain indexing,
  never from what kvtier stored, so a wrong row mapping shows even when
  store and load share it. Stores run as two overlapping steps, the engine
  overwriting its blocks right after each (the copy stream must have read
  them first); loaded pages are read back on the compute stream with no
  device-wide wait (the load's event must order them).
* **bandwidth**: kvtier's store (device → slots) and load (slots → device)
  against a plain ``tensor.copy_`` of the same bytes to and from pinned host
  memory, as GB/s and a ratio.
* **model**: a small Llama-family model built on the device from a fixed
  seed; a long shared prefix is reused through kvtier's CPU tier, the logits
  compared with a prefill without reuse, and the time to first token
  measured with and without the hit.

Exits 1 if any check fails (any wrong byte), 0 otherwise. ``--quick`` runs
the same code on small sizes (the test suite runs it with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch

from kvtier.integrations.page_copies import CopyIndex, LayerPages, Transfers
from kvtier.primary import SlotBuffer

# Layouts ---------------------------------------------------------------------
#
# Reference pages are bytes ``[layers, blocks, 2 (K, V), tokens, heads,
# head_dim * itemsize]``. A layout builds the engine's memory from them (all
# layers: some orders interleave them) and each layer's view of it, the
# tensor vLLM hands the connector, and says in which byte order a page lies
# in a slot: the order of the view's dimensions after the block one.


@dataclass(frozen=True)
class Layout:
    name: str
    #: Which engines use it.
    used_by: str
    #: Reference bytes -> the engine's memory (contiguous uint8, every layer).
    memory: Callable[[torch.Tensor], torch.Tensor]
    #: The engine's memory (any dtype, last dimension whole elements), a layer -> its view.
    view: Callable[[torch.Tensor, int], torch.Tensor]
    #: Reference pages ``[n, 2, tokens, heads, bytes]`` -> slot rows ``[n, page_bytes]``.
    slot_page: Callable[[torch.Tensor], torch.Tensor]


def _flat(pages: torch.Tensor) -> torch.Tensor:
    return pages.reshape(len(pages), -1)


def _legacy(name: str, used_by: str, order: tuple[int, ...]) -> Layout:
    """A layer's pages ``[blocks, 2, tokens, heads, dim]`` permuted by ``order``, layer by layer."""
    layer_order = (0, *(d + 1 for d in order))
    return Layout(
        name,
        used_by,
        memory=lambda r: r.permute(layer_order).contiguous(),
        view=lambda m, layer: m[layer],
        slot_page=_flat,
    )


def _vllm_0_32(name: str, used_by: str) -> Layout:
    """vLLM 0.32: every layer's view is ``[blocks, heads, tokens, K|V]`` (K and V of
    a head and token side by side) over memory in the order the name spells,
    out of ``L, B, H, N, C`` (``vllm.v1.kv_cache_layout.KVCacheLayout``)."""
    order = tuple("LBHNC".index(axis) for axis in name)
    inverse = tuple(order.index(axis) for axis in range(5))

    def logical(reference: torch.Tensor) -> torch.Tensor:
        layers, blocks, _, tokens, heads, dim = reference.shape
        kv_last = reference.permute(0, 1, 4, 3, 2, 5)  # [L, B, H, N, 2, D]
        return kv_last.reshape(layers, blocks, heads, tokens, 2 * dim)

    return Layout(
        name,
        used_by,
        memory=lambda r: logical(r).permute(order).contiguous(),
        view=lambda m, layer: m.permute(inverse)[layer],
        slot_page=lambda p: _flat(p.permute(0, 3, 2, 1, 4)),
    )


LAYOUTS = {
    layout.name: layout
    for layout in (
        _legacy("blocks-first", "FlashInfer before vLLM 0.32", (0, 1, 2, 3, 4)),
        _legacy("kv-first", "FlashAttention and Triton before vLLM 0.32", (1, 0, 2, 3, 4)),
        _vllm_0_32("LBHNC", "vLLM 0.32: CPU attention, FlashInfer HND"),
        _vllm_0_32("LBNHC", "vLLM 0.32's default, which FlashAttention takes"),
        _vllm_0_32("LHBNC", "vLLM 0.32: ROCm backends"),
        _vllm_0_32("BLHNC", "vLLM 0.32: block-outermost (FlashInfer on Blackwell accepts it)"),
        _vllm_0_32("BLNHC", "vLLM 0.32: block-outermost, tokens outside heads"),
        _vllm_0_32("BHLNC", "vLLM 0.32: block-outermost, heads outside layers"),
    )
}


def _dtypes() -> list[torch.dtype]:
    found = [torch.bfloat16, torch.float16]
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return [*found, fp8] if fp8 is not None else found


# Devices -----------------------------------------------------------------------


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return "cpu"


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


def _host_slots(num_rows: int, row_bytes: int) -> torch.Tensor:
    """Slots in named shared memory, as vLLM's scheduler makes them and its workers map them."""
    slots = SlotBuffer(num_rows, row_bytes, shared_name=f"kvtier-device-check-{uuid.uuid4().hex}")
    slots.unlink()  # the mapping stays valid; nothing is left behind in /dev/shm
    return torch.frombuffer(slots.view.cast("B"), dtype=torch.uint8).view(num_rows, row_bytes)


# Page copies -------------------------------------------------------------------


@dataclass(frozen=True)
class PageSizes:
    layers: int
    heads: int
    head_dim: int
    chunk_tokens: int
    chunks: int
    spare_slots: int


@dataclass(frozen=True)
class PageCase:
    layout: Layout
    dtype: torch.dtype
    block_size: int
    tp: int
    #: "direct" (DMA to and from slots registered with CUDA) or "staged" (pinned staging).
    route: str = "staged"

    @property
    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.layout.name} {dtype} block={self.block_size} tp={self.tp} {self.route}"


class _Engine:
    """One rank's KV cache: the memory of every layer and the view kvtier is given of each."""

    def __init__(
        self, case: PageCase, reference: torch.Tensor, heads: slice, device: torch.device
    ) -> None:
        self.layout, self.heads = case.layout, heads
        # Copied even on the CPU: the engine never shares memory with the reference.
        # Kept as bytes, so every write and read is a plain byte copy in any dtype.
        self.memory = self._memory(reference).to(device, copy=True)
        typed = self.memory.view(case.dtype)
        self.views = [case.layout.view(typed, layer) for layer in range(len(reference))]

    def _memory(self, reference: torch.Tensor) -> torch.Tensor:
        return self.layout.memory(reference[..., self.heads, :])

    def pages(self, num_blocks: int, page_bytes: int) -> list[LayerPages]:
        return [
            LayerPages(f"layer{i}", v, num_blocks, page_bytes) for i, v in enumerate(self.views)
        ]

    def write(self, reference: torch.Tensor) -> None:
        """Overwrite every layer on the engine's stream, as its next forward pass does."""
        self.memory.copy_(self._memory(reference))

    def wrong_bytes(self, reference: torch.Tensor) -> list[int]:
        """Per layer, how many bytes differ from what ``reference`` says they hold."""
        got, want = self.memory.cpu(), self._memory(reference)
        return [
            int((self.layout.view(got, layer) != self.layout.view(want, layer)).sum())
            for layer in range(len(reference))
        ]


def check_pages(case: PageCase, sizes: PageSizes, device: torch.device, seed: int) -> list[str]:
    """Store then load through kvtier; the wrong bytes found, as messages (none: it passed)."""
    layers, per_chunk = sizes.layers, sizes.chunk_tokens // case.block_size
    heads = sizes.heads // case.tp
    row_bytes_of_dim = sizes.head_dim * case.dtype.itemsize
    page_bytes = 2 * case.block_size * heads * row_bytes_of_dim
    rows_per_part = layers * per_chunk
    rows_per_slot = rows_per_part * case.tp
    num_slots = sizes.chunks + sizes.spare_slots
    pages_moved = sizes.chunks * per_chunk
    num_blocks = 2 * pages_moved + 3
    generator = torch.Generator().manual_seed(seed)

    def random_bytes(*shape: int) -> torch.Tensor:
        # Drawn as 8-byte words (every dimension here is a multiple of 8 bytes): 4x faster.
        words = (*shape[:-1], shape[-1] // 8)
        drawn = torch.randint(-(2**63), 2**63 - 1, words, generator=generator, dtype=torch.int64)
        return drawn.view(torch.uint8)

    shape = (layers, num_blocks, 2, case.block_size, sizes.heads, row_bytes_of_dim)
    stored, before_load = random_bytes(*shape), random_bytes(*shape)
    blocks = torch.randperm(num_blocks, generator=generator)
    sources, targets = blocks[:pages_moved], blocks[pages_moved : 2 * pages_moved]
    chunk_slots = torch.randperm(num_slots, generator=generator)[: sizes.chunks]
    slots = chunk_slots.repeat_interleave(per_chunk)
    positions = torch.arange(per_chunk).repeat(sizes.chunks)

    # What the slots must hold: slot[rank][layer][position] = that block's page.
    junk = random_bytes(num_slots * rows_per_slot, page_bytes)
    expected = junk.clone()
    rank_heads = [slice(r * heads, (r + 1) * heads) for r in range(case.tp)]
    for rank, head_range in enumerate(rank_heads):
        for layer in range(layers):
            rows = slots * rows_per_slot + rank * rows_per_part + layer * per_chunk + positions
            expected[rows] = case.layout.slot_page(stored[layer, sources][..., head_range, :])

    def index(rank: int, chosen: torch.Tensor, pick: slice = slice(None)) -> CopyIndex:
        return CopyIndex.for_chunks(
            slots[pick].tolist(),
            positions[pick].tolist(),
            chosen[pick].tolist(),
            rows_per_slot=rows_per_slot,
            part_row=rank * rows_per_part,
            num_layers=layers,
            blocks_per_chunk=per_chunk,
        )

    slot_rows = _host_slots(num_slots * rows_per_slot, page_bytes)
    slot_rows.copy_(junk)
    transfers = Transfers(device)
    if device.type != "cpu" and not transfers.asynchronous:
        return [f"{case.label}: no copy stream on {device}: torch.{device.type} lacks streams"]
    if case.route == "direct" and not transfers.attach(slot_rows):
        return [f"{case.label}: the slots could not be registered with {device}"]
    failures: list[str] = []
    try:
        # Store, as two steps in flight at once; the engine reuses the blocks at once.
        half = slice(0, pages_moved // 2), slice(pages_moved // 2, None)
        for rank, head_range in enumerate(rank_heads):
            engine = _Engine(case, stored, head_range, device)
            pages = engine.pages(num_blocks, page_bytes)
            pending, reused = [], stored.clone()
            for step in half:
                pending.append(transfers.start_store(pages, index(rank, sources, step), slot_rows))
                # The engine hands the stored blocks to the next request at once.
                reused[:, sources[step]] = 0x5A
                engine.write(reused)
            if not all(p.finish() for p in pending):
                failures.append(f"{case.label}: rank {rank}: a store reported failure")
        wrong_rows = (slot_rows != expected).any(dim=1).nonzero().flatten().tolist()
        for row in wrong_rows[:3]:
            slot, inside = divmod(row, rows_per_slot)
            rank, inside = divmod(inside, rows_per_part)
            layer, position = divmod(inside, per_chunk)
            failures.append(
                f"{case.label}: store: slot {slot} rank {rank} layer {layer} position {position} "
                f"holds the wrong bytes"
            )
        if len(wrong_rows) > 3:
            failures.append(f"{case.label}: store: {len(wrong_rows)} wrong slot rows in all")

        # Load from slots holding the reference bytes, not what kvtier stored.
        slot_rows.copy_(expected)
        after_load = before_load.clone()
        after_load[:, targets] = stored[:, sources]
        for rank, head_range in enumerate(rank_heads):
            engine = _Engine(case, before_load, head_range, device)
            loading = transfers.load(
                engine.pages(num_blocks, page_bytes), index(rank, targets), slot_rows
            )
            # Read back on the compute stream, with no device-wide wait: only the
            # load's event orders this read after the copy stream's writes.
            for layer, wrong in enumerate(engine.wrong_bytes(after_load)):
                if wrong:
                    failures.append(
                        f"{case.label}: load: rank {rank} layer {layer}: {wrong} wrong bytes"
                    )
            if not loading.finish():
                failures.append(f"{case.label}: rank {rank}: a load reported failure")
    finally:
        transfers.close()  # before the slots' memory goes
    return failures


def page_cases(
    block_sizes: Sequence[int] = (16, 64), routes: Sequence[str] = ("staged",)
) -> list[PageCase]:
    return [
        PageCase(layout, dtype, block_size, tp, route)
        for layout in LAYOUTS.values()
        for dtype in _dtypes()
        for block_size in block_sizes
        for tp in (1, 2)
        for route in routes
    ]


def routes_on(device: torch.device) -> tuple[str, ...]:
    """The routes kvtier takes on ``device``: DMA to registered slots only on CUDA."""
    return ("direct", "staged") if device.type == "cuda" else ("staged",)


# Bandwidth ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    layout: str
    route: str
    mib: float
    store_gbps: float
    load_gbps: float
    copy_to_host_gbps: float
    copy_to_device_gbps: float
    #: Host memory alone: the step's rows gathered out of the slots (a load's
    #: first step) and written into them (a store's last), to tell where time goes.
    slot_gather_gbps: float
    slot_scatter_gbps: float

    @property
    def store_ratio(self) -> float:
        return self.store_gbps / self.copy_to_host_gbps

    @property
    def load_ratio(self) -> float:
        return self.load_gbps / self.copy_to_device_gbps


def measure_bandwidth(
    layout: Layout,
    sizes: PageSizes,
    block_size: int,
    device: torch.device,
    repeat: int,
    route: str = "staged",
) -> Rate:
    """Best-of-``repeat`` GB/s of kvtier's store and load against plain pinned copies."""
    per_chunk = sizes.chunk_tokens // block_size
    row_bytes_of_dim = sizes.head_dim * torch.bfloat16.itemsize
    page_bytes = 2 * block_size * sizes.heads * row_bytes_of_dim
    pages_moved = sizes.chunks * per_chunk
    num_blocks = 2 * pages_moved
    generator = torch.Generator().manual_seed(1)
    reference = torch.randint(
        0,
        256,
        (num_blocks, 2, block_size, sizes.heads, row_bytes_of_dim),
        generator=generator,
        dtype=torch.uint8,
    )
    case = PageCase(layout, torch.bfloat16, block_size, 1)
    engine = _Engine(case, reference.expand(sizes.layers, *reference.shape), slice(None), device)
    pages = engine.pages(num_blocks, page_bytes)
    rows_per_slot = sizes.layers * per_chunk
    slot_rows = _host_slots(sizes.chunks * rows_per_slot, page_bytes)
    scattered = torch.randperm(num_blocks, generator=generator)[:pages_moved].tolist()
    index = CopyIndex.for_chunks(
        torch.arange(sizes.chunks).repeat_interleave(per_chunk).tolist(),
        torch.arange(per_chunk).repeat(sizes.chunks).tolist(),
        scattered,
        rows_per_slot=rows_per_slot,
        part_row=0,
        num_layers=sizes.layers,
        blocks_per_chunk=per_chunk,
    )
    transfers = Transfers(device)
    if route == "direct" and not transfers.attach(slot_rows):
        raise RuntimeError(f"the slots could not be registered with {device}")
    moved = sizes.layers * pages_moved * page_bytes
    pinned = device.type != "cpu"
    host = torch.empty(moved, dtype=torch.uint8, pin_memory=pinned)
    on_device = torch.empty(moved, dtype=torch.uint8, device=device)

    def best(action: Callable[[], object]) -> float:
        action()  # warm: allocator, pinned pools, kernels
        seconds = float("inf")
        for _ in range(repeat):
            _synchronize(device)
            began = time.perf_counter()
            action()
            _synchronize(device)
            seconds = min(seconds, time.perf_counter() - began)
        return moved / seconds / 1e9

    def store() -> None:
        if not transfers.start_store(pages, index, slot_rows).finish():
            raise RuntimeError("a store failed")

    def load() -> None:
        if not transfers.load(pages, index, slot_rows).finish():
            raise RuntimeError("a load failed")

    words, rows = slot_rows.view(torch.int64), index.rows.flatten()
    staged = words.index_select(0, rows)
    try:
        return Rate(
            layout.name,
            route,
            moved / 2**20,
            store_gbps=best(store),
            load_gbps=best(load),
            copy_to_host_gbps=best(lambda: host.copy_(on_device)),
            copy_to_device_gbps=best(lambda: on_device.copy_(host)),
            slot_gather_gbps=best(lambda: words.index_select(0, rows)),
            slot_scatter_gbps=best(lambda: words.index_copy_(0, rows, staged)),
        )
    finally:
        transfers.close()


# The transformers integration --------------------------------------------------


@dataclass(frozen=True)
class ModelSizes:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    prefix_tokens: int
    suffix_tokens: int
    chunk_tokens: int
    rounds: int
    #: Largest allowed |logits with reuse - logits without| over max |logits|.
    tolerance: float = 1e-3


@dataclass(frozen=True)
class ModelResult:
    prompt_tokens: int
    reused_tokens: int
    max_logit_error: float
    ttft_miss_s: float
    ttft_hit_s: float


def check_model(sizes: ModelSizes, device: torch.device) -> tuple[ModelResult, list[str]]:
    """A shared prefix reused through kvtier's CPU tier: logits and time to first token."""
    import transformers

    from kvtier.integrations.transformers import PrefixCache, prefill

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.hidden * 3,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=2 * (sizes.prefix_tokens + sizes.suffix_tokens),
    )
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(2)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, sizes.vocab, (count,), generator=generator).tolist()

    # Room for every prompt of the run (float32 K and V of each layer and KV head).
    head_dim = sizes.hidden // sizes.heads
    slot_bytes = sizes.layers * 2 * sizes.kv_heads * head_dim * sizes.chunk_tokens * 4
    prompt_chunks = (sizes.prefix_tokens + sizes.suffix_tokens) // sizes.chunk_tokens + 1
    cpu_bytes = slot_bytes * prompt_chunks * 2 * (sizes.rounds + 2)
    kv_config = {"chunk_tokens": sizes.chunk_tokens, "cpu_bytes_to_use": cpu_bytes}
    failures: list[str] = []
    miss, hit, errors, reused = [], [], [], 0
    with PrefixCache(model, kv_config) as kv:
        kv.generate(tokens(sizes.prefix_tokens), max_new_tokens=1)  # warm the kernels
        for _ in range(sizes.rounds):
            prefix = tokens(sizes.prefix_tokens)
            first = kv.generate(prefix + tokens(sizes.suffix_tokens), max_new_tokens=1)
            second = kv.generate(prefix + tokens(sizes.suffix_tokens), max_new_tokens=1)
            if first.reused_tokens:
                failures.append(f"model: a new prefix reused {first.reused_tokens} tokens")
            miss.append(first.ttft_s)
            hit.append(second.ttft_s)
            reused = second.reused_tokens
            prompt = prefix + tokens(sizes.suffix_tokens)
            with_reuse, load = kv.prefill(prompt)
            without, _ = prefill(model, prompt)
            scale = float(without.abs().max())
            errors.append(float((with_reuse - without).abs().max()) / scale)
            if load.reused_tokens == 0:
                failures.append("model: the shared prefix was not reused")
    whole_chunks = sizes.prefix_tokens // sizes.chunk_tokens * sizes.chunk_tokens
    if reused != whole_chunks:
        failures.append(f"model: reused {reused} tokens, expected {whole_chunks}")
    if max(errors) > sizes.tolerance:
        failures.append(
            f"model: logits after the reused prefix differ by {max(errors):.2e} of their "
            f"largest value (tolerance {sizes.tolerance:.0e})"
        )
    result = ModelResult(
        sizes.prefix_tokens + sizes.suffix_tokens,
        reused,
        max(errors),
        statistics.median(miss),
        statistics.median(hit),
    )
    return result, failures


# Command line ------------------------------------------------------------------

QUICK_PAGES = PageSizes(layers=2, heads=4, head_dim=16, chunk_tokens=128, chunks=3, spare_slots=2)
FULL_PAGES = PageSizes(layers=4, heads=8, head_dim=128, chunk_tokens=256, chunks=4, spare_slots=3)
QUICK_RATE = PageSizes(layers=2, heads=2, head_dim=64, chunk_tokens=64, chunks=32, spare_slots=0)
FULL_RATE = PageSizes(layers=32, heads=8, head_dim=128, chunk_tokens=256, chunks=16, spare_slots=0)
QUICK_MODEL = ModelSizes(
    2, 64, 4, 2, 128, prefix_tokens=64, suffix_tokens=8, chunk_tokens=16, rounds=2
)
FULL_MODEL = ModelSizes(
    16, 1024, 16, 4, 32000, prefix_tokens=4096, suffix_tokens=64, chunk_tokens=256, rounds=5
)


#: kvtier's copies should move bytes at least this fast, relative to a plain copy_.
BANDWIDTH_GOAL = 0.8


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="torch device (default: the first accelerator, else cpu)")
    parser.add_argument("--quick", action="store_true", help="small sizes, same code paths")
    parser.add_argument("--skip-model", action="store_true", help="no transformers part")
    parser.add_argument("--repeat", type=int, default=10, help="bandwidth: best of this many")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device or _default_device())
    quick = args.quick
    print(f"kvtier device check on {device} (torch {torch.__version__})")

    failures: list[str] = []
    began = time.perf_counter()
    routes = routes_on(device)
    cases = page_cases(routes=routes)
    sizes = QUICK_PAGES if quick else FULL_PAGES
    for number, case in enumerate(cases):
        failures += _guarded(case.label, failures, check_pages, case, sizes, device, number) or []
        if number + 1 == len(cases) or cases[number + 1].layout != case.layout:
            # Progress, so that a run cut short still shows how far it got.
            print(f"  {case.layout.name} done at {time.perf_counter() - began:.1f} s", flush=True)
    print(
        f"pages: {len(cases)} cases ({_covered(cases)}): "
        f"{'FAIL' if failures else 'OK'} in {time.perf_counter() - began:.1f} s"
    )
    for failure in failures:
        print(f"  FAIL {failure}")

    rates: list[Rate] = []
    for name in ("blocks-first", "LBNHC"):
        for route in routes:
            rate = _guarded(
                f"bandwidth {name} {route}",
                failures,
                measure_bandwidth,
                LAYOUTS[name],
                QUICK_RATE if quick else FULL_RATE,
                16,
                device,
                args.repeat,
                route,
            )
            rates += [rate] if rate is not None else []
    print(f"bandwidth (best of {args.repeat}), GB/s, ratio to a plain pinned copy_:")
    for rate in rates:
        print(
            f"  {rate.layout:13s} {rate.route:6s} {rate.mib:7.1f} MiB  "
            f"store {rate.store_gbps:6.2f} "
            f"({rate.store_ratio:.2f}x of {rate.copy_to_host_gbps:.2f})  load "
            f"{rate.load_gbps:6.2f} ({rate.load_ratio:.2f}x of {rate.copy_to_device_gbps:.2f})  "
            + _verdict(rate, device)
        )
        print(
            f"  {'':20s} host side alone: rows out of the slots {rate.slot_gather_gbps:6.2f}, "
            f"into them {rate.slot_scatter_gbps:6.2f}"
        )

    model: ModelResult | None = None
    if not args.skip_model:
        model_failures: list[str] = []
        outcome = _guarded(
            "model", model_failures, check_model, QUICK_MODEL if quick else FULL_MODEL, device
        )
        if outcome is not None:
            model, found = outcome
            model_failures += found
            print(
                f"model: {model.prompt_tokens}-token prompt, {model.reused_tokens} reused, "
                f"logit error {model.max_logit_error:.1e}, TTFT miss "
                f"{model.ttft_miss_s * 1e3:.1f} ms, hit {model.ttft_hit_s * 1e3:.1f} ms"
            )
        print(f"model: {'FAIL' if model_failures else 'OK'}")
        for failure in model_failures:
            print(f"  FAIL {failure}")
        failures += model_failures

    if args.json:
        results: dict[str, Any] = {
            "device": str(device),
            "device_name": _device_name(device),
            "torch": torch.__version__,
            "page_cases": len(cases),
            "layouts": {layout.name: layout.used_by for layout in LAYOUTS.values()},
            "failures": failures,
            "bandwidth": [
                {**asdict(r), "store_ratio": r.store_ratio, "load_ratio": r.load_ratio}
                for r in rates
            ],
            "model": asdict(model) if model is not None else None,
        }
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    print("FAIL" if failures else "OK", f"({time.perf_counter() - began:.1f} s)")
    return 1 if failures else 0


def _verdict(rate: Rate, device: torch.device) -> str:
    if device.type == "cpu":  # host to host: nothing like the copies the goal is about
        return "(no goal on the CPU)"
    met = min(rate.store_ratio, rate.load_ratio) >= BANDWIDTH_GOAL
    return f"goal {BANDWIDTH_GOAL}x: {'met' if met else 'missed'}"


_T = TypeVar("_T")


def _guarded(label: str, failures: list[str], action: Callable[..., _T], *args: Any) -> _T | None:
    """``action(*args)``, or ``None`` with the error counted as a failure: one part
    that breaks (an API the device lacks, say) must not hide what the others found."""
    try:
        return action(*args)
    except Exception as exc:
        traceback.print_exc()
        failures.append(f"{label}: {type(exc).__name__}: {exc}")
        return None


def _covered(cases: Sequence[PageCase]) -> str:
    def values(of: Callable[[PageCase], object]) -> str:
        return ", ".join(str(v) for v in dict.fromkeys(of(case) for case in cases))

    return "; ".join(
        (
            values(lambda c: c.layout.name),
            values(lambda c: str(c.dtype).removeprefix("torch.")),
            "blocks " + values(lambda c: c.block_size),
            "tp " + values(lambda c: c.tp),
            values(lambda c: c.route),
        )
    )


def _device_name(device: torch.device) -> str:
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "get_device_name"):
        return str(module.get_device_name(device))
    return device.type


if __name__ == "__main__":
    sys.exit(main())
