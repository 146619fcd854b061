"""The transformers integration on tiny models built from configs (nothing downloaded)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

if TYPE_CHECKING:
    import torch

torch = pytest.importorskip("torch", reason="needs the 'transformers' extra")
transformers = pytest.importorskip("transformers", reason="needs the 'transformers' extra")

from transformers.cache_utils import CacheLayerMixin  # noqa: E402

from kvtier.errors import LayoutMismatchError  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    ChunkReader,
    ChunkWriter,
    PrefixCache,
    greedy_generate,
    layout_for_model,
    layout_from_config,
    prefill,
    prefix_cache,
)
from kvtier.testing.faults import FaultyTier  # noqa: E402

CHUNK = 16
VOCAB = 300


def tiny_config(family: str, **overrides: Any) -> Any:
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
    if family == "llama":
        return transformers.LlamaConfig(**{**common, "num_key_value_heads": 2, **overrides})
    if family == "qwen2":
        return transformers.Qwen2Config(**{**common, "num_key_value_heads": 2, **overrides})
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(**{**common, **overrides})
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()


def prompt(length: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def kv_of(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a cache layer: an attention layer's, in these models."""
    assert isinstance(layer, CacheLayerMixin)
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def kv_config(chunk_tokens: int = CHUNK, tier: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "chunk_tokens": chunk_tokens,
        "cpu_bytes_to_use": "16MiB",
        "secondary_tiers": [tier or {"type": "memory", "max_bytes": "64MiB"}],
    }


FAMILIES = ["llama", "qwen2", "gpt_neox"]


@pytest.fixture
def shared_tier(tmp_path: Path) -> dict[str, Any]:
    """An fs tier whose directory several engines (here: models) share."""
    return {"type": "fs", "root_dir": str(tmp_path / "shared")}


# Layout ---------------------------------------------------------------------


def test_layout_follows_the_config_with_grouped_query_attention() -> None:
    layout = layout_from_config(tiny_config("llama"), dtype=torch.bfloat16, chunk_tokens=32)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.dtype == "bfloat16" and layout.chunk_tokens == 32
    assert layout.slot_bytes == 2 * 2 * 2 * 16 * 2 * 32
    explicit = layout_from_config(
        tiny_config("qwen2", head_dim=32), dtype=torch.float32, chunk_tokens=32
    )
    assert explicit.head_dim == 32
    neox = layout_from_config(tiny_config("gpt_neox"), dtype=torch.float32, chunk_tokens=32)
    assert neox.num_kv_heads == 4  # no grouping: one KV head per attention head


def test_models_with_sliding_window_layers_are_refused() -> None:
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(LayoutMismatchError, match="sliding_attention"):
        layout_from_config(config, dtype=torch.float32, chunk_tokens=16)


def test_models_attending_both_ways_are_refused() -> None:
    """Bidirectional attention (Gemma's ``use_bidirectional_attention``, for
    embedding models) computes a prefix's KV from the tokens after it too."""
    config = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        use_bidirectional_attention=True,
    )  # fmt: skip
    with pytest.raises(LayoutMismatchError, match="both ways"):
        layout_from_config(config, dtype=torch.float32, chunk_tokens=16)
    config.use_bidirectional_attention = False
    assert layout_from_config(config, dtype=torch.float32, chunk_tokens=16).num_layers == 2


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_models_whose_rope_follows_the_sequence_length_are_refused(rope: dict[str, Any]) -> None:
    """transformers rescales such rope by the length of each forward pass: a
    prefix stored from a short prompt holds other keys than the same prefix
    of a prompt past the original context."""
    config = tiny_config("llama", rope_parameters=rope)
    with pytest.raises(LayoutMismatchError, match=f"rope type \\['{rope['rope_type']}'\\]"):
        layout_from_config(config, dtype=torch.float32, chunk_tokens=16)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda: layout_for_model(tiny_model("llama", seed=1), chunk_tokens=CHUNK),
                     id="weights"),
        pytest.param(lambda: layout_for_model(tiny_model("llama", rope_theta=500.0),
                                              chunk_tokens=CHUNK), id="config"),
        pytest.param(lambda: layout_for_model(with_quantised_layer(tiny_model("llama"), 2.0),
                                              chunk_tokens=CHUNK), id="weights_in_buffers"),
        pytest.param(lambda: layout_for_model(tiny_model("llama").to(torch.bfloat16),
                                              chunk_tokens=CHUNK), id="dtype"),
        pytest.param(lambda: layout_for_model(tiny_model("llama"), chunk_tokens=2 * CHUNK),
                     id="chunk_tokens"),
        pytest.param(lambda: layout_for_model(tiny_model("llama"), chunk_tokens=CHUNK,
                                              model_id="other"), id="model_id"),
    ],
)  # fmt: skip
def test_anything_that_changes_the_bytes_changes_the_namespace(change: Callable[[], Any]) -> None:
    base = layout_for_model(with_quantised_layer(tiny_model("llama"), 1.0), chunk_tokens=CHUNK)
    same = layout_for_model(with_quantised_layer(tiny_model("llama"), 1.0), chunk_tokens=CHUNK)
    assert same.namespace == base.namespace
    assert change().namespace != base.namespace


def with_quantised_layer(model: Any, scale: float) -> Any:
    """``model`` with a persistent buffer, as quantised layers (GPTQ, AWQ) keep
    their packed weights and scales: two quantisations of one model differ
    in their buffers only."""
    projection = model.model.layers[0].self_attn.k_proj
    projection.register_buffer("scales", torch.full((4,), scale))
    return model


# Reuse ----------------------------------------------------------------------


@pytest.mark.parametrize("source", ["cpu", "fs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_after_a_reused_prefix_equal_a_full_prefill(
    family: str, source: str, tmp_path: Path
) -> None:
    model = tiny_model(family)
    shared, suffix = prompt(3 * CHUNK + 5), prompt(9, seed=2)
    expected, _ = prefill(model, shared + suffix)
    with PrefixCache(model, kv_config(tier={"type": "fs", "root_dir": str(tmp_path)})) as kv:
        _, first = kv.prefill(shared)
        assert first.reused_tokens == 0
        if source == "fs":
            kv.kv.reset()  # the CPU tier forgets; the fs tier behind it keeps
        logits, reused = kv.prefill(shared + suffix)
    assert reused.reused_tokens == 3 * CHUNK  # the partial fourth chunk was never stored
    assert reused.promoted_chunks == ((3,) if source == "fs" else (0,))
    assert (logits - expected).abs().max().item() <= 1e-5


def test_a_prefix_promoted_in_several_jobs_is_reused_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One promotion job a chunk: the reader takes each chunk as its job lands.
    from kvtier import manager as manager_module

    model = tiny_model("llama")
    slot_bytes = layout_for_model(model, chunk_tokens=CHUNK).slot_bytes
    monkeypatch.setattr(manager_module, "PROMOTION_JOB_BYTES", slot_bytes)
    shared, suffix = prompt(5 * CHUNK), prompt(7, seed=3)
    expected, _ = prefill(model, shared + suffix)
    with PrefixCache(model, kv_config(tier={"type": "fs", "root_dir": str(tmp_path)})) as kv:
        kv.prefill(shared)
        kv.kv.reset()  # the CPU tier forgets; the fs tier behind it keeps
        logits, reused = kv.prefill(shared + suffix, store=False)
    assert reused.reused_tokens == reused.hit_tokens == 5 * CHUNK
    assert reused.promoted_chunks == (5,)
    assert (logits - expected).abs().max().item() <= 1e-5


def test_a_prefix_shorter_than_the_prompt_fills_the_reader_in_part() -> None:
    model = tiny_model("llama")
    shared = prompt(2 * CHUNK)
    tokens = shared + prompt(3 * CHUNK + 4, seed=5)
    expected, _ = prefill(model, tokens)
    with PrefixCache(model, kv_config()) as kv:
        kv.prefill(shared)
        logits, reused = kv.prefill(tokens, store=False)
    # Room for five chunks, two found: the model cache holds those two.
    assert reused.reused_tokens == reused.hit_tokens == 2 * CHUNK
    assert reused.cache.get_seq_length() == len(tokens)
    assert (logits - expected).abs().max().item() <= 1e-5


def test_a_reader_takes_chunks_in_order_only() -> None:
    model = tiny_model("llama")
    layout = layout_for_model(model, chunk_tokens=CHUNK)
    reader = ChunkReader(layout, 3 * CHUNK)
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8).numpy()
    reader(0, slot)
    with pytest.raises(ValueError, match="chunk 2 out of order"):
        reader(2, slot)
    assert reader.filled == CHUNK


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_prompt_held_whole_still_computes_its_last_token(family: str) -> None:
    model = tiny_model(family)
    tokens = prompt(4 * CHUNK)
    expected, _ = prefill(model, tokens)
    with PrefixCache(model, kv_config()) as kv:
        kv.prefill(tokens)
        logits, reused = kv.prefill(tokens)
    assert reused.hit_tokens == 4 * CHUNK
    assert reused.reused_tokens == 4 * CHUNK - 1
    assert (logits - expected).abs().max().item() <= 1e-5


def test_only_full_chunks_are_stored() -> None:
    model = tiny_model("llama")
    tokens = prompt(2 * CHUNK + CHUNK // 2)
    with PrefixCache(model, kv_config()) as kv:
        kv.prefill(tokens)
        assert kv.kv.cached_prefix(tokens) == 2 * CHUNK
        assert kv.kv.status.primary.chunks == 2


def test_bfloat16_kv_round_trips_bit_exact() -> None:
    model = tiny_model("qwen2").to(torch.bfloat16)
    tokens = prompt(2 * CHUNK + 3)
    _, cache = prefill(model, tokens)
    layout = layout_for_model(model, chunk_tokens=CHUNK)
    writer = ChunkWriter(cache, layout)
    slots = torch.zeros((writer.full_chunks, layout.slot_bytes), dtype=torch.uint8).numpy()
    for index in range(writer.full_chunks):
        writer(index, slots[index])
    reader = ChunkReader(layout, 2 * CHUNK - 1)  # the last chunk is taken in part
    for index in range(reader.chunks):
        reader(index, slots[index])
    rebuilt = reader.to_cache(model.config)
    for original, copy in zip(cache.layers, rebuilt.layers, strict=True):
        keys, values = kv_of(original)
        copy_keys, copy_values = kv_of(copy)
        assert copy_keys.dtype == torch.bfloat16
        assert torch.equal(copy_keys, keys[:, :, : 2 * CHUNK - 1])
        assert torch.equal(copy_values, values[:, :, : 2 * CHUNK - 1])


def test_a_cache_of_another_shape_is_refused() -> None:
    model, other = tiny_model("llama"), tiny_model("gpt_neox")
    _, cache = prefill(other, prompt(CHUNK))
    with pytest.raises(LayoutMismatchError, match="expected"):
        ChunkWriter(cache, layout_for_model(model, chunk_tokens=CHUNK))


# Generation -----------------------------------------------------------------


def test_greedy_generation_matches_model_generate() -> None:
    model = tiny_model("qwen2")
    tokens = prompt(40)
    ours = greedy_generate(model, tokens, 8)
    theirs = model.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False)
    assert ours.tokens == theirs[0, len(tokens) :].tolist()
    assert ours.cache is not None and ours.cache.get_seq_length() == len(tokens) + 7


def test_a_conversation_reuses_its_previous_turn_and_generates_the_same() -> None:
    model = tiny_model("llama")
    turn1 = prompt(2 * CHUNK + 7)
    with PrefixCache(model, kv_config()) as kv:
        first = kv.generate(turn1, 12)
        turn2 = turn1 + first.tokens + prompt(5, seed=3)
        second = kv.generate(turn2, 6)
    # The cache held the prompt and all replies but the last token: whole chunks stored.
    assert first.stored_chunks == (len(turn1) + 11) // CHUNK
    assert second.reused_tokens == first.stored_chunks * CHUNK
    assert first.tokens == greedy_generate(model, turn1, 12).tokens
    assert second.tokens == greedy_generate(model, turn2, 6).tokens


# Isolation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("other", "chunk_tokens"),
    [
        pytest.param(lambda: tiny_model("llama", rope_theta=500.0), CHUNK, id="config"),
        pytest.param(lambda: tiny_model("llama", seed=7), CHUNK, id="weights"),
        pytest.param(lambda: tiny_model("llama").to(torch.bfloat16), CHUNK, id="dtype"),
        pytest.param(lambda: tiny_model("llama"), CHUNK // 2, id="chunk_tokens"),
    ],
)
def test_another_model_never_hits_the_chunks_of_this_one(
    shared_tier: dict[str, Any], other: Callable[[], Any], chunk_tokens: int
) -> None:
    tokens = prompt(4 * CHUNK + 1)
    with PrefixCache(tiny_model("llama"), kv_config(tier=shared_tier)) as kv:
        kv.prefill(tokens)
    with PrefixCache(tiny_model("llama"), kv_config(tier=shared_tier)) as same:
        _, reused = same.prefill(tokens, store=False)
        assert reused.hit_tokens == 4 * CHUNK  # the shared tier does serve the same model
        assert same.kv.status.tiers[0].stats["hits"] == 4
    with PrefixCache(other(), kv_config(chunk_tokens, tier=shared_tier)) as kv:
        _, reused = kv.prefill(tokens, store=False)
        assert reused.hit_tokens == 0
        assert kv.kv.status.tiers[0].stats["hits"] == 0


def test_a_broken_tier_costs_the_reuse_never_the_answer() -> None:
    model = tiny_model("llama")
    tokens = prompt(3 * CHUNK + 2)
    expected = greedy_generate(model, tokens, 6).tokens
    faulty = {"type": "FaultyTier", "module_path": "kvtier.testing.faults"}
    with PrefixCache(model, kv_config(tier=faulty)) as kv:
        kv.generate(tokens, 6)
        kv.kv.reset()
        tier = cast(FaultyTier, kv.kv.manager.tiers[0])
        tier.broken = True  # fault injection: the tier itself
        result = kv.generate(tokens, 6)
        tier.broken = False
    assert result.reused_tokens == 0
    assert result.tokens == expected


def test_a_prefix_found_stays_loadable_while_another_request_fills_the_cpu_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    slot_bytes = layout_for_model(model, chunk_tokens=CHUNK).slot_bytes
    shared, suffix = prompt(3 * CHUNK + 5), prompt(9, seed=2)
    expected, _ = prefill(model, shared + suffix)
    config = {"chunk_tokens": CHUNK, "cpu_bytes_to_use": 4 * slot_bytes}
    with PrefixCache(model, config) as kv:
        kv.prefill(shared)
        interposed: list[int] = []

        class ReaderInterruptedByAnotherRequest(ChunkReader):
            """Between the lookup and the first copy, another request offloads four
            chunks into a CPU tier of four slots. It may not take the three found."""

            def __call__(self, index: int, slot: Any) -> None:
                if not interposed:
                    rows = torch.zeros((4, slot_bytes), dtype=torch.uint8).numpy()
                    interposed.append(kv.kv.store(prompt(4 * CHUNK, seed=9), rows))
                super().__call__(index, slot)

        monkeypatch.setattr(prefix_cache, "ChunkReader", ReaderInterruptedByAnotherRequest)
        logits, reused = kv.prefill(shared + suffix, store=False)
    assert interposed == [0]
    assert reused.reused_tokens == 3 * CHUNK
    assert (logits - expected).abs().max().item() <= 1e-5


def test_trace_recording_records_each_prefill_and_replays(tmp_path: Path) -> None:
    from kvtier.sim.trace import read_trace

    path = tmp_path / "traffic.jsonl"
    shared = prompt(3 * CHUNK)
    turns = [shared + prompt(CHUNK + 5, seed=2), shared + prompt(2 * CHUNK, seed=3)]
    model = tiny_model("llama")
    with PrefixCache(model, {**kv_config(), "trace_recording": {"path": str(path)}}) as kv:
        for turn in turns:
            kv.prefill(turn)
    requests = read_trace(path)
    # One record per request, its full prompt chunks; the second shares the first three.
    assert [len(r.blocks) for r in requests] == [len(t) // CHUNK for t in turns]
    assert requests[0].blocks[:3] == requests[1].blocks[:3]
    assert requests[0].blocks[3] != requests[1].blocks[3]


# Codecs ---------------------------------------------------------------------


def test_a_lossless_tier_gives_the_same_generation_from_its_reloaded_chunks() -> None:
    model = tiny_model("llama")
    tokens = prompt(3 * CHUNK + 2)
    expected = greedy_generate(model, tokens, 6).tokens
    tier = {"type": "memory", "max_bytes": "64MiB", "codec": "lossless"}
    with PrefixCache(model, kv_config(tier=tier)) as kv:
        kv.generate(tokens, 6)
        kv.kv.reset()  # the primary tier forgets: the prefix comes back through the codec
        result = kv.generate(tokens, 6)
        stats = kv.kv.status.tiers[0].stats
    assert result.reused_tokens == 3 * CHUNK and stats["chunks_loaded"] == 3
    assert stats["codec_bytes_out"] < stats["codec_bytes_in"]
    assert result.tokens == expected


def test_lossy_chunks_of_a_shared_root_serve_only_models_with_the_opt_in(
    shared_tier: dict[str, Any],
) -> None:
    tokens = prompt(4 * CHUNK + 1)
    lossy = {**shared_tier, "codec": "int8"}
    with PrefixCache(tiny_model("llama"), kv_config(tier=lossy)) as kv:
        kv.prefill(tokens)
    with PrefixCache(tiny_model("llama"), kv_config(tier=shared_tier)) as exact:
        _, reused = exact.prefill(tokens, store=False)
        assert reused.hit_tokens == 0 and exact.kv.status.tiers[0].stats["chunks_loaded"] == 0
    with PrefixCache(tiny_model("llama"), kv_config(tier=lossy)) as same:
        _, reused = same.prefill(tokens, store=False)
        assert reused.hit_tokens == 4 * CHUNK
        assert same.kv.status.tiers[0].stats["chunks_loaded"] == 4
