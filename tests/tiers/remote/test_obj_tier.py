"""The ``obj`` tier against moto's S3 server on loopback, spoken to over HTTP."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import KVCache
from kvtier.config import load_config
from kvtier.errors import BackendUnavailableError, ConfigError, MissingDependencyError
from kvtier.integrity import HEADER_BYTES, frame
from kvtier.testing import TierContractTests, TierHarness, small_layout
from kvtier.testing.outages import recover
from kvtier.tiers.base import Lookup
from kvtier.tiers.obj import ObjectStoreBackend, ObjectStoreTier
from kvtier.tiers.remote import RemoteTier
from tests.support.cache_tiers import backend_of
from tests.support.servers import S3Server, free_port
from tests.tiers.remote.damaged_values import (
    FIELDS,
    Damage,
    assert_no_damaged_value_served,
    flipped,
)
from tests.tiers.remote.outage import on_fake_clock, outage_harness


class TestObjectStoreTierContract(TierContractTests[ObjectStoreTier]):
    persistent = True

    @pytest.fixture(autouse=True)
    def _bucket(self, s3_server: S3Server, s3_bucket: str) -> None:
        self.options = s3_server.tier_options(s3_bucket)

    def make_config(self) -> dict[str, Any]:
        return {"type": "obj", **self.options}


def test_objects_are_named_by_prefix_namespace_and_key(s3_server: S3Server, s3_bucket: str) -> None:
    harness = TierHarness(
        {"type": "obj", **s3_server.tier_options(s3_bucket), "prefix": "team/kv/"},
        small_layout(),
    )
    try:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        listed = s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
        namespace = harness.layout.namespace.hex()
        assert sorted(o["Key"] for o in listed) == sorted(
            f"team/kv/{namespace}/{k.hex()}" for k in keys
        )
        assert {o["Size"] for o in listed} == {HEADER_BYTES + harness.layout.slot_bytes}
    finally:
        harness.close()


def test_the_tier_parses_no_date_and_leaves_other_clients_parsing_them(
    s3_server: S3Server, s3_bucket: str
) -> None:
    harness = TierHarness[ObjectStoreTier](
        {"type": "obj", **s3_server.tier_options(s3_bucket)}, small_layout()
    )
    try:
        keys = harness.keys(1)
        harness.fill([0])
        assert harness.store(keys, [0]).success
        name = harness.tier.store_name(keys[0])
        client = backend_of(harness.tier, ObjectStoreBackend).client
        ours = client.head_object(Bucket=s3_bucket, Key=name)
        # A client made after the tier's, as the engine's own code might make.
        theirs = s3_server.client().head_object(Bucket=s3_bucket, Key=name)
        assert isinstance(ours["LastModified"], str)
        assert isinstance(theirs["LastModified"], datetime.datetime)
        assert harness.load(keys, [1]).success
        assert np.array_equal(harness.buffer.array[1], harness.buffer.array[0])
    finally:
        harness.close()


def test_corrupt_torn_and_foreign_objects_are_never_served(
    s3_server: S3Server, s3_bucket: str
) -> None:
    harness = TierHarness(
        {"type": "obj", **s3_server.tier_options(s3_bucket)},
        small_layout(),
        tier_class=ObjectStoreTier,
    )
    client = s3_server.client()
    try:
        keys = harness.keys(4)
        harness.fill(range(4))
        assert harness.store(keys, [0, 1, 2, 3]).success
        tier = harness.tier
        names = [tier.store_name(k) for k in keys]

        def read(name: str) -> bytes:
            return bytes(client.get_object(Bucket=s3_bucket, Key=name)["Body"].read())

        flipped = bytearray(read(names[0]))
        flipped[-1] ^= 0x80
        client.put_object(Bucket=s3_bucket, Key=names[0], Body=bytes(flipped))
        client.put_object(Bucket=s3_bucket, Key=names[1], Body=read(names[1])[:-4096])
        foreign = small_layout(model_id="another-model")
        client.put_object(
            Bucket=s3_bucket,
            Key=names[2],
            Body=frame(foreign.namespace, keys[2], harness.buffer.array[2].tobytes()),
        )
        harness.buffer.array[8:12] = 7
        result = harness.load(keys, [8, 9, 10, 11])
        assert result.succeeded == frozenset([keys[3]])
        assert (harness.buffer.array[8:11] == 7).all()
        np.testing.assert_array_equal(harness.buffer.array[11], harness.buffer.array[3])
        assert tier.stats.corrupt_chunks == 3
        left = client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        assert [o["Key"] for o in left] == [names[3]]
        assert [harness.lookup(k) for k in keys] == [Lookup.MISS] * 3 + [Lookup.HIT]
    finally:
        harness.close()


def test_missing_bucket_fails_at_start(s3_server: S3Server) -> None:
    with pytest.raises(BackendUnavailableError, match=r"bucket 'no-such-bucket'.*does not exist"):
        TierHarness({"type": "obj", **s3_server.tier_options("no-such-bucket")}, small_layout())


def test_unreachable_endpoint_fails_at_start(s3_server: S3Server) -> None:
    options = {
        **s3_server.tier_options("kv-bucket"),
        "endpoint_url": f"http://127.0.0.1:{free_port()}",
        "retries": 0,
    }
    with pytest.raises(BackendUnavailableError, match="endpoint unreachable"):
        TierHarness({"type": "obj", **options}, small_layout())


def test_endpoint_outage_turns_into_misses_and_recovers(own_s3_server: S3Server) -> None:
    server = own_s3_server
    bucket = server.create_bucket("kv-outage")
    layout = small_layout(chunk_tokens=4)
    entry = {**server.tier_options(bucket), "type": "obj", "retries": 0, "connect_timeout_s": 1.0}
    config = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 16 * layout.slot_bytes,
        "secondary_tiers": [entry],
    }
    tokens = list(range(16))
    data = np.random.default_rng(5).integers(0, 256, (4, layout.slot_bytes), dtype=np.uint8)
    with KVCache(config, layout) as cache:
        tier, clock = on_fake_clock(cache.manager.tiers[0], ObjectStoreTier)
        stats = tier.stats
        server.stop()
        assert cache.store(tokens, data) == 4
        cache.drain()
        assert stats.store_failures == 4
        assert stats.backend_errors >= 1
        cache.manager.reset()
        assert cache.cached_prefix(tokens) == 0
        assert stats.misses >= 1
        server.start()  # same port; moto keeps nothing, so the bucket comes back empty
        server.create_bucket(bucket)
        assert recover(tier, clock)
        assert cache.store(tokens, data) == 4
        cache.drain()
        assert stats.chunks_stored == 4
        cache.manager.reset()
        assert cache.cached_prefix(tokens) == 16
        out = np.zeros_like(data)
        cache.load(tokens, 16, out)
        np.testing.assert_array_equal(out, data)


def test_a_hung_endpoint_times_out_and_recovers(own_s3_server: S3Server) -> None:
    server = own_s3_server
    bucket = server.create_bucket("kv-hung")
    with outage_harness(
        {
            "type": "obj",
            **server.tier_options(bucket),
            "retries": 0,
            "read_timeout_s": 0.5,
        },
        ObjectStoreTier,
    ) as (harness, tier, clock):
        keys = harness.keys(3)
        harness.fill(range(3))
        assert harness.store(keys, [0, 1, 2]).success
        server.pause()
        # Without timeouts these would wait for ever; run_job would give up instead.
        assert not harness.load(keys, [3, 4, 5]).success
        assert harness.lookup(keys[0]) is Lookup.MISS
        assert tier.backend_down
        assert [check.ok for check in tier.health()] == [False]
        assert [m.value for m in tier.metrics() if m.name == "backend_up"] == [0.0]
        server.resume()
        assert recover(tier, clock)
        assert harness.load(keys, [3, 4, 5]).success
        np.testing.assert_array_equal(harness.buffer.array[3:6], harness.buffer.array[0:3])
        assert not harness.tier.backend_down


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "bucket"),
        (
            {"bucket": "kv-bucket", "access_key_id": "a"},
            "both 'access_key_id' and 'secret_access_key'",
        ),
        ({"bucket": "kv-bucket", "session_token": "t"}, "'session_token' needs"),
        ({"bucket": "kv-bucket", "addressing_style": "sideways"}, "addressing_style"),
        ({"bucket": "kv-bucket", "io_threads": 0}, "io_threads"),
        ({"bucket": "kv-bucket", "read_timeout_s": float("inf")}, "read_timeout_s"),
        ({"bucket": "kv-bucket", "connect_timeout_s": 1e300}, "connect_timeout_s"),
        ({"bucket": "kv-bucket", "startup_timeout_s": float("inf")}, "startup_timeout_s"),
        ({"bucket": "kv-bucket", "endpoint": "http://x"}, "did you mean 'endpoint_url'"),
        ({"bucket": "kv-bucket", "region": "us east 1"}, r"region: .*for example us-east-1"),
        ({"bucket": "kv-bucket", "region": "-us-east-1"}, r"region: .*for example us-east-1"),
        ({"bucket": "kv-bucket", "region": "r" * 64}, r"region: .*for example us-east-1"),
        ({"bucket": "kv-bucket", "region": ""}, r"region: .*for example us-east-1"),
    ],
)
def test_bad_options_fail_validation_with_the_path(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_config({"secondary_tiers": [{"type": "obj", **options}]})
    assert "secondary_tiers[0]" in str(caught.value)


def test_credentials_are_secret() -> None:
    config = load_config(
        {
            "secondary_tiers": [
                {
                    "type": "obj",
                    "bucket": "kv-bucket",
                    "access_key_id": "AKIA1",
                    "secret_access_key": "sk",
                }
            ]
        }
    )
    shown = repr(config.secondary_tiers[0].options)
    assert "AKIA1" not in shown and "'sk'" not in shown


def test_missing_client_library_raises_missing_dependency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in ("boto3", "botocore")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(MissingDependencyError, match=r"kvtier\[obj\]"):
        TierHarness({"type": "obj", "bucket": "kv-bucket"}, small_layout())


def test_an_erroring_endpoint_fails_chunks_and_recovers(
    s3_server: S3Server, s3_bucket: str
) -> None:
    with outage_harness({"type": "obj", **s3_server.tier_options(s3_bucket)}, ObjectStoreTier) as (
        harness,
        tier,
        clock,
    ):
        client = s3_server.client()
        keys = harness.keys(3)
        harness.fill(range(3))
        assert harness.store(keys[:2], [0, 1]).success
        for item in client.list_objects_v2(Bucket=s3_bucket)["Contents"]:
            client.delete_object(Bucket=s3_bucket, Key=item["Key"])
        client.delete_bucket(Bucket=s3_bucket)  # every request now answers NoSuchBucket
        assert not harness.store(keys[2:], [2]).success
        assert harness.load(keys[:2], [3, 4]).succeeded == frozenset()
        assert harness.load(keys[:2], [3, 4]).succeeded == frozenset()
        assert harness.tier.backend_down
        client.create_bucket(Bucket=s3_bucket)
        assert recover(tier, clock)
        assert harness.store(keys, [0, 1, 2]).success
        assert harness.load(keys, [3, 4, 5]).success
        np.testing.assert_array_equal(harness.buffer.array[3:6], harness.buffer.array[0:3])
        assert not harness.tier.backend_down
        assert [check.ok for check in harness.tier.health()] == [True]


def test_skip_existing_sends_only_missing_chunks(s3_server: S3Server, s3_bucket: str) -> None:
    harness = TierHarness(
        {"type": "obj", **s3_server.tier_options(s3_bucket), "skip_existing": True},
        small_layout(),
        tier_class=ObjectStoreTier,
    )
    client = s3_server.client()
    try:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys[:1], [0]).success
        held = harness.tier.store_name(keys[0])
        client.put_object(Bucket=s3_bucket, Key=held, Body=b"marker")
        assert harness.store(keys, [0, 1]).success
        body = client.get_object(Bucket=s3_bucket, Key=held)["Body"].read()
        assert body == b"marker"  # held already: not sent again
        assert harness.load(keys[1:], [2]).success
        np.testing.assert_array_equal(harness.buffer.array[2], harness.buffer.array[1])
    finally:
        harness.close()


@pytest.mark.parametrize(
    "url",
    [
        "minio:9000",
        "not a url",
        "http://[::1",
        "ftp://minio:9000",
        "http://",
        "http://h:0",
        "http://minio :9000",  # host names the client library itself refuses
        "http://mïnio:9000",
        "http://my_minio:9000",
        "http://-minio:9000",
        "http://minio:9000\n",
        " http://minio:9000",
    ],
)
def test_a_malformed_endpoint_fails_when_the_config_loads(url: str) -> None:
    layout = small_layout()
    config = {
        "secondary_tiers": [
            {"type": "memory"},
            {"type": "obj", "bucket": "kv", "endpoint_url": url},
        ]
    }
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\]\.endpoint_url: ") as caught:
        KVCache(config, layout)  # before any client library sees it
    assert "write it as http://host:port" in str(caught.value)
    assert repr(url) in str(caught.value)


@pytest.mark.parametrize(
    "url", ["http://minio:9000", "https://s3.example.com", "http://[::1]:9000", "http://10.0.0.1"]
)
def test_well_formed_endpoints_load(url: str) -> None:
    load_config({"secondary_tiers": [{"type": "obj", "bucket": "kv-bucket", "endpoint_url": url}]})


@pytest.mark.parametrize("bucket", ["kv/cache", "kv cache", "kv:cache", "kv\ncache", "kvé-cache"])
def test_a_bucket_name_no_client_accepts_fails_when_the_config_loads(bucket: str) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.bucket: .*for example kv-cache"):
        load_config({"secondary_tiers": [{"type": "obj", "bucket": bucket}]})


def start_cache(tier: dict[str, Any]) -> KVCache:
    """A cache with ``tier`` as its one secondary tier, started as an engine starts it."""
    layout = small_layout()
    config = {
        "chunk_tokens": layout.chunk_tokens,
        "cpu_bytes_to_use": 4 * layout.slot_bytes,
        "secondary_tiers": [tier],
    }
    return KVCache(config, layout)


def test_a_missing_bucket_names_its_entry(s3_server: S3Server) -> None:
    with pytest.raises(BackendUnavailableError, match=r"^secondary_tiers\[0\]: .*does not exist"):
        start_cache({"type": "obj", **s3_server.tier_options("no-such-bucket")})


def test_a_profile_the_aws_configuration_lacks_names_its_entry(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aws_config = tmp_path / "config"
    aws_config.write_text("[profile team-kv]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(aws_config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    options = s3_server.tier_options(s3_bucket)
    del options["access_key_id"], options["secret_access_key"]
    with pytest.raises(
        BackendUnavailableError, match=r"^secondary_tiers\[0\]: tier 'obj': .*team-kv-typo"
    ):
        start_cache({"type": "obj", **options, "profile": "team-kv-typo"})


@pytest.mark.parametrize("region", ["us-east-1", "eu-central-1", "local", "r" * 63])
def test_region_names_botocore_accepts_load(region: str) -> None:
    load_config({"secondary_tiers": [{"type": "obj", "bucket": "kv-bucket", "region": region}]})


def test_a_job_is_split_over_the_workers(s3_server: S3Server, s3_bucket: str) -> None:
    harness = TierHarness(
        {"type": "obj", **s3_server.tier_options(s3_bucket), "io_threads": 4},
        small_layout(),
        tier_class=ObjectStoreTier,
    )
    try:
        tier = harness.tier
        pending = [(key, slot) for slot, key in enumerate(harness.keys(10))]
        batches = tier._split(pending)
        assert [len(b) for b in batches] == [3, 3, 3, 1]
        assert [pair for batch in batches for pair in batch] == pending
    finally:
        harness.close()


def test_an_empty_object_at_a_chunk_name_is_corrupt_not_an_outage(
    s3_server: S3Server, s3_bucket: str
) -> None:
    harness = TierHarness({"type": "obj", **s3_server.tier_options(s3_bucket)}, small_layout())
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    client = s3_server.client()
    try:
        [key] = harness.keys(1)
        name = tier.store_name(key)
        client.put_object(Bucket=s3_bucket, Key=name, Body=b"")
        assert harness.lookup(key) is Lookup.HIT  # a ranged GET of 0 bytes: InvalidRange
        assert not harness.load([key], [1]).success
        assert tier.stats.corrupt_chunks == 1
        assert tier.stats.backend_errors == 0
        assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    finally:
        harness.close()


def test_no_damaged_object_is_ever_served_nor_taken_for_an_outage(
    s3_server: S3Server, s3_bucket: str
) -> None:
    harness = TierHarness(
        {"type": "obj", **s3_server.tier_options(s3_bucket), "breaker_failures": 1},
        small_layout(),
    )
    client = s3_server.client()

    def read(name: str) -> bytes:
        return bytes(client.get_object(Bucket=s3_bucket, Key=name)["Body"].read())

    def replace(spoil: Callable[[str, str], bytes]) -> Damage:
        def damage(name: str, other: str) -> None:
            client.put_object(Bucket=s3_bucket, Key=name, Body=spoil(name, other))

        return damage

    def flip(at: int) -> Damage:
        return replace(lambda name, _other: flipped(read(name), at))

    damages = (
        [flip(at) for at in FIELDS.values()]
        + [
            replace(lambda _name, other: read(other)),  # another chunk's value
            replace(lambda name, _other: read(name) + b"\0"),  # extended by a byte
            replace(lambda name, _other: read(name)[:HEADER_BYTES]),  # header only
            replace(lambda _name, _other: b"KVTC"),  # shorter than a header
        ]
    )

    def present(name: str) -> bool:
        listed = client.list_objects_v2(Bucket=s3_bucket, Prefix=name).get("Contents", [])
        return any(item["Key"] == name for item in listed)

    try:
        assert_no_damaged_value_served(
            harness,
            damages,
            remove=lambda name: client.delete_object(Bucket=s3_bucket, Key=name),
            present=present,
        )
    finally:
        harness.close()
