"""kvtier's tiers inside vLLM's own tiering, through vLLM's machinery: a real
``TieringOffloadingSpec``, its factory loading the adapter by ``module_path``,
and the manager calls vLLM's offloading connector makes."""

from __future__ import annotations

import dataclasses
import glob
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

pytestmark = pytest.mark.slow

from tests.support.servers import MooncakeMaster, RedisServer, S3Server  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
)
from vllm_tiering import (  # noqa: E402
    ROW_BYTES,
    Engine,
    bf16_values,
    float_payload,
    offload_keys,
    payload,
    tiering_config,
)

from kvtier.errors import BackendUnavailableError, ConfigError  # noqa: E402
from kvtier.integrations.vllm.tiering import tiering_layout  # noqa: E402
from kvtier.testing import stored  # noqa: E402
from kvtier.tiers.remote import RemoteTier  # noqa: E402

TierFactory = Callable[[], dict[str, Any]]


def tier_factory(kind: str, request: pytest.FixtureRequest, root: str) -> TierFactory:
    """A factory of one kvtier tier's configuration (the same backend each time)."""
    if kind == "memory":
        return lambda: {"type": "memory", "max_bytes": 64 * ROW_BYTES}
    if kind == "fs":
        return lambda: {"type": "fs", "root_dir": root}
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        prefix = f"t{uuid.uuid4().hex[:10]}:"
        return lambda: {"type": "redis", "url": server.url, "key_prefix": prefix}
    if kind == "mooncake":
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        # Chunks live in the master's storage process: they outlive each engine.
        options = master.tier_options(f"t{uuid.uuid4().hex[:10]}:") | {"global_segment_size": 0}
        return lambda: dict(options)
    s3: S3Server = request.getfixturevalue("s3_server")
    bucket = s3.create_bucket(f"kvtier-{uuid.uuid4().hex[:16]}")
    return lambda: s3.tier_options(bucket) | {"type": "obj"}


@pytest.fixture(params=["memory", "fs", "redis", "obj", "mooncake"])
def tier(request: pytest.FixtureRequest, tmp_path: Any) -> TierFactory:
    return tier_factory(request.param, request, str(tmp_path / "kv"))


@pytest.fixture(params=["fs", "redis", "obj", "mooncake"])
def stored_tier(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, TierFactory]:
    """A tier whose chunks outlive the engine and that another engine can reach
    (a memory tier's live and die with its process)."""
    return request.param, tier_factory(request.param, request, str(tmp_path / "kv"))


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(tier: dict[str, Any], **config: Any) -> Engine:
        engine = Engine(tier, **config)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()


def assert_exact(loaded: dict[OffloadKey, np.ndarray]) -> None:
    for key, data in loaded.items():
        assert np.array_equal(data, payload(key)), "a loaded chunk differs from what was stored"


def test_loads_byte_exact_from_the_tier(tier: TierFactory, engines: Callable[..., Engine]) -> None:
    engine = engines(tier())
    keys = offload_keys(4)
    engine.store(keys)
    engine.evict_primary()
    loaded = engine.load(keys)
    assert list(loaded) == keys
    assert_exact(loaded)
    assert engine.adapter.tier.stats.chunks_loaded >= 4


def test_a_restarted_engine_finds_the_chunks(
    stored_tier: tuple[str, TierFactory], engines: Callable[..., Engine]
) -> None:
    _, tier = stored_tier
    first = engines(tier())
    keys = offload_keys(5)
    first.store(keys)
    first.close()
    loaded = engines(tier()).load(keys)
    assert list(loaded) == keys
    assert_exact(loaded)


def test_another_model_finds_nothing(
    stored_tier: tuple[str, TierFactory], engines: Callable[..., Engine]
) -> None:
    _, tier = stored_tier
    keys = offload_keys(3)
    engines(tier()).store(keys)
    assert engines(tier(), model="kvtier-test/other-model").load(keys) == {}
    assert engines(tier(), tp_size=2).load(keys) == {}
    assert list(engines(tier()).load(keys)) == keys


def spoil(engine: Engine, key: OffloadKey) -> None:
    """Flip one payload byte of ``key``'s stored chunk, in the backend itself."""
    tier, own = engine.adapter.tier, engine.adapter.chunk_key(key)
    value = bytearray(stored.read_stored(tier, own))
    value[stored.payload_offset(tier) + 100] ^= 0x40
    stored.write_stored(tier, own, bytes(value))


def test_a_corrupt_chunk_is_a_miss_never_wrong_bytes(
    stored_tier: tuple[str, TierFactory], engines: Callable[..., Engine]
) -> None:
    _, tier = stored_tier
    keys = offload_keys(4)
    engines(tier()).store(keys)
    engine = engines(tier(), events=True, options={"enable_kv_events": True})
    spoil(engine, keys[1])
    loaded = engine.load(keys)
    # The promotion keeps what was sound (vLLM's partial success) and the
    # request stops at the corrupt chunk: chunk 0 served, chunk 1 a miss.
    assert list(loaded) == keys[:1]
    assert_exact(loaded)
    assert engine.adapter.tier.stats.corrupt_chunks == 1
    # Deleted, counted, and from now on a plain miss; the chunks after it were
    # promoted whole and are served from the primary tier.
    assert engine.load(keys[1:2]) == {}
    assert list(engine.load(keys[2:])) == keys[2:]
    assert_exact(engine.load(keys[2:]))


def test_partial_success_keeps_the_sound_chunks(
    engines: Callable[..., Engine], tmp_path: Any
) -> None:
    root = str(tmp_path / "kv")
    keys = offload_keys(3)
    engines({"type": "fs", "root_dir": root}).store(keys)
    engine = engines({"type": "fs", "root_dir": root})
    spoil(engine, keys[1])
    loaded = engine.load(keys)
    assert list(loaded) == keys[:1]
    # The third chunk came back with the first: it is in the primary tier now.
    assert list(engine.load(keys[2:])) == keys[2:]
    assert engine.adapter.tier.stats.chunks_loaded == 2


def test_events_announce_stores_and_removals(tmp_path: Any, engines: Callable[..., Engine]) -> None:
    root = str(tmp_path / "kv")
    engine = engines(
        {"type": "fs", "root_dir": root},
        events=True,
        options={"enable_kv_events": True, "locality": "LOCAL"},
    )
    keys = offload_keys(3)
    engine.store(keys)
    mine = [e for e in engine.events if e.medium is Medium.STORAGE]
    assert [sorted(e.keys) for e in mine if not e.removed] == [sorted(keys)]
    assert all(e.locality is Locality.LOCAL for e in mine)
    # A chunk removed behind the tier's back is announced removed once found gone.
    for path in glob.glob(f"{root}/**/{engine.adapter.chunk_key(keys[0]).hex()}*", recursive=True):
        os.unlink(path)
    engine.evict_primary()
    engine.events.clear()
    engine.load(keys)
    removed = [e for e in engine.events if e.removed and e.medium is Medium.STORAGE]
    assert [list(e.keys) for e in removed] == [[keys[0]]]


def test_events_stay_off_unless_vllm_publishes_them(
    tmp_path: Any, engines: Callable[..., Engine]
) -> None:
    engine = engines({"type": "fs", "root_dir": str(tmp_path)}, options={"enable_kv_events": True})
    engine.store(offload_keys(2))
    assert [e for e in engine.events if e.medium is Medium.STORAGE] == []


def test_memory_tier_is_a_cpu_medium(engines: Callable[..., Engine]) -> None:
    engine = engines({"type": "memory"}, events=True, options={"enable_kv_events": True})
    keys = offload_keys(2)
    engine.store(keys)
    assert engine.adapter.medium is Medium.CPU
    # Unset, the locality is unknown, as with vLLM's own tiers.
    mine = [e for e in engine.events if e.medium is Medium.CPU and e.locality is None]
    assert any(sorted(e.keys) == sorted(keys) for e in mine)


def test_metrics_reach_vllms_stats(tmp_path: Any, engines: Callable[..., Engine]) -> None:
    engine = engines({"type": "fs", "root_dir": str(tmp_path)})
    engine.store(offload_keys(3))
    stats = engine.manager.get_stats()
    assert stats is not None
    reduced = stats.data["data"]["kvtier:tier_chunks_stored"]
    assert reduced == {("secondary_tiers[0]:fs",): 3}
    # Deltas: nothing new, nothing reported twice.
    again = engine.manager.get_stats()
    assert again is None or "kvtier:tier_chunks_stored" not in again.data["data"]


def test_a_redis_outage_costs_misses_never_a_crash(
    own_redis_server: RedisServer, engines: Callable[..., Engine]
) -> None:
    tier = {"type": "redis", "url": own_redis_server.url, "deadline_s": 0.5}
    engine = engines(tier)
    keys = offload_keys(3)
    engine.store(keys)
    engine.evict_primary()
    own_redis_server.stop()
    assert engine.load(keys) == {}
    engine.store(offload_keys(2, tag=b"during the outage"))  # fails, counted, no crash
    stats = engine.adapter.tier.stats
    assert stats.store_failures > 0


@pytest.mark.parametrize("kind", ["redis", "obj"])
def test_a_miss_stays_a_miss_for_the_rest_of_the_request(
    kind: str, request: pytest.FixtureRequest, tmp_path: Any, engines: Callable[..., Engine]
) -> None:
    # A remote tier checks a key it does not know: RETRY, then MISS. vLLM
    # asks about a request's keys again at every step until it schedules it;
    # asked again, the check's answer is gone, and without the request's
    # verdict kept the tier would check once more and answer RETRY: another
    # step for the request, another request to the backend.
    engine = engines(tier_factory(kind, request, str(tmp_path / "kv"))())
    missing = offload_keys(1, tag=b"never stored")[0]
    ctx = ReqContext(req_id="r")
    engine.manager.on_new_request(ctx)
    answers = []
    deadline = time.monotonic() + 60
    while LookupResult.MISS not in answers:
        assert time.monotonic() < deadline, "the check never answered"
        answers.append(engine.adapter.lookup(missing, ctx))
        engine.step()
        time.sleep(0.002)
    checks = engine.adapter.tier.stats.lookups
    for _ in range(5):
        engine.step()
        assert engine.adapter.lookup(missing, ctx) is LookupResult.MISS
    assert engine.adapter.tier.stats.lookups == checks  # the tier was not asked again
    assert engine.adapter.tier.stats.misses == 1
    engine.manager.on_request_finished(ctx)
    # Another request asks the tier again: the tier's recent MISS answers it,
    # and once that is older than the tier keeps one, a new check (RETRY).
    for req_id, answer in (("r2", LookupResult.MISS), ("r3", LookupResult.RETRY)):
        again = ReqContext(req_id=req_id)
        engine.manager.on_new_request(again)
        assert engine.adapter.lookup(missing, again) is answer
        cast(RemoteTier, engine.adapter.tier).checks.miss_answer_s = 0.0
    assert engine.adapter.tier.stats.lookups == checks + 2


def test_a_malformed_job_result_fails_its_job_never_the_engine(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines({"type": "memory"})
    keys = offload_keys(2)
    engine.store(keys)
    engine.evict_primary()
    tier = engine.adapter.tier
    reported = tier.get_finished_jobs
    monkeypatch.setattr(
        tier,
        "get_finished_jobs",
        # Malformed on purpose: a byte count that is no int.
        lambda: [dataclasses.replace(result, nbytes="many") for result in reported()],  # type: ignore[arg-type]
    )
    failures = tier.stats.load_failures
    assert engine.load(keys) == {}  # a miss, recomputed
    # The first chunk's promotion failed; the request asks for nothing after it.
    assert tier.stats.load_failures == failures + 1 and tier.stats.chunks_loaded == 0


@pytest.mark.parametrize(
    ("entry", "path", "says"),
    [
        ({"type": "fss", "root_dir": "/tmp"}, "secondary_tiers[0].tier.type", "'fss'"),
        ({"type": "fs", "root_dri": "/tmp"}, "secondary_tiers[0].tier.root_dri", "root_dir"),
        ({"type": "memory", "max_bytes": "lots"}, "secondary_tiers[0].tier.max_bytes", ""),
        ({"root_dir": "/tmp"}, "secondary_tiers[0].tier.type", "required"),
        ({"type": "p2p", "secret": "s" * 32}, "secondary_tiers[0].tier.type", "p2p"),
    ],
)
def test_a_bad_tier_fails_at_get_manager_naming_its_path(
    entry: dict[str, Any], path: str, says: str
) -> None:
    with pytest.raises(ConfigError) as failure:
        Engine(entry)
    assert f"{path}:" in str(failure.value)
    assert says in str(failure.value)


def test_a_bad_entry_option_fails_naming_its_path() -> None:
    typo = r"secondary_tiers\[0\]\.enable_kv_event: .*enable_kv_events"
    with pytest.raises(ConfigError, match=typo):
        Engine({"type": "memory"}, options={"enable_kv_event": True})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.tier: "):
        Engine("fs")  # type: ignore[arg-type]


def test_an_unreachable_backend_is_refused_at_start(s3_server: S3Server) -> None:
    tier = s3_server.tier_options("kvtier-no-such-bucket") | {"type": "obj"}
    with pytest.raises(BackendUnavailableError, match=r"secondary_tiers\[0\]\.tier"):
        Engine(tier)


def test_the_namespace_follows_what_changes_the_bytes() -> None:
    def namespace(**config: Any) -> bytes:
        return tiering_layout(tiering_config({}, **config), ROW_BYTES).namespace

    base = namespace()
    assert namespace() == base
    assert namespace(model="kvtier-test/other") != base
    assert namespace(tp_size=2) != base
    # Bytes vLLM declares parallelism-agnostic are shared across layouts.
    assert namespace(tp_size=2, agnostic=True) == namespace(agnostic=True)
    assert tiering_layout(tiering_config({}), ROW_BYTES, model_id="v2").namespace != base
    # Rows read as float KV are another record than opaque rows of the same engine.
    assert namespace(agnostic=True, dtype="float16") != namespace(agnostic=True)


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"agnostic": True}, "bfloat16"),
        ({"agnostic": True, "dtype": "float32"}, "float32"),
        ({"agnostic": False}, "uint8"),
        ({"agnostic": True, "dtype": "fp8"}, "uint8"),
    ],
)
def test_rows_are_float_kv_only_where_vllm_certifies_them(
    config: dict[str, Any], dtype: str
) -> None:
    layout = tiering_layout(tiering_config({}, **config), ROW_BYTES)
    assert layout.dtype == dtype
    assert layout.slot_bytes == ROW_BYTES


def test_an_int8_tier_loads_rows_within_the_codecs_bound(
    tmp_path: Any, engines: Callable[..., Engine]
) -> None:
    tier = {"type": "fs", "root_dir": str(tmp_path / "kv"), "codec": "int8"}
    engine = engines(tier, agnostic=True)
    keys = offload_keys(3, tag=b"int8")
    engine.store(keys, float_payload)
    engine.evict_primary()
    loaded = engine.load(keys)
    assert list(loaded) == keys
    for key, row in loaded.items():
        exact, decoded = bf16_values(float_payload(key)), bf16_values(row)
        # Half a step of each 64-element group's scale, then bf16's rounding.
        step = np.repeat(np.abs(exact).reshape(-1, 64).max(axis=1) / 127, 64)
        assert np.all(np.abs(decoded - exact) <= step / 2 * 1.01 + np.abs(exact) / 256)
        assert not np.array_equal(row, float_payload(key)), "the chunk was stored exactly"
    assert engine.adapter.tier.stats.chunks_loaded >= 3


def test_an_engine_without_the_opt_in_never_loads_lossy_rows(
    tmp_path: Any, engines: Callable[..., Engine]
) -> None:
    root = str(tmp_path / "kv")
    keys = offload_keys(3, tag=b"lossy")
    engines({"type": "fs", "root_dir": root, "codec": "int8"}, agnostic=True).store(
        keys, float_payload
    )
    for codec in ("none", "lossless"):
        exact = engines({"type": "fs", "root_dir": root, "codec": codec}, agnostic=True)
        assert exact.load(keys) == {}
        assert exact.adapter.tier.stats.chunks_loaded == 0
    # The same opt-in shares them.
    again = engines({"type": "fs", "root_dir": root, "codec": "int8"}, agnostic=True)
    assert list(again.load(keys)) == keys


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"agnostic": True, "dtype": "fp8"}, "vLLM's offload rows of a fp8 KV cache"),
        ({"agnostic": False}, "elements whose type kvtier cannot tell"),
    ],
)
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_a_lossy_codec_on_rows_kvtier_cannot_read_is_refused_with_the_reason(
    config: dict[str, Any], says: str, codec: str
) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.tier\.codec: ") as failure:
        Engine({"type": "memory", "codec": codec}, **config)
    assert says in str(failure.value)
    assert "already quantised" not in str(failure.value)


def test_vllms_backpressure_detector_reaches_the_tier(
    tmp_path: Any, engines: Callable[..., Engine]
) -> None:
    backpressure = {"backpressure_cls": "EMABackpressureDetector"}
    engine = engines(
        {"type": "fs", "root_dir": str(tmp_path)}, options={"backpressure": backpressure}
    )
    assert engine.adapter.bp_detector is not None
    keys = offload_keys(3)
    engine.store(keys)
    engine.evict_primary()
    assert list(engine.load(keys)) == keys


def test_the_tiers_own_evictions_are_announced_as_removals(
    tmp_path: Any, engines: Callable[..., Engine]
) -> None:
    # Room for about three chunk files: the second three evict the first.
    tier = {"type": "fs", "root_dir": str(tmp_path), "max_bytes": 3 * ROW_BYTES + 3 * 8192}
    engine = engines(tier, events=True, options={"enable_kv_events": True})
    first, second = offload_keys(3), offload_keys(3, start=3)
    engine.store(first)
    engine.store(second)
    engine.step()
    removed = {k for e in engine.events if e.removed and e.medium is Medium.STORAGE for k in e.keys}
    stored = {
        k for e in engine.events if not e.removed and e.medium is Medium.STORAGE for k in e.keys
    }
    assert stored == set(first) | set(second)
    assert removed and removed <= set(first)
    # What is announced as held is what the tier holds.
    held = stored - removed
    assert engine.adapter.tier.stats.evictions == len(removed)
    assert set(engine.load(second)) == set(second) & held
