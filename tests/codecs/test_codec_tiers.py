"""Chunks through a tier's codec: exact codecs keep the tier contract, lossy
chunks are served only to engines that opted into that very codec, and a
damaged, foreign or failing chunk costs that chunk alone."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache, integrity
from kvtier.codecs import CodecStage, codec_config
from kvtier.codecs.quantized import Int8Codec
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.testing import TierContractTests, TierHarness, restore_registries
from kvtier.testing.codec_suite import kv_like
from kvtier.tiers.base import TransferJob
from kvtier.tiers.fs import FilesystemTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.runtime import TierRuntime
from tests.support.cache_tiers import tier_at
from tests.support.servers import RedisServer


class TestMemoryTierLossless(TierContractTests):
    tier_config = {"type": "memory", "max_bytes": "4MiB", "codec": "lossless"}


class TestRedisTierLossless(TierContractTests):
    """Variable-size values, read in place into buffers of the largest size."""

    persistent = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer, key_prefix: str) -> None:
        self.url = redis_server.url
        self.prefix = key_prefix

    def make_config(self) -> dict[str, Any]:
        return {"type": "redis", "url": self.url, "key_prefix": self.prefix, "codec": "lossless"}


LAYOUT = KVLayout("kvtier-codec-engines", 2, 2, 64, "bfloat16", 16)
TOKENS = list(range(1000, 1000 + 4 * LAYOUT.chunk_tokens))


def _kv(chunks: int) -> np.ndarray:
    return np.stack(
        [np.frombuffer(kv_like(LAYOUT, seed), np.uint8) for seed in range(chunks)]
    ).copy()


def _round_trip(codec: Any, chunk: np.ndarray) -> bytes:
    stage = CodecStage(codec_config(codec).build(LAYOUT), LAYOUT)
    buffer = stage.scratch(1)[0]
    length = stage.encode(chunk.data, buffer)
    out = bytearray(LAYOUT.slot_bytes)
    stage.decode(buffer[:length], memoryview(out))
    return bytes(out)


def _engine(root: Path, codec: Any = None) -> KVCache:
    tier: dict[str, Any] = {"type": "fs", "root_dir": str(root), "shared": True}
    if codec is not None:
        tier["codec"] = codec
    config = {"chunk_tokens": LAYOUT.chunk_tokens, "cpu_bytes_to_use": "2MiB"}
    return KVCache({**config, "secondary_tiers": [tier]}, LAYOUT)


def _load_all(engine: KVCache) -> tuple[int, np.ndarray]:
    hit = engine.cached_prefix(TOKENS)
    out = np.zeros((hit // LAYOUT.chunk_tokens, LAYOUT.slot_bytes), np.uint8)
    engine.load(TOKENS, hit, out)
    return hit, out


def test_lossy_chunks_reach_only_engines_with_the_same_opt_in(tmp_path: Path) -> None:
    data = _kv(4)
    with _engine(tmp_path, "fp8") as writer:
        assert writer.store(TOKENS, data) == 4
        writer.drain()
    # A fresh engine without the opt-in, on the same shared root: nothing
    # of the lossy engine's is found, loaded or written into a slot.
    with _engine(tmp_path) as exact:
        hit, _ = _load_all(exact)
        stats = exact.manager.tiers[0].stats
        assert hit == 0 and stats.chunks_loaded == 0 and stats.hits == 0
        assert stats.misses >= 1
    # Another precision is another opt-in: no sharing either.
    with _engine(tmp_path, "int8") as other:
        assert _load_all(other)[0] == 0
    # The same opt-in shares them, decoded into bf16 exactly as fp8 gives them.
    with _engine(tmp_path, "fp8") as reader:
        hit, out = _load_all(reader)
        assert hit == len(TOKENS) and reader.manager.tiers[0].stats.chunks_loaded == 4
        for chunk, loaded in zip(data, out, strict=True):
            assert bytes(loaded) == _round_trip("fp8", chunk)
            assert bytes(loaded) != bytes(chunk)  # lossy indeed
    # And the exact engine's own chunks stay exact beside the lossy ones.
    with _engine(tmp_path) as exact:
        assert exact.store(TOKENS, data) == 4
        exact.drain()
    with _engine(tmp_path) as exact:
        hit, out = _load_all(exact)
        assert hit == len(TOKENS)
        np.testing.assert_array_equal(out, data)


@pytest.fixture
def harness() -> Iterator[TierHarness]:
    harness = TierHarness(
        {"type": "memory", "codec": {"type": "int4", "group_size": 16}}, LAYOUT, num_slots=4
    )
    yield harness
    harness.close()


def _plant(harness: TierHarness, key: ChunkKey, payload: bytes | bytearray | memoryview) -> None:
    """Put a framed value under ``key`` as another writer of the store would."""
    tier = harness.tier
    assert isinstance(tier, MemoryTier)
    with tier.backend._chunks_lock:
        tier.backend._chunks[key] = integrity.frame(tier.namespace, key, memoryview(payload))


#: LAYOUT's chunks as an engine's own pages: the lossy codecs group
#: consecutive elements there, not by token, head and channel.
PAGES = KVLayout("kvtier-codec-engines", 2, 2, 64, "bfloat16", 16, kv_order="engine-pages")


@pytest.mark.parametrize(
    ("codec", "writer", "writer_layout"),
    [
        # An fp8 chunk has the size of an int8 one.
        ("int8", "fp8", LAYOUT),
        # The same int4 codec grouping consecutive elements writes chunks of
        # the size a KIVI-grouped one has: the recorded grouping differs.
        ({"type": "int4", "group_size": 16}, {"type": "int4", "group_size": 16}, PAGES),
    ],
    ids=["int8-read-fp8", "int4-kivi-read-int4-elements"],
)
def test_a_chunk_of_another_codec_is_refused_counted_and_deleted(
    codec: Any, writer: Any, writer_layout: KVLayout
) -> None:
    # Only the codec header tells these chunks apart, in a store another
    # writer put them in under this namespace.
    harness = TierHarness({"type": "memory", "codec": codec}, LAYOUT, num_slots=4)
    try:
        (key,) = harness.keys(1)
        other = CodecStage(codec_config(writer).build(writer_layout), writer_layout)
        buffer = other.scratch(1)[0]
        length = other.encode(memoryview(kv_like(LAYOUT)), buffer)
        assert length == harness.tier.stored_bytes
        _plant(harness, key, buffer[:length])
        harness.buffer.array[0] = 7
        result = harness.load([key], [0])
        stats = harness.tier.stats
        assert not result.success and stats.codec_refused == 1
        assert (harness.buffer.array[0] == 7).all()  # the slot was never written
        assert harness.lookup(key).value == "miss"  # deleted
    finally:
        harness.close()


def test_a_damaged_codec_header_or_wrong_size_is_a_counted_miss(harness: TierHarness) -> None:
    stage = harness.tier.codec_stage
    buffer = stage.scratch(1)[0]
    length = stage.encode(memoryview(kv_like(LAYOUT)), buffer)
    keys = harness.keys(3)
    truncated = bytes(buffer[: length // 2])
    wrong_size = bytearray(buffer[:length])
    wrong_size[24:32] = (LAYOUT.slot_bytes // 2).to_bytes(8, "little")  # decoded bytes field
    no_magic = bytearray(buffer[:length])
    no_magic[:4] = b"XXXX"
    payloads: tuple[bytes | bytearray, ...] = (truncated, wrong_size, no_magic)
    for key, payload in zip(keys, payloads, strict=True):
        _plant(harness, key, payload)
    result = harness.load(keys, [0, 1, 2])
    assert not result.succeeded and harness.tier.stats.corrupt_chunks == 3
    assert all(harness.lookup(key).value == "miss" for key in keys)


class FlakyCodec(Int8Codec):
    """Fails to encode chunks whose first byte is 0xEE; fails every decode
    while :attr:`decoder_broken`."""

    decoder_broken = False

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        if chunk[0] == 0xEE:
            raise RuntimeError("encoder bug")
        return super().encode(chunk, out)

    def decode(self, data: memoryview, out: memoryview) -> None:
        if FlakyCodec.decoder_broken:
            raise RuntimeError("decoder bug")
        super().decode(data, out)


def test_a_codec_that_raises_costs_that_chunk_only(monkeypatch: pytest.MonkeyPatch) -> None:
    with restore_registries():
        from kvtier.codecs import register_codec

        register_codec("flaky", __name__, "FlakyCodec")
        harness = TierHarness({"type": "memory", "codec": "flaky"}, LAYOUT, num_slots=4)
        try:
            keys = harness.keys(3)
            harness.buffer.array[:3] = _kv(3)
            harness.buffer.array[1, 0] = 0xEE
            stored = harness.store(keys, [0, 1, 2])
            assert stored.succeeded == {keys[0], keys[2]}
            assert harness.tier.stats.codec_failures == 1
            assert harness.load([keys[0], keys[2]], [1, 3]).success
            monkeypatch.setattr(FlakyCodec, "decoder_broken", True)
            harness.buffer.array[1] = 9
            loaded = harness.load([keys[0]], [1])
            assert not loaded.success and harness.tier.stats.codec_failures == 2
            assert (harness.buffer.array[1] == 9).all()
            assert harness.lookup(keys[0]).value == "miss"  # deleted
            assert harness.lookup(keys[2]).value == "hit"  # the other chunk stays
        finally:
            harness.close()


def test_fs_stores_fixed_size_encoded_files(tmp_path: Path) -> None:
    data = _kv(2)
    with _engine(tmp_path, "int4") as engine:
        engine.store(TOKENS[: 2 * LAYOUT.chunk_tokens], data)
        engine.drain()
        tier = tier_at(engine, 0, FilesystemTier)
        stats = tier.stats
        assert stats.codec_bytes_in == 2 * LAYOUT.slot_bytes
        assert stats.codec_bytes_out == 2 * tier.stored_bytes
        assert tier.stored_bytes < LAYOUT.slot_bytes
        files = list(tier.dir.path.glob("*/*.kvc"))
        assert len(files) == 2 and all(f.stat().st_size == tier.file_bytes for f in files)
        assert tier.file_bytes < LAYOUT.slot_bytes


def test_fs_stores_lossless_files_at_their_own_size_bounded_and_across_restarts(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from kvtier.cli import cli

    layout = KVLayout("kvtier-codec-engines", 2, 2, 64, "bfloat16", 128)  # 128 KiB chunks
    tokens = list(range(4 * layout.chunk_tokens))
    data = np.stack([np.frombuffer(kv_like(layout, seed), np.uint8) for seed in range(4)])
    tier = {"type": "fs", "root_dir": str(tmp_path), "codec": "lossless", "max_bytes": "4MiB"}
    config = {"chunk_tokens": layout.chunk_tokens, "cpu_bytes_to_use": "2MiB"}
    with KVCache({**config, "secondary_tiers": [tier]}, layout) as engine:
        assert engine.store(tokens, data) == 4
        engine.drain()
        fs = tier_at(engine, 0, FilesystemTier)
        sizes = sorted(f.stat().st_size for f in fs.dir.path.glob("*/*.kvc"))
        assert len(sizes) == 4 and sizes[-1] < layout.slot_bytes < fs.file_bytes
        assert all(size % 4096 == 0 for size in sizes)
        # The bound counts each file at its own size, not at the largest.
        assert fs.held_bytes == sum(sizes)
    with KVCache({**config, "secondary_tiers": [tier]}, layout) as again:
        assert tier_at(again, 0, FilesystemTier).wait_index(30)
        assert again.cached_prefix(tokens) == len(tokens)
        out = np.zeros_like(data)
        again.load(tokens, len(tokens), out)
        np.testing.assert_array_equal(out, data)
    record = json.loads(next(tmp_path.glob("*/NAMESPACE.json")).read_text())
    assert "payload_bytes" not in record["chunk_file"]
    assert record["chunk_file"]["payload_bytes_max"] + 4096 == fs.file_bytes
    verified = CliRunner().invoke(cli, ["inspect", str(tmp_path), "--verify"])
    assert verified.exit_code == 0, verified.output
    assert "all checksums verified" in verified.output


def test_check_bench_and_inspect_show_each_tiers_codec(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvtier.cli import cli

    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "chunk_tokens: 16\nsecondary_tiers:\n"
        f"  - {{type: fs, root_dir: {tmp_path / 'fs'}, codec: int4}}\n"
        "  - {type: memory, codec: lossless}\n"
    )
    wide = {"COLUMNS": "200"}
    checked = CliRunner().invoke(cli, ["check", str(config), "--chunk-kib", "64"], env=wide)
    assert checked.exit_code == 0, checked.output
    assert "as its lossy codec decodes them" in checked.output  # fs, int4
    assert "int4 (lossy) {'group_size': 32, 'grouping': 'kivi'}" in checked.output
    assert "byte-exact" in checked.output  # memory, lossless
    benched = CliRunner().invoke(
        cli, ["bench", str(config), "--chunk-kib", "64", "--chunks", "4", "--json"]
    )
    assert benched.exit_code == 0, benched.output
    report = json.loads(benched.output[benched.output.index("{") :])
    codecs = [entry["codec"] for entry in report["tiers"]]
    assert [c["codec"] for c in codecs] == ["int4", "lossless"]
    assert codecs[0]["ratio"] > 2.5 and codecs[1]["bytes_out"] < codecs[1]["bytes_in"]
    assert all(c["failures"] == 0 for c in codecs)
    assert all(c["decode_mb_per_s"] > 0 and c["pays_below_mb_per_s"] > 0 for c in codecs)
    table = CliRunner().invoke(cli, ["bench", str(config), "--chunk-kib", "64", "--chunks", "4"])
    assert table.exit_code == 0, table.output
    assert "codec int4 decodes" in table.output and "speeds up loads only" in table.output
    with _engine(tmp_path / "fs", "int4") as engine:
        engine.store(TOKENS, _kv(4))
        engine.drain()
    inspected = CliRunner().invoke(cli, ["inspect", str(tmp_path / "fs")], env=wide)
    assert inspected.exit_code == 0, inspected.output
    assert "codec int4 {'group_size': 32, 'grouping': 'kivi'}" in inspected.output


@pytest.fixture(params=["redis", "obj", "mooncake"])
def remote_tier(request: pytest.FixtureRequest, key_prefix: str) -> dict[str, Any]:
    """A remote tier of each kind, on a server of the test's own."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"type": "redis", "url": server.url, "key_prefix": key_prefix}
    if request.param == "obj":
        s3 = request.getfixturevalue("s3_server")
        return {"type": "obj", **s3.tier_options(request.getfixturevalue("s3_bucket"))}
    master = request.getfixturevalue("mooncake_master")
    return {**master.tier_options(key_prefix), "global_segment_size": 0}


def test_remote_tiers_store_fixed_size_lossy_chunks_and_serve_what_the_codec_decodes(
    remote_tier: dict[str, Any],
) -> None:
    harness = TierHarness({**remote_tier, "codec": "int8"}, LAYOUT, num_slots=8)
    try:
        keys = harness.keys(4)
        data = _kv(4)
        harness.buffer.array[:4] = data
        assert harness.store(keys, [0, 1, 2, 3]).success
        assert harness.load(keys, [4, 5, 6, 7]).success
        for chunk, loaded in zip(data, harness.buffer.array[4:8], strict=True):
            assert bytes(loaded) == _round_trip("int8", chunk)
        stats = harness.tier.stats
        assert stats.codec_bytes_out == 4 * harness.tier.stored_bytes < stats.codec_bytes_in
    finally:
        harness.close()


class HangingCodec(Int8Codec):
    """Blocks in :meth:`encode` or :meth:`decode` (whichever :attr:`hang_in`
    names) until :attr:`gate` opens, as a codec with a deadlock would."""

    hang_in = ""
    gate = threading.Event()

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        if HangingCodec.hang_in == "encode":
            HangingCodec.gate.wait()
        return super().encode(chunk, out)

    def decode(self, data: memoryview, out: memoryview) -> None:
        if HangingCodec.hang_in == "decode":
            HangingCodec.gate.wait()
            out[:] = bytes(len(out))  # a late decode still writes: never into a slot
        super().decode(data, out)


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition`` (a hang guard, not a speed check)."""
    give_up = time.monotonic() + 30
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"still waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["memory", "fs"])
def test_a_codec_that_hangs_costs_one_bounded_wait_and_a_miss(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier: dict[str, Any] = {"type": kind, "codec": "hanging", "codec_timeout_s": 0.2}
    if kind == "fs":
        tier["root_dir"] = str(tmp_path)
    with restore_registries():
        from kvtier.codecs import register_codec

        register_codec("hanging", __name__, "HangingCodec")
        harness = TierHarness(tier, LAYOUT, num_slots=8, tier_class=TierRuntime)
    calls: Any = harness.tier.codec_calls
    try:
        keys = harness.keys(3)
        harness.buffer.array[:3] = _kv(3)
        # An encode that never returns: the store fails, nothing is stored.
        monkeypatch.setattr(HangingCodec, "gate", threading.Event())
        monkeypatch.setattr(HangingCodec, "hang_in", "encode")
        stored = harness.store(keys, [0, 1, 2])
        stats = harness.tier.stats
        assert stored.succeeded == frozenset() and stats.codec_timeouts >= 1
        assert stats.codec_failures >= stats.codec_timeouts
        assert harness.lookup(keys[0]).value == "miss"
        # Once it returns, the codec serves again.
        HangingCodec.gate.set()
        _until(lambda: calls.overdue == 0, "the hung encode to return")
        monkeypatch.setattr(HangingCodec, "hang_in", "")
        assert harness.store(keys, [0, 1, 2]).success
        # A decode that never returns: a miss, the slot never written, the
        # chunk kept (it is not damaged), even after the decode ends late.
        monkeypatch.setattr(HangingCodec, "gate", threading.Event())
        monkeypatch.setattr(HangingCodec, "hang_in", "decode")
        timeouts = stats.codec_timeouts
        harness.buffer.array[4] = 0x77
        loaded = harness.load([keys[0]], [4])
        assert not loaded.success and stats.codec_timeouts == timeouts + 1
        HangingCodec.gate.set()
        _until(lambda: calls.overdue == 0, "the hung decode to return")
        assert (harness.buffer.array[4] == 0x77).all()
        assert harness.lookup(keys[0]).value == "hit"
        monkeypatch.setattr(HangingCodec, "hang_in", "")
        assert harness.load([keys[0]], [4]).success
        assert bytes(harness.buffer.array[4]) == _round_trip("int8", harness.buffer.array[0])
    finally:
        HangingCodec.gate.set()
        harness.close()


def test_only_codecs_that_may_hang_pay_for_a_bounded_wait() -> None:
    """kvtier's own codecs run on the worker itself; another codec (even one
    built on theirs) is bounded, and ``codec_timeout_s`` bounds any."""
    with restore_registries():
        from kvtier.codecs import register_codec

        register_codec("hanging", __name__, "HangingCodec")
        cases = [("int8", None, False), ("hanging", None, True), ("lossless", 1.0, True)]
        for codec, timeout, bounded in cases:
            tier: dict[str, Any] = {"type": "memory", "codec": codec}
            if timeout is not None:
                tier["codec_timeout_s"] = timeout
            harness = TierHarness(tier, LAYOUT, num_slots=2, tier_class=TierRuntime)
            try:
                calls = harness.tier.codec_calls
                assert (calls is not None) == bounded, codec
                if calls is not None:  # the tier's own bound: 5 s on memory unless set
                    assert calls.timeout_s == (timeout or 5.0)
            finally:
                harness.close()


def test_a_tier_shuts_down_while_its_codec_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    with restore_registries():
        from kvtier.codecs import register_codec

        register_codec("hanging", __name__, "HangingCodec")
        harness = TierHarness(
            {"type": "memory", "codec": "hanging", "codec_timeout_s": 0.2}, LAYOUT, num_slots=2
        )
    monkeypatch.setattr(HangingCodec, "gate", threading.Event())
    monkeypatch.setattr(HangingCodec, "hang_in", "encode")
    try:
        harness.buffer.array[:1] = _kv(1)
        harness.submit_store(TransferJob(tuple(harness.keys(1)), (0,)))
        harness.shutdown()  # under the harness's hang guard
        [result] = harness.finished_jobs()
        assert not result.success and harness.tier.stats.codec_timeouts == 1
    finally:
        HangingCodec.gate.set()
        harness.close()
