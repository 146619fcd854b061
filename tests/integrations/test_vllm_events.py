"""kvtier's tiers in vLLM's KV-cache event stream.

The mapping from kvtier chunks to vLLM's block hashes is checked against
vLLM's own block pool; the end-to-end test runs vLLM's OpenAI server with
``--kv-events-config`` and decodes its ZMQ stream as a router would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.events import TierEvents
from kvtier.keys import ChunkKey

BLOCK = 16
BLOCKS_PER_CHUNK = 2
KEYS = [ChunkKey(bytes([i]) * 32) for i in range(4)]


def _request(tokens: list[int], *, block_hashes: bool = True, **fields: Any) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor) if block_hashes else None
    return Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher, **fields)


def _gpu_stored(request: Any, blocks: int) -> BlockStored:
    """What vLLM's own prefix cache announces for the request's first blocks."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(
        num_gpu_blocks=blocks + 1, enable_caching=True, hash_block_size=BLOCK,
        enable_kv_cache_events=True,
    )  # fmt: skip
    pool.cache_full_blocks(request, pool.get_new_blocks(blocks), 0, blocks, BLOCK, 0)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


def _events(**options: Any) -> TierEvents:
    return TierEvents(
        ["cpu", "fs"], blocks_per_chunk=BLOCKS_PER_CHUNK, block_size=BLOCK,
        hash_block_size=BLOCK, **options,
    )  # fmt: skip


PROMPT = list(range(100, 170))  # four blocks of 16 (two chunks), and six tokens more


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_chunk_is_announced_with_the_hashes_vllm_gives_its_blocks(salt: str | None) -> None:
    request = _request(PROMPT, cache_salt=salt)
    gpu = _gpu_stored(request, 2 * BLOCKS_PER_CHUNK)
    events = _events()
    events.remember(request, range(2), KEYS)
    events.changed("cpu", KEYS[:2], True)
    first, second = events.take()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes + second.block_hashes == gpu.block_hashes
    assert first.parent_block_hash is None and second.parent_block_hash == gpu.block_hashes[1]
    assert first.token_ids + second.token_ids == gpu.token_ids == PROMPT[:64]
    assert (first.extra_keys or []) + (second.extra_keys or []) == gpu.extra_keys
    for event in (first, second):
        assert event.medium == "kvtier:cpu" and event.block_size == gpu.block_size == BLOCK
        assert (event.lora_id, event.lora_name, event.group_idx) == (None, None, gpu.group_idx)
    # What a router decodes is what was published.
    batch = KVEventBatch(ts=1.0, events=[first, second])
    decoded = _decode(_encode(batch))
    assert decoded.events == [first, second]


def _encode(batch: KVEventBatch) -> bytes:
    import msgspec

    return msgspec.msgpack.Encoder().encode(batch)


def _decode(payload: bytes) -> KVEventBatch:
    import msgspec

    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)


def announced(events: TierEvents) -> list[tuple[str | None, list[Any]]]:
    """The medium and block hashes of each event ``events`` has to announce."""
    taken = []
    for event in events.take():
        assert isinstance(event, BlockStored | BlockRemoved), event
        taken.append((event.medium, event.block_hashes))
    return taken


def test_removals_name_the_blocks_per_tier_until_no_tier_holds_the_chunk() -> None:
    request = _request(PROMPT)
    gpu = _gpu_stored(request, 4)
    events = _events(media={"fs": "STORAGE"})
    events.remember(request, range(2), KEYS)
    events.changed("cpu", KEYS[:2], True)
    events.changed("fs", KEYS[:1], True)
    events.changed("cpu", KEYS[:1], True)  # announced already: not again
    assert announced(events) == [
        ("kvtier:cpu", gpu.block_hashes[:2]),
        ("kvtier:cpu", gpu.block_hashes[2:]),
        ("STORAGE", gpu.block_hashes[:2]),
    ]
    events.changed("cpu", KEYS[:2], False)
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved)
    assert (removed.medium, removed.block_hashes) == ("kvtier:cpu", gpu.block_hashes)
    # Still in fs: its removal is announced, and the chunk then forgotten.
    events.changed("fs", KEYS[:1], False)
    events.changed("fs", KEYS[:1], False)  # removed already: nothing to announce
    assert announced(events) == [("STORAGE", gpu.block_hashes[:2])]
    events.changed("cpu", KEYS[:1], True)
    assert events.take() == [] and events.counters.unmapped == 1


def test_queued_changes_and_remembered_chunks_are_bounded() -> None:
    request = _request(PROMPT + list(range(200, 300)))
    events = _events(max_chunks=2, max_queued=3)
    events.remember(request, range(4), KEYS)  # the first two are forgotten
    events.changed("cpu", KEYS, True)  # four changes: over the bound, dropped
    assert events.take() == [] and events.counters.dropped == 4
    events.changed("cpu", KEYS[:3], True)
    announced = events.take()
    assert len(announced) == 1 and events.counters.unmapped == 2  # KEYS[2] only
    assert events.counters.published == 1


def test_without_vllm_block_hashes_nothing_is_remembered() -> None:
    """Prefix caching off: vLLM hashes no blocks and publishes none of its own."""
    events = _events()
    events.remember(_request(PROMPT, block_hashes=False), range(2), KEYS)
    events.changed("cpu", KEYS[:2], True)
    assert events.take() == [] and events.counters.unmapped == 2


def test_a_medium_for_an_unknown_tier_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"kvtier_kv_events_media.*'redis'.*\['cpu', 'fs'\]"):
        _events(media={"redis": "REMOTE"})


@pytest.mark.parametrize(
    ("vllm_events", "extra", "published"),
    [(True, {}, True), (False, {}, False), (True, {"kvtier_kv_events": False}, False)],
)
def test_events_follow_vllms_setting_and_the_connector_option(
    vllm_events: bool, extra: dict[str, Any], published: bool
) -> None:
    from types import SimpleNamespace

    from vllm.config import KVEventsConfig

    from kvtier.config import load_config
    from kvtier.integrations.vllm.engine_config import VllmGeometry, connector_options
    from kvtier.integrations.vllm.events import tier_events

    config = load_config({"secondary_tiers": [{"type": "memory"}, {"type": "fs", "root_dir": "/x"},
                                               {"type": "fs", "root_dir": "/y"}]})  # fmt: skip
    on = KVEventsConfig(enable_kv_cache_events=vllm_events)
    vllm_config = SimpleNamespace(kv_events_config=on)
    shape = VllmGeometry(("l0",), block_size=16, blocks_per_chunk=4, page_bytes=64, num_blocks=8)
    media = {"kvtier_kv_events_media": {"fs:2": "STORAGE"}}
    options = connector_options({**media, **extra})
    events = tier_events(options, config, vllm_config, SimpleNamespace(), shape)
    assert (events is not None) == published
    if events is not None:
        assert events.media == {
            "cpu": "kvtier:cpu", "memory": "kvtier:memory", "fs:1": "kvtier:fs:1",
            "fs:2": "STORAGE",
        }  # fmt: skip
        assert (events.blocks_per_chunk, events.hash_block_size) == (4, 16)


def test_a_misspelt_event_option_names_the_nearest_key() -> None:
    from kvtier.integrations.vllm.engine_config import connector_options

    with pytest.raises(ConfigError, match="did you mean 'kvtier_kv_events_media'"):
        connector_options({"kvtier_kv_event_media": {}})


# End to end: vLLM's OpenAI server, its ZMQ event stream, a router's view ----

CHUNK, SERVER_BLOCK = 64, 32
#: The tiny model's chunk: 2 layers x 2 blocks x (K and V, 2 heads, 32 dims, 32 tokens, fp32).
SLOT_BYTES = 2 * 2 * (2 * 2 * 32 * 32 * 4)
PRIMARY_SLOTS = 4
FS_CHUNKS = 6
#: An fs chunk file: the slot and a 4 KiB trailer block.
FS_FILE_BYTES = SLOT_BYTES + 4096
PROMPTS = 5
#: 200 tokens: three full chunks (the last prompt token is always computed).
PROMPT_CHUNKS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Router:
    """Decodes vLLM's event batches as a KV-aware router does, and replays them."""

    def __init__(self) -> None:
        import zmq

        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        # The router binds, on loopback; vLLM's publisher connects to it.
        self.socket.bind("tcp://127.0.0.1:0")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events: list[KVCacheEvent] = []
        self.seqs: list[int] = []

    def receive(self, wait_ms: int) -> int:
        """Take the batches that arrive within ``wait_ms`` of each other; how many events."""
        import msgspec

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        before = len(self.events)
        while self.socket.poll(wait_ms):
            _topic, seq, payload = self.socket.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(decoder.decode(payload).events)
        return len(self.events) - before

    def of(self, medium: str) -> list[KVCacheEvent]:
        return [e for e in self.events if getattr(e, "medium", None) == medium]

    def held(self, medium: str) -> set[Any]:
        held: set[Any] = set()
        for event in self.of(medium):
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
        return held

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def router() -> Iterator[Router]:
    router = Router()
    yield router
    router.close()


@pytest.mark.slow
def test_a_router_sees_kvtiers_tiers_in_vllms_event_stream(tmp_path: Path, router: Router) -> None:
    """Five prompts through a 4-chunk CPU tier and a 6-chunk fs tier: every
    chunk appears in both tiers with vLLM's own hashes, and what either tier
    evicts is removed again."""
    import random

    from vllm_engine import make_model, post_completions, wait_healthy

    model = make_model(tmp_path / "tiny-llama")
    port = _free_port()
    stats_file = tmp_path / "stats.json"
    kvtier = {
        "chunk_tokens": CHUNK,
        "cpu_bytes_to_use": PRIMARY_SLOTS * SLOT_BYTES,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path / "fs"), "max_bytes": FS_CHUNKS * FS_FILE_BYTES}
        ],
    }
    transfer = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier": kvtier, "kvtier_stats_file": str(stats_file)},
    }
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": router.endpoint}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--api-key", "test-key", "--dtype", "float32", "--block-size", str(SERVER_BLOCK),
        "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
        "--enable-prefix-caching", "--shutdown-timeout", "60",
        "--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(events),
    ]  # fmt: skip
    log = tmp_path / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(4, 1024) for _ in range(199)] for _ in range(PROMPTS)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(process, port, log)

        def ask(prompt: list[int]) -> None:
            post_completions(
                port, "test-key", {"model": str(model), "prompt": prompt, "max_tokens": 1}
            )

        # A batch published before the subscription has reached the publisher
        # is lost (routers ask vLLM's replay endpoint for such gaps): warm up
        # with one-block prompts (no kvtier chunk) until vLLM's events arrive.
        for attempt in range(30):  # another block each time: a cached one is not announced
            warm_up = [1] + [4 + attempt] * 39
            ask(warm_up)
            if router.receive(500):
                break
        assert router.of("GPU"), "no KV events reached the subscriber"
        router.events.clear()
        for prompt in prompts:
            ask(prompt)
            router.receive(200)
        # A secondary tier's stores are announced at the engine step after its
        # write ends: short requests (no full chunk) drive steps until quiet.
        for _ in range(60):
            ask([1, 5, 6])
            if not router.receive(500) and len(router.of("kvtier:fs")) >= PROMPTS * PROMPT_CHUNKS:
                break
    finally:
        process.terminate()
        process.wait(timeout=300)
    router.receive(200)

    # vLLM's own events for the same blocks: hash -> (parent, tokens).
    gpu: dict[Any, tuple[Any, list[int]]] = {}
    for event in router.of("GPU"):
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for index, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[index * SERVER_BLOCK : (index + 1) * SERVER_BLOCK]
                gpu[block_hash] = (parent, tokens)
                parent = block_hash
    chunk_hashes = {
        medium: [e.block_hashes for e in router.of(medium) if isinstance(e, BlockStored)]
        for medium in ("kvtier:cpu", "kvtier:fs")
    }
    # Every prompt chunk, in both tiers, once each.
    for medium, chunks in chunk_hashes.items():
        assert len(chunks) == PROMPTS * PROMPT_CHUNKS, medium
        assert len({tuple(c) for c in chunks}) == len(chunks), medium
    for event in router.of("kvtier:cpu") + router.of("kvtier:fs"):
        if not isinstance(event, BlockStored):
            continue
        assert event.block_size == SERVER_BLOCK and len(event.block_hashes) == CHUNK // SERVER_BLOCK
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            assert block_hash in gpu, "a kvtier block vLLM never announced"
            tokens = event.token_ids[index * SERVER_BLOCK : (index + 1) * SERVER_BLOCK]
            assert gpu[block_hash] == (parent, tokens)
            parent = block_hash
    # The prompts' chunks are their first six blocks: every block vLLM announced.
    for medium, chunks in chunk_hashes.items():
        assert {h for c in chunks for h in c} == set(gpu), medium
    # Evictions came back as removals: the router holds what each tier holds now.
    stats = json.loads(stats_file.read_text())
    primary_chunks = stats["primary"]["idle"] + stats["primary"]["pinned"]
    assert primary_chunks == PRIMARY_SLOTS
    assert len(router.held("kvtier:cpu")) == PRIMARY_SLOTS * CHUNK // SERVER_BLOCK
    assert any(isinstance(e, BlockRemoved) for e in router.of("kvtier:cpu"))
    fs_files = [f for f in (tmp_path / "fs").rglob("*") if f.stat().st_size == FS_FILE_BYTES]
    assert len(fs_files) == FS_CHUNKS
    assert len(router.held("kvtier:fs")) == FS_CHUNKS * CHUNK // SERVER_BLOCK
    assert any(isinstance(e, BlockRemoved) for e in router.of("kvtier:fs"))
    assert stats["kv_events"]["dropped"] == 0


def test_the_cost_benchmark_runs_and_counts_consistently() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_kv_events.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["chunks"] == 50 and result["block_size"] == 16
    # At least the packed token ids (4 bytes each) and one hash per block.
    assert result["bytes_per_chunk"] > 4 * 256 + 8 * 16
    assert result["kvtier_us_per_chunk"] > 0 and result["vllm_us_per_chunk"] > 0
