"""Check kvtier's vLLM page copies on an accelerator: correctness and bandwidth.

    python scripts/device_check.py [--device cuda] [--layers 32] [--pages 64]

Builds a paged KV cache on the device shaped like vLLM's (``[num_blocks,
2, block_size, heads, head_dim]`` per layer), stores scattered blocks into
slots in pageable shared memory with the vLLM connector's page copies (copy
stream, events, pinned staging), loads them back into other blocks and
checks every byte. Then times the same store and load against a plain
``tensor.copy_`` of the same bytes between the device and pinned host
memory, and prints GB/s. Needs torch only (not vLLM).

Without an accelerator it says so and exits 0 (``--device cpu`` runs the
inline CPU path instead, as a check of the check).
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_MODULE = Path(__file__).resolve().parents[1] / "src" / "kvtier" / "integrations" / "page_copies.py"


def _page_copies() -> ModuleType:
    """kvtier's page copy module; loaded from its file where kvtier is not installed."""
    try:
        from kvtier.integrations import page_copies

        return page_copies
    except ImportError:  # a machine with torch but without kvtier's dependencies
        spec = importlib.util.spec_from_file_location("kvtier_page_copies", _MODULE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


def _accelerator(requested: str | None) -> str | None:
    import torch

    if requested:
        return requested
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="torch device type (default: the first available)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=64, help="pages copied per layer per step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("device check skipped: torch is not installed")
        return 0
    device_type = _accelerator(args.device)
    if device_type is None:
        print("device check skipped: no accelerator (CUDA or XPU) is available")
        return 0
    copies = _page_copies()
    device = torch.device(device_type)
    module = getattr(torch, device_type)
    dtype = torch.bfloat16
    layers, pages, per_chunk = args.layers, args.pages, 4
    num_blocks = 2 * pages + 8
    page = (2, args.block_size, args.heads, args.head_dim)
    page_bytes = 2 * args.block_size * args.heads * args.head_dim * 2
    generator = torch.Generator(device="cpu").manual_seed(0)
    kv = [
        torch.randn((num_blocks, *page), generator=generator).to(dtype).to(device)
        for _ in range(layers)
    ]
    pages_of = [copies.LayerPages(f"layer{i}", t, num_blocks, page_bytes) for i, t in enumerate(kv)]
    # The primary tier's memory: shared, pageable (not pinned), as in the engine,
    # seen as rows of one page each; chunk c holds layer l's page p at row
    # (c * layers + l) * per_chunk + p.
    chunks = pages // per_chunk
    region = mmap.mmap(-1, chunks * layers * per_chunk * page_bytes)
    slot_rows = torch.frombuffer(region, dtype=torch.uint8).view(-1, page_bytes)
    transfers = copies.Transfers(device)
    if device.type != "cpu" and not transfers.asynchronous:
        print(f"FAIL: no copy stream on {device_type}: torch.{device_type} lacks streams or events")
        return 1
    sources = list(range(0, 2 * pages, 2))  # scattered blocks
    targets = list(range(1, 2 * pages, 2))

    def index(blocks: list[int]) -> object:
        page = torch.arange(pages)
        page_rows = page // per_chunk * layers * per_chunk + page % per_chunk
        layer_rows = torch.arange(layers) * per_chunk
        return copies.CopyIndex(page_rows, layer_rows, torch.tensor(blocks))

    store_index, load_index = index(sources), index(targets)

    def store() -> None:
        if not transfers.start_store(pages_of, store_index, slot_rows).finish():
            raise RuntimeError("a store failed")

    def load() -> None:
        transfers.load(pages_of, load_index, slot_rows)

    store()
    load()
    module.synchronize()
    for number, layer in enumerate(kv):
        if not torch.equal(layer[targets], layer[sources]):
            print(f"FAIL: layer {number}: pages loaded back differ from the pages stored")
            return 1
    print(f"round trip OK on {device}: {layers} layers x {pages} pages of {page_bytes} bytes")

    moved = layers * pages * page_bytes
    host = torch.empty(moved, dtype=torch.uint8, pin_memory=device.type != "cpu")
    on_device = torch.empty(moved, dtype=torch.uint8, device=device)

    def rate(action: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(args.repeat):
            module.synchronize()
            began = time.perf_counter()
            action()
            module.synchronize()
            best = min(best, time.perf_counter() - began)
        return moved / best / 1e9

    results = {
        "kvtier store (device -> slots)": rate(store),
        "kvtier load (slots -> device)": rate(load),
        "copy_ device -> pinned host": rate(lambda: host.copy_(on_device)),
        "copy_ pinned host -> device": rate(lambda: on_device.copy_(host)),
    }
    print(f"{moved / 2**20:.1f} MiB per copy, best of {args.repeat}:")
    for label, value in results.items():
        print(f"  {label:32s} {value:7.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
