"""The device check's page layouts are vLLM's own: same views, same strides.

``scripts/device_check.py`` builds each layer's KV cache from its own
description of vLLM 0.32's memory orders; here vLLM builds the views from
the same bytes with its allocator's code, and both must agree element for
element and stride for stride.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

import torch
from tests.support.device_check_script import device_check
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

pytestmark = pytest.mark.slow

LAYERS, BLOCKS, HEADS, HEAD_DIM = 3, 7, 4, 16


@pytest.mark.parametrize("name", [layout.name for layout in KVCacheLayout])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_layout_is_the_view_vllm_gives_the_connector(
    name: str, block_size: int, dtype: torch.dtype
) -> None:
    layout = device_check().LAYOUTS[name]
    reference = torch.randint(
        0, 256, (LAYERS, BLOCKS, 2, block_size, HEADS, HEAD_DIM * dtype.itemsize), dtype=torch.uint8
    )
    memory = layout.memory(reference)

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype
    )
    order = KVCacheLayout[name]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, order)
    tensor = KVCacheTensor(
        size=memory.numel(),
        layers=[f"layer{i}" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = create_kv_cache_views(memory.flatten().view(torch.int8), spec, BLOCKS, order, tensor)

    page_bytes = spec.page_size_bytes
    for layer, theirs in enumerate(views):
        ours = layout.view(memory.view(dtype), layer)
        assert ours.shape == theirs.shape
        assert ours.stride() == theirs.stride()
        assert ours.data_ptr() == theirs.data_ptr()
        # vLLM's pages hold the bytes the check expects in a slot row.
        expected = layout.slot_page(reference[layer])
        assert expected.shape == (BLOCKS, page_bytes)
        for block in range(BLOCKS):
            assert torch.equal(theirs[block].view(torch.uint8).flatten(), expected[block])
