"""Configuration validation: every problem, by path, all at once."""

import json
from pathlib import Path

import pytest

from kvtier import ConfigError, KVCache, load_config
from kvtier.testing import small_layout
from kvtier.tiers.fs import FilesystemTierOptions
from kvtier.tiers.memory import MemoryTierOptions

OOT = "kvtier_testplugin.tiers"


def problems(document: object) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(document)  # type: ignore[arg-type]
    return dict(info.value.problems)


def test_defaults_are_valid() -> None:
    config = load_config(None)
    assert config.chunk_tokens == 256 and config.eviction_policy == "leaf-lru"
    assert config.secondary_tiers == ()


def test_sizes_accept_binary_units() -> None:
    config = load_config(
        {"cpu_bytes_to_use": "8GiB", "secondary_tiers": [{"type": "memory", "max_bytes": "3MiB"}]}
    )
    assert int(config.cpu_bytes_to_use) == 8 * 2**30
    options = config.secondary_tiers[0].options
    assert isinstance(options, MemoryTierOptions)
    assert options.max_bytes == 3 * 2**20


def test_unknown_top_level_key_suggests_the_nearest() -> None:
    found = problems({"evction_policy": "lru"})
    assert "did you mean 'eviction_policy'?" in found["evction_policy"]


def test_unknown_tier_option_is_named_by_path_with_a_suggestion() -> None:
    found = problems(
        {"secondary_tiers": [{"type": "memory"}, {"type": "memory", "max_byts": "1MiB"}]}
    )
    assert list(found) == ["secondary_tiers[1].max_byts"]
    assert "did you mean 'max_bytes'?" in found["secondary_tiers[1].max_byts"]


def test_nested_section_typo_is_named_by_path() -> None:
    found = problems({"backpressure": {"max_inflight_store": 3}})
    assert "did you mean 'max_inflight_stores'?" in found["backpressure.max_inflight_store"]


def test_wrong_types_and_impossible_sizes() -> None:
    found = problems(
        {
            "chunk_tokens": "many",
            "cpu_bytes_to_use": "8XB",
            "secondary_tiers": [{"type": "memory", "max_bytes": 0, "io_threads": "two"}],
        }
    )
    assert set(found) == {
        "chunk_tokens",
        "cpu_bytes_to_use",
        "secondary_tiers[0].max_bytes",
        "secondary_tiers[0].io_threads",
    }
    assert "'many'" in found["chunk_tokens"]
    assert "XB" in found["cpu_bytes_to_use"]
    assert "greater than 0" in found["secondary_tiers[0].max_bytes"]


def test_negative_and_zero_values_are_refused() -> None:
    found = problems({"chunk_tokens": 0, "cpu_bytes_to_use": -1})
    assert set(found) == {"chunk_tokens", "cpu_bytes_to_use"}


def test_a_boolean_is_not_a_number_anywhere() -> None:
    found = problems(
        {
            "chunk_tokens": True,
            "cpu_bytes_to_use": False,
            "metrics": {"port": True},
            "backpressure": {"smoothing": True},
            "secondary_tiers": [
                {"type": "fs", "root_dir": "/tmp/kvtier-unused", "io_threads": True},
                {"type": "redis", "url": "redis://127.0.0.1:1", "deadline_s": True},
                {
                    "type": "memory",
                    "max_bytes": "1MiB",
                    "codec": {"type": "lossless", "level": True},
                },
                {"type": "OutOfTreeTier", "module_path": OOT, "weight": True},
            ],
        }
    )
    assert set(found) == {
        "chunk_tokens",
        "cpu_bytes_to_use",
        "metrics.port",
        "backpressure.smoothing",
        "secondary_tiers[0].io_threads",
        "secondary_tiers[1].deadline_s",
        "secondary_tiers[2].codec.level",
        "secondary_tiers[3].weight",
    }
    assert all("expected a number, not a boolean" in problem for problem in found.values())


@pytest.mark.parametrize(
    ("backpressure", "low", "high"),
    [({"high_latency_s": 0.1, "low_latency_s": 5}, 5.0, 0.1), ({"high_latency_s": 0.3}, 0.5, 0.3)],
)
def test_backpressure_recovers_below_where_it_is_pressured(
    backpressure: dict[str, float], low: float, high: float
) -> None:
    found = problems({"backpressure": backpressure})
    assert f"low_latency_s ({low}) is above high_latency_s ({high})" in found["backpressure"]
    assert load_config({"backpressure": {"high_latency_s": 1, "low_latency_s": 1}})


def test_yaml_yes_is_refused_where_a_number_goes_and_kept_where_a_switch_does(
    tmp_path: Path,
) -> None:
    document = tmp_path / "kvtier.yaml"
    document.write_text("chunk_tokens: yes\n")  # YAML 1.1 reads yes as true: one-token chunks
    assert "not a boolean" in problems(document)["chunk_tokens"]
    document.write_text(
        "populate_primary: no\nmetrics: {global_registry: on}\n"
        "secondary_tiers:\n"
        "  - {type: fs, root_dir: /tmp/kvtier-unused, io_threads: 3, fsync: yes}\n"
    )
    config = load_config(document)
    assert config.populate_primary is False and config.metrics.global_registry is True
    options = config.secondary_tiers[0].options
    assert isinstance(options, FilesystemTierOptions)
    assert options.fsync is True
    assert options.io_threads == 3


def test_tier_entries_need_a_type_and_a_known_name() -> None:
    found = problems({"secondary_tiers": [{"root_dir": "/x"}, {"type": "nope"}, "fs", {"type": 3}]})
    assert "required" in found["secondary_tiers[0].type"]
    assert "also set 'module_path'" in found["secondary_tiers[1].type"]
    assert "expected a mapping" in found["secondary_tiers[2]"]
    assert "secondary_tiers[3].type" in found


def test_secondary_tiers_must_be_a_list_and_the_document_a_mapping() -> None:
    assert "expected a list" in problems({"secondary_tiers": {"type": "memory"}})["secondary_tiers"]
    assert "expected a mapping" in problems([1, 2])[""]


def test_out_of_tree_tier_options_are_validated_too() -> None:
    found = problems(
        {"secondary_tiers": [{"type": "OutOfTreeTier", "module_path": OOT, "weight": 0}]}
    )
    assert "greater than or equal to 1" in found["secondary_tiers[0].weight"]
    config = load_config(
        {"secondary_tiers": [{"type": "OutOfTreeTier", "module_path": OOT, "label": "a"}]}
    )
    tier = config.secondary_tiers[0]
    assert tier.tier_class.__name__ == "OutOfTreeTier"
    assert tier.as_dict() == {"type": "OutOfTreeTier", "module_path": OOT, "label": "a"}


def test_unloadable_plugins_are_config_problems() -> None:
    found = problems(
        {
            "eviction_policy": "mru",
            "spec_name": "X",
            "spec_module_path": "no.such.module",
            "secondary_tiers": [{"type": "NotATier", "module_path": OOT}],
        }
    )
    assert "also set 'cache_policy_module_path'" in found["eviction_policy"]
    assert "cannot import module 'no.such.module'" in found["spec_name"]
    assert "not a subclass" in found["secondary_tiers[0].type"]


def test_every_problem_is_reported_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"chunk_tokens": -1, "bogus": 1, "secondary_tiers": [{"type": "nope"}]})
    assert len(info.value.problems) == 3
    text = str(info.value)
    assert "chunk_tokens" in text and "bogus" in text and "secondary_tiers[0].type" in text


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_config({"chunk_tokens": "x"})


def test_yaml_and_json_files(tmp_path: Path) -> None:
    yaml_file = tmp_path / "kvtier.yaml"
    yaml_file.write_text(
        "chunk_tokens: 64\nsecondary_tiers:\n  - {type: memory, max_bytes: 1MiB}\n"
    )
    assert load_config(yaml_file).chunk_tokens == 64
    json_file = tmp_path / "kvtier.json"
    json_file.write_text(json.dumps({"chunk_tokens": 32, "cpu_bytes_to_use": "1GiB"}))
    assert load_config(str(json_file)).chunk_tokens == 32


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("chunk_tokens: [1,\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml"):
        load_config(broken)
    typo = tmp_path / "typo.json"
    typo.write_text('{"chunk_tokns": 3}')
    with pytest.raises(ConfigError) as info:
        load_config(typo)
    assert str(typo) in str(info.value) and "chunk_tokens" in str(info.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_a_bad_entry_fails_before_any_tier_starts() -> None:
    # The first tier is valid; building it would start worker threads. The
    # second is not: nothing may start.
    import threading

    before = threading.active_count()
    with pytest.raises(ConfigError):
        KVCache(
            {
                "chunk_tokens": 16,
                "secondary_tiers": [{"type": "memory"}, {"type": "memory", "x": 1}],
            },
            small_layout(),
        )
    assert threading.active_count() == before


def test_primary_tier_too_small_for_one_chunk() -> None:
    layout = small_layout()
    with pytest.raises(ConfigError, match="cannot hold one"):
        KVCache({"chunk_tokens": 16, "cpu_bytes_to_use": layout.slot_bytes - 1}, layout)


def test_layout_and_config_must_agree_on_chunk_tokens() -> None:
    from kvtier import LayoutMismatchError

    with pytest.raises(LayoutMismatchError, match="chunk_tokens"):
        KVCache({"chunk_tokens": 32}, small_layout(chunk_tokens=16))


@pytest.mark.parametrize(
    "entry",
    [
        # Each fails a check of the whole entry, which reports the entry as its input.
        {
            "type": "p2p",
            "secret": "hunter2-hunter2-hunter2-hunter2",
            "listen": "127.0.0.1:0",
            "max_handshakes": 4,
            "max_handshakes_per_source": 8,
        },
        {"type": "redis", "url": "redis://h:1", "password": "hunter2", "startup_nodes": ["h:1"]},
        {"type": "redis", "url": "redis://u:hunter2@h:1", "io_threads": 8, "max_connections": 4},
        {
            "type": "obj",
            "bucket": "kv-bucket",
            "access_key_id": "AKIA",
            "secret_access_key": "hunter2",
            "profile": "default",
        },
    ],
)
def test_an_invalid_entry_never_shows_its_secrets(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"secondary_tiers": [entry]})
    assert "secondary_tiers[0]" in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"type": "fs", "root_dir": "{tmp}/kv"}, {"type": "fs", "root_dir": "{tmp}/kv/"}),
        ({"type": "fs", "root_dir": "{tmp}/kv"}, {"type": "fs", "root_dir": "{tmp}/x/../kv"}),
        ({"type": "fs", "root_dir": "{tmp}/kv"}, {"type": "fs", "root_dir": "{tmp}/link"}),
        (
            {"type": "redis", "url": "redis://u:hunter2@127.0.0.1:6379/0"},
            {"type": "redis", "url": "redis://127.0.0.1:6379/0", "ttl_s": 60},
        ),
        (
            {"type": "redis", "url": "redis://127.0.0.1:6379?db=2&password=hunter2"},
            {"type": "redis", "url": "redis://127.0.0.1:6379?db=2"},
        ),
        (
            {"type": "redis", "startup_nodes": ["h1:1", "h2:1"]},
            {"type": "redis", "startup_nodes": ["h2:1", "h1:1"]},
        ),
        (
            {"type": "obj", "bucket": "kvb", "endpoint_url": "http://127.0.0.1:9"},
            {"type": "obj", "bucket": "kvb", "endpoint_url": "http://127.0.0.1:9", "retries": 0},
        ),
        (
            {"type": "mooncake", "master_server_address": "127.0.0.1:5"},
            {"type": "mooncake", "master_server_address": "127.0.0.1:5", "io_threads": 2},
        ),
    ],
)
def test_two_tiers_over_one_store_are_refused_naming_both(
    tmp_path: Path, first: dict[str, object], second: dict[str, object]
) -> None:
    (tmp_path / "kv").mkdir()
    (tmp_path / "x").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "kv")

    def placed(entry: dict[str, object]) -> dict[str, object]:
        return {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in entry.items()}

    tiers = [{"type": "memory"}, placed(first), placed(second)]
    with pytest.raises(ConfigError) as caught:
        load_config({"secondary_tiers": tiers})
    assert [path for path, _ in caught.value.problems] == ["secondary_tiers[2]"]
    message = str(caught.value)
    assert "where secondary_tiers[1] does" in message
    assert "hunter2" not in message
    # Built by hand, the configuration is refused when the cache starts.
    config = load_config({"chunk_tokens": 16, "secondary_tiers": [placed(first)]})
    twice = config.model_copy(update={"secondary_tiers": config.secondary_tiers * 2})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\]: keeps its chunks where"):
        KVCache(twice, small_layout())


@pytest.mark.parametrize(
    "second",
    [
        {"type": "fs", "root_dir": "{tmp}/kv/inner"},
        {"type": "redis", "url": "redis://127.0.0.1:6379/0", "key_prefix": "other:"},
        {"type": "redis", "url": "redis://127.0.0.1:6379/1"},
        {"type": "redis", "url": "redis://127.0.0.1:6379?db=1"},
        {"type": "obj", "bucket": "kvb", "endpoint_url": "http://127.0.0.1:9", "prefix": "b/"},
        {"type": "memory"},
    ],
)
def test_tiers_over_different_places_of_one_server_or_disk_are_kept(
    tmp_path: Path, second: dict[str, object]
) -> None:
    first = {
        "fs": {"type": "fs", "root_dir": str(tmp_path / "kv")},
        "redis": {"type": "redis", "url": "redis://127.0.0.1:6379/0"},
        "obj": {"type": "obj", "bucket": "kvb", "endpoint_url": "http://127.0.0.1:9"},
        "memory": {"type": "memory"},
    }[str(second["type"])]
    entry = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in second.items()}
    config = load_config({"secondary_tiers": [first, entry]})
    assert len(config.secondary_tiers) == 2


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("top.yaml", "chunk_tokens: 16\ncpu_bytes_to_use: 1GiB\nchunk_tokens: 32\n", "line 1"),
        (
            "entry.yaml",
            "secondary_tiers:\n  - type: memory\n    max_bytes: 1GiB\n    max_bytes: 2GiB\n",
            "'max_bytes' given twice",
        ),
        ("top.json", '{"chunk_tokens": 16, "chunk_tokens": 32}', "'chunk_tokens' given twice"),
        (
            "entry.json",
            '{"secondary_tiers": [{"type": "memory", "type": "fs"}]}',
            "'type' given twice",
        ),
    ],
)
def test_a_key_given_twice_in_a_file_is_refused_not_settled_by_the_last(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def test_a_yaml_merge_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "secondary_tiers:\n"
        "  - &memory {type: memory, max_bytes: 1MiB}\n"
        "  - {<<: *memory, max_bytes: 2MiB}\n"
    )
    first, second = load_config(path).secondary_tiers
    assert first.as_dict()["max_bytes"] == 1 << 20 and second.as_dict()["max_bytes"] == 2 << 20
