"""Chunk keys: prefix-chained, fixed-size, deterministic everywhere."""

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from kvtier import KVLayout, chunk_keys
from kvtier.keys import chain_key
from kvtier.layout import KEY_BYTES
from kvtier.testing import small_layout

TOKENS = list(range(100, 164))


def test_keys_are_fixed_size_and_one_per_full_chunk() -> None:
    keys = chunk_keys(small_layout().namespace, [*TOKENS, 1, 2, 3], 16)
    assert len(keys) == 4
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4


def test_equal_keys_mean_equal_whole_prefixes() -> None:
    ns = small_layout().namespace
    base = chunk_keys(ns, TOKENS, 16)
    changed_first = chunk_keys(ns, [0, *TOKENS[1:]], 16)
    # Chunk 3 has the same tokens but a different prefix: a different key.
    assert all(a != b for a, b in zip(base, changed_first, strict=True))
    changed_last = chunk_keys(ns, [*TOKENS[:-1], 0], 16)
    assert base[:3] == changed_last[:3] and base[3] != changed_last[3]


def test_extras_change_keys_without_aliasing() -> None:
    ns = small_layout().namespace
    plain = chain_key(ns, [1, 2])
    assert chain_key(ns, [1, 2], b"lora-a") not in (plain, chain_key(ns, [1, 2], b"lora-b"))
    # Token ids and extra bytes can never be confused with each other.
    assert chain_key(ns, [1], (2).to_bytes(8, "little")) != chain_key(ns, [1, 2])


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_dim": 32},
        {"dtype": "bfloat16"},
        {"chunk_tokens": 32},
        {"kv_order": "layer,token,kv,head,dim"},
        {"extra": (("quant", "fp8"),)},
    ],
)
def test_every_layout_field_changes_the_namespace(change: dict) -> None:
    layout = small_layout()
    assert replace(layout, **change).namespace != layout.namespace


def test_keys_are_identical_across_processes_whatever_the_hash_seed() -> None:
    code = (
        "from kvtier.testing import small_layout; from kvtier import chunk_keys;"
        f"print(b''.join(chunk_keys(small_layout().namespace, {TOKENS!r}, 16)).hex())"
    )
    outputs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        outputs.add(run.stdout.strip())
    assert outputs == {b"".join(chunk_keys(small_layout().namespace, TOKENS, 16)).hex()}


def test_token_arrays_and_lists_give_the_same_keys() -> None:
    ns = small_layout().namespace
    assert chunk_keys(ns, np.array(TOKENS, dtype=np.int32), 16) == chunk_keys(ns, TOKENS, 16)


def test_layout_sizes() -> None:
    layout = KVLayout(
        "m", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256
    )
    assert layout.bytes_per_token == 2 * 4 * 8 * 128 * 2
    assert layout.slot_bytes == layout.bytes_per_token * 256
    assert layout.chunk_shape == (4, 2, 256, 8, 128)


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"head_dim": -1}, {"dtype": "float64x"}])
def test_layout_rejects_nonsense(bad: dict) -> None:
    fields = {
        "model_id": "m",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 8,
        "dtype": "float16",
        "chunk_tokens": 4,
    }
    with pytest.raises(ValueError, match="KVLayout"):
        KVLayout(**{**fields, **bad})


def test_keys_never_change_across_releases() -> None:
    """Shared tiers hold chunks under these keys: a new release must find them."""
    tokens = list(range(1000, 1014))  # three full chunks of four and a tail
    keys = [k.hex()[:24] for k in chunk_keys(b"ns-golden", tokens, 4)]
    assert keys == [
        "09b57cf4d6e9da47ce4f4ec0",
        "50967472c99e579102cb2b78",
        "d79afe90cb0e14ea6df4dd8b",
    ]
    extras = [b"", b"lora-7", b""]
    keys = [k.hex()[:24] for k in chunk_keys(b"ns-golden", tokens[:12], 4, extras=extras)]
    assert keys == [
        "09b57cf4d6e9da47ce4f4ec0",
        "a4f25e3fa5eb1b02b23d6fd5",
        "3b7791641fe5df84fa7eed52",
    ]
    assert chain_key(b"ns-golden", tokens[:4]).hex()[:24] == keys[0]
