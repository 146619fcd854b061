"""Chunk keys: prefix-chained, fixed-size, deterministic everywhere."""

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, KVLayout, chunk_keys
from kvtier import keys as keys_module
from kvtier.keys import KeyMemo, chain_key, keys_of_token_bytes
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


def test_keys_of_token_bytes_are_the_chunk_keys_of_the_tokens() -> None:
    tokens = list(range(300, 314))  # three full chunks of 4 and a tail
    data = np.asarray(tokens, dtype="<i8").tobytes()
    assert keys_of_token_bytes(b"ns", data, 4) == chunk_keys(b"ns", tokens, 4)
    extras = [b"salt", b"", b"x"]
    assert keys_of_token_bytes(b"ns", data, 4, extras) == chunk_keys(b"ns", tokens, 4, extras)
    assert keys_of_token_bytes(b"ns", data[:24], 4) == []


def test_layout_sizes() -> None:
    layout = KVLayout(
        "m", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256
    )
    assert layout.bytes_per_token == 2 * 4 * 8 * 128 * 2
    assert layout.slot_bytes == layout.bytes_per_token * 256
    assert layout.chunk_shape == (4, 2, 256, 8, 128)


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"head_dim": -1}, "head_dim must be a positive int"),
        ({"dtype": "float64x"}, "dtype 'float64x' is not supported"),
        ({"dtype": ["float16"]}, r"dtype \['float16'\] is not supported"),
        # Without a model id, every model of one shape would share chunks.
        ({"model_id": None}, "model_id must be a non-empty str, got None"),
        ({"model_id": " "}, "model_id must be a non-empty str"),
        ({"kv_order": 5}, "kv_order must be a non-empty str, got 5"),
        ({"extra": "quant=fp8"}, "extra must be .* pairs of str, got 'quant=fp8'"),
        ({"extra": [1]}, r"extra: 1 is not a \(name, value\) pair"),
        # 8 and "8" would be two namespaces for one engine.
        ({"extra": (("bits", 8),)}, r"extra: \('bits', 8\) is not a \(name, value\) pair"),
        ({"extra": (("q", "a"), ("q", "b"))}, r"extra names \['q'\] more than once"),
    ],
)
def test_layout_rejects_nonsense(bad: dict, problem: str) -> None:
    fields = {
        "model_id": "m",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 8,
        "dtype": "float16",
        "chunk_tokens": 4,
    }
    with pytest.raises(ValueError, match=f"KVLayout.{problem}"):
        KVLayout(**{**fields, **bad})


def test_layout_extra_given_as_a_list_or_mapping_is_the_same_layout() -> None:
    pairs = (("quant", "fp8"), ("engine", "x"))
    layout = replace(small_layout(), extra=pairs)
    for given in ([list(pair) for pair in pairs], dict(pairs)):
        same = replace(small_layout(), extra=given)  # type: ignore[arg-type]  # kvtier makes it pairs
        assert same == layout and same.namespace == layout.namespace
        assert hash(same) == hash(layout)  # frozen: stored as a tuple of tuples


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


def test_the_key_memo_answers_as_chunk_keys_whatever_the_limit() -> None:
    memo = KeyMemo(b"ns", 4, entries=2)
    tokens = np.arange(100, 122)  # five full chunks and a tail
    expected = chunk_keys(b"ns", tokens, 4)
    assert memo.keys(tokens, 2) == expected[:2]  # a prefix before the whole
    assert memo.keys(tokens) == expected
    assert memo.keys(tokens, 3) == expected[:3]  # from the memo
    assert memo.keys(tokens[:20]) == expected  # the same full chunks, no tail
    assert memo.keys(list(range(3))) == []
    changed = tokens.copy()
    changed[5] += 1  # content, not identity, is the memo's key
    assert memo.keys(changed)[0] == expected[0] and memo.keys(changed)[1] != expected[1]


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """One entry per chunk hashed from here on (each chunk hashes a copy of the set-up hasher)."""
    counts: list[None] = []
    real = keys_module._HASHER

    class Counting:
        def copy(self) -> Any:
            counts.append(None)
            return real.copy()

    monkeypatch.setattr(keys_module, "_HASHER", Counting())
    return counts


def test_the_key_memo_hashes_a_known_prompt_never_again_and_stays_bounded(
    hashed: list[None],
) -> None:
    memo = KeyMemo(b"ns", 4, entries=2, max_bytes=3 * 4 * 8)
    prompts = [np.arange(i * 100, i * 100 + 12) for i in range(3)]  # three chunks each
    memo.keys(prompts[0])
    memo.keys(prompts[0], 2)
    memo.keys(prompts[0])
    assert len(hashed) == 3
    memo.keys(prompts[1])  # over max_bytes with both: the oldest goes
    memo.keys(prompts[0])
    assert len(hashed) == 9
    memo.keys(np.arange(0, 16))  # too large to keep at all
    memo.keys(np.arange(0, 16))
    assert len(hashed) == 17


def test_a_request_hashes_its_prompt_once(hashed: list[None]) -> None:
    layout = small_layout(chunk_tokens=4)
    config = {"chunk_tokens": 4, "cpu_bytes_to_use": 8 * layout.slot_bytes}
    tokens = list(range(500, 514))  # three full chunks
    rows = np.ones((3, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        assert cache.store(tokens, rows) == 3
        with cache.lookup(tokens) as found:
            assert found.num_tokens == 12
        out = np.zeros_like(rows)
        assert cache.load(tokens, 8, out[:2]) == 8
        assert (out[:2] == 1).all()
    assert len(hashed) == 3


def test_tokens_keyed_once_serve_a_request_as_the_token_ids_do(hashed: list[None]) -> None:
    layout = small_layout(chunk_tokens=4)
    config = {"chunk_tokens": 4, "cpu_bytes_to_use": 8 * layout.slot_bytes}
    tokens = list(range(700, 714))  # three full chunks and a tail
    rows = np.arange(3 * layout.slot_bytes, dtype=np.uint64).astype(np.uint8).reshape(3, -1)
    with KVCache(config, layout) as cache:
        keyed = cache.keyed(tokens)
        assert list(keyed.keys) == cache.keys(tokens)  # from the memo: hashed once
        assert len(keyed) == keyed.num_tokens == 14
        assert cache.store(keyed, rows, num_chunks=2) == 2
        with cache.lookup(keyed) as found:
            assert found.num_tokens == 8
        assert cache.store(keyed, rows) == 1  # only the chunk it lacked
        out = np.zeros_like(rows)
        assert cache.load(keyed, 12, out) == 12
        assert (out == rows).all()
        assert cache.cached_prefix(tokens) == 12  # the same chunks, by the token ids
        with pytest.raises(ValueError, match="num_tokens=16 exceeds the 12 tokens"):
            cache.load(keyed, 16, out)
    assert len(hashed) == 3


def test_tokens_keyed_by_another_layout_are_refused() -> None:
    layout = small_layout(chunk_tokens=4)
    other = replace(layout, model_id="another-model")
    config = {"chunk_tokens": 4, "cpu_bytes_to_use": 8 * layout.slot_bytes}
    with KVCache(config, layout) as cache, KVCache(config, other) as foreign:
        keyed = foreign.keyed(list(range(8)))
        with pytest.raises(ValueError, match="another layout"):
            cache.lookup(keyed)
        with pytest.raises(ValueError, match="another layout"):
            cache.store(keyed, np.zeros((2, layout.slot_bytes), np.uint8))


@pytest.mark.parametrize(
    ("call", "error", "problem"),
    [
        # A float was truncated: 1.5 shared the key of 1.
        (lambda: chain_key(b"n" * 32, [1.5]), TypeError, r"tokens\[0\] = 1.5 \(float\)"),  # type: ignore[list-item]
        (lambda: chunk_keys(b"n", [1, 2.5, 3, 4], 4), TypeError, r"tokens\[1\] = 2.5"),  # type: ignore[list-item]
        (lambda: chunk_keys(b"n", np.ones(4), 4), TypeError, "must be integers, got dtype float64"),
        (lambda: chunk_keys(b"n", "abcd", 4), TypeError, "tokens: expected a sequence of int"),  # type: ignore[arg-type]
        (lambda: chain_key("ns", [1]), TypeError, "parent: expected bytes, got str"),  # type: ignore[arg-type]
        (lambda: chain_key(b"n", [1], "lora"), TypeError, "extra: expected bytes, got str"),  # type: ignore[arg-type]
        (lambda: chunk_keys("ns", [1] * 4, 4), TypeError, "namespace: expected bytes, got str"),  # type: ignore[arg-type]
        (lambda: chunk_keys(b"n", [1] * 4, 0), ValueError, "chunk_tokens must be >= 1, got 0"),
        (lambda: chunk_keys(b"n", [1] * 4, 2.0), TypeError, "chunk_tokens must be an int"),  # type: ignore[arg-type]
        (lambda: chunk_keys(b"n", [1] * 8, 4, [b"a"]), ValueError, "extras: 1 given for 2 full"),
        (lambda: chunk_keys(b"n", [1] * 8, 4, [b"a", "b"]), TypeError, r"extras\[1\]: expected"),  # type: ignore[list-item]
        (lambda: chunk_keys(b"n", [1] * 8, 4, b"ab"), TypeError, "extras: expected a sequence"),  # type: ignore[arg-type]
    ],
)
def test_key_functions_refuse_what_would_key_the_wrong_bytes(
    call: Callable[[], object], error: type[Exception], problem: str
) -> None:
    with pytest.raises(error, match=problem):
        call()


def test_extras_past_the_full_chunks_are_not_needed_nor_used() -> None:
    tokens = list(range(9))  # two full chunks of 4 and a tail
    assert chunk_keys(b"n", tokens, 4, [b"a", b"b", b"tail"]) == chunk_keys(
        b"n", tokens, 4, [b"a", b"b"]
    )
