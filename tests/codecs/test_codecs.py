"""Chunk codecs: every built-in keeps the codec contract; configuration names
them like tiers and policies, and refuses bad ones at start by path."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.codecs import CodecLayoutError, codec_registry
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.testing import CodecContractTests, restore_registries


def _layout(dtype: str = "bfloat16", **changes: Any) -> KVLayout:
    fields: dict[str, Any] = {
        "model_id": "m",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": dtype,
        "chunk_tokens": 32,
    }
    fields.update(changes)
    return KVLayout(**fields)


QUANTISED_REFUSED = (
    _layout("float8_e4m3fn"),
    _layout("int8"),
    # Float pages of an engine whose cache is quantised: other bytes may sit beside the KV.
    _layout(kv_order="engine-pages", extra=(("kv_cache_dtype", "fp8"),)),
)


class TestNoneCodec(CodecContractTests):
    codec = "none"


class TestLosslessZstd(CodecContractTests):
    codec = "lossless"


class TestLosslessLz4(CodecContractTests):
    codec = {"type": "lossless", "compressor": "lz4"}


class TestFp8Codec(CodecContractTests):
    codec = "fp8"
    max_relative_error = 0.05
    refused = QUANTISED_REFUSED


class TestInt8Codec(CodecContractTests):
    codec = "int8"
    max_relative_error = 0.02
    refused = QUANTISED_REFUSED


class TestInt4Codec(CodecContractTests):
    codec = {"type": "int4", "group_size": 32}
    max_relative_error = 0.25
    refused = (*QUANTISED_REFUSED, _layout(chunk_tokens=48))


def test_lossless_shrinks_kv_and_int4_shrinks_most() -> None:
    from kvtier.testing.codec_suite import kv_like

    layout = _layout()
    chunk = memoryview(kv_like(layout))
    sizes = {}
    for name in ("lossless", "fp8", "int8", "int4"):
        codec = codec_registry.resolve(name)(layout, name=name)
        out = bytearray(codec.max_encoded_bytes())
        sizes[name] = codec.encode(chunk, memoryview(out))
    assert sizes["lossless"] < layout.slot_bytes
    assert sizes["fp8"] == sizes["int8"] < 0.6 * layout.slot_bytes
    assert sizes["int4"] < 0.35 * layout.slot_bytes


def _tier(codec: Any) -> dict[str, Any]:
    return {"secondary_tiers": [{"type": "memory", "codec": codec}]}


def test_codec_by_name_or_mapping() -> None:
    config = load_config(_tier({"type": "int4", "group_size": 16}))
    codec = config.secondary_tiers[0].codec
    assert codec is not None and codec.codec_type == "int4"
    assert codec.as_dict() == {"type": "int4", "group_size": 16}
    assert config.secondary_tiers[0].as_dict()["codec"] == {"type": "int4", "group_size": 16}
    fp8 = load_config(_tier("fp8")).secondary_tiers[0].codec
    assert fp8 is not None and fp8.codec_type == "fp8"
    assert load_config({"secondary_tiers": [{"type": "memory"}]}).secondary_tiers[0].codec is None


@pytest.mark.parametrize(
    ("codec", "path", "says"),
    [
        ({"type": "int4", "group_sise": 8}, "secondary_tiers[0].codec.group_sise", "group_size"),
        ({"type": "int4", "group_size": 1}, "secondary_tiers[0].codec.group_size", "greater"),
        ({"type": "lossless", "compressor": "gzip"}, "secondary_tiers[0].codec.compressor", "zstd"),
        ("fp9", "secondary_tiers[0].codec.type", "Supported: fp8, int4, int8, lossless, none"),
        (7, "secondary_tiers[0].codec", "expected a codec name"),
        ({"group_size": 8}, "secondary_tiers[0].codec", "'type' is required"),
    ],
)
def test_bad_codec_entries_fail_at_start_by_path(codec: Any, path: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_tier(codec))
    assert path in str(caught.value) and says in str(caught.value)


@pytest.fixture
def registries() -> Iterator[None]:
    with restore_registries():
        yield


def test_codec_from_module_path_and_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registries: None
) -> None:
    (tmp_path / "acme_codecs.py").write_text(
        textwrap.dedent(
            """
            from kvtier.codecs.quantized import Int8Codec

            class AcmeInt8(Int8Codec):
                pass

            class NotACodec:
                pass
            """
        )
    )
    dist = tmp_path / "acme_codecs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-codecs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvtier.codecs]\nacme-int8 = acme_codecs:AcmeInt8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_path = load_config(_tier({"type": "AcmeInt8", "module_path": "acme_codecs"}))
    by_entry_point = load_config(_tier("acme-int8"))
    for config, name in ((by_path, "AcmeInt8"), (by_entry_point, "acme-int8")):
        entry = config.secondary_tiers[0].codec
        assert entry is not None and entry.codec_class.__name__ == "AcmeInt8"
        assert entry.build(_layout()).name == name
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.codec\.type.*not a subclass"):
        load_config(_tier({"type": "NotACodec", "module_path": "acme_codecs"}))
    monkeypatch.setenv("KVTIER_ALLOWED_MODULES", "corp")
    with pytest.raises(ConfigError, match="not allowed"):
        load_config(_tier({"type": "AcmeInt8", "module_path": "acme_codecs"}))


def test_a_codec_that_cannot_encode_the_layout_is_refused_when_the_tier_starts() -> None:
    from kvtier import KVCache

    config = {"chunk_tokens": 32, "secondary_tiers": [{"type": "memory", "codec": "fp8"}]}
    with pytest.raises(CodecLayoutError, match=r"fp8.*float8_e4m3fn") as caught:
        KVCache(config, _layout("float8_e4m3fn"))
    assert "secondary_tiers[0]" in str(caught.value.__notes__)


def test_fixed_size_tiers_refuse_variable_size_codecs() -> None:
    from kvtier import KVCache

    # An out-of-tree tier that keeps the default: values of one size only
    # (every built-in tier that takes codecs stores any size).
    fixed = {"type": "ObviousNamesTier", "module_path": "tests.tiers.threaded_doubles"}
    config = {"chunk_tokens": 32, "secondary_tiers": [{**fixed, "codec": "lossless"}]}
    with pytest.raises(ValueError, match=r"varying size.*ObviousNamesTier stores fixed-size"):
        KVCache(config, _layout())


def test_tiers_that_store_no_chunks_of_their_own_refuse_a_codec() -> None:
    from kvtier import KVCache

    config = {
        "chunk_tokens": 32,
        "secondary_tiers": [
            {"type": "p2p", "secret": "s" * 32, "listen": None, "codec": "lossless"}
        ],
    }
    with pytest.raises(ValueError, match="does not take a codec"):
        KVCache(config, _layout())
    example = {"chunk_tokens": 32, "secondary_tiers": [{"type": "example", "codec": "int8"}]}
    with pytest.raises(ValueError, match="does not take a codec"):
        KVCache(example, _layout())
    # The none codec is what every tier does already: any tier takes it.
    with KVCache(
        {"chunk_tokens": 32, "secondary_tiers": [{"type": "example", "codec": "none"}]}, _layout()
    ):
        pass


TINY = KVLayout("m", 1, 1, 8, "float16", 4)
TINY_PAGES = KVLayout("m", 1, 1, 8, "float16", 4, kv_order="engine-pages")


@settings(max_examples=50, deadline=None)
@given(
    chunk=st.binary(min_size=TINY.slot_bytes, max_size=TINY.slot_bytes),
    compressor=st.sampled_from(["zstd", "lz4"]),
)
def test_lossless_gives_back_any_bytes(chunk: bytes, compressor: str) -> None:
    from kvtier.codecs import CodecStage, codec_config

    stage = CodecStage(
        codec_config({"type": "lossless", "compressor": compressor}).build(TINY), TINY
    )
    assert stage.round_trip(chunk) == chunk


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.floats(min_value=-1e4, max_value=1e4, width=32),
        min_size=TINY.slot_bytes // 2,
        max_size=TINY.slot_bytes // 2,
    ),
    codec=st.sampled_from(["fp8", "int8", "int4"]),
    layout=st.sampled_from([TINY, TINY_PAGES]),
)
def test_lossy_codecs_stay_within_their_step_of_any_finite_values(
    values: list[float], codec: str, layout: KVLayout
) -> None:
    """In the order they know (grouped by head or KIVI's way) and in one they
    do not (consecutive elements), the bound is the same."""
    import numpy as np

    from kvtier.codecs import CodecStage, codec_config

    stage = CodecStage(
        codec_config({"type": "int4", "group_size": 4} if codec == "int4" else codec).build(layout),
        layout,
    )
    exact = np.asarray(values, np.float16)
    decoded = np.frombuffer(stage.round_trip(exact.tobytes()), np.float16).astype(np.float32)
    assert np.isfinite(decoded).all()
    # No value moves by more than its group's range over the code's levels
    # (4-bit: 15 steps; 8-bit: 127 steps of the largest magnitude; e4m3: 2**-3
    # of the value's magnitude), plus float16's own rounding.
    exact32 = exact.astype(np.float32)
    scale = float(np.abs(exact32).max()) or 1.0
    bound = {"fp8": 2 * scale / 16, "int8": scale / 127, "int4": 2 * scale / 15}[codec]
    assert np.abs(decoded - exact32).max() <= bound + 1e-3 * scale


def test_a_codec_named_plainly_or_with_its_defaults_shares_one_namespace() -> None:
    from kvtier.codecs import CodecStage, codec_config

    layout = _layout()

    def namespace(entry: Any) -> bytes:
        return CodecStage(codec_config(entry).build(layout), layout).namespace(layout.namespace)

    assert namespace("int4") == namespace({"type": "int4", "group_size": 32})
    assert namespace("int4") != namespace({"type": "int4", "group_size": 16})
    assert namespace("none") == layout.namespace
    assert len({namespace(name) for name in ("none", "lossless", "fp8", "int8", "int4")}) == 5


@pytest.mark.parametrize(
    ("codec", "default_order", "other_order"),
    [
        ("int8", {"grouping": "token,head", "group_size": 64}, {"grouping": "elements"}),
        ("fp8", {"grouping": "token,head", "group_size": 64}, {"grouping": "elements"}),
        ("int4", {"grouping": "kivi", "group_size": 32}, {"grouping": "elements"}),
    ],
)
def test_lossy_codecs_record_their_grouping_and_never_decode_another(
    codec: str, default_order: dict[str, Any], other_order: dict[str, Any]
) -> None:
    import numpy as np

    from kvtier.codecs import CodecMismatchError, CodecStage, codec_config
    from kvtier.codecs.quantized import DEFAULT_ELEMENT_GROUP
    from kvtier.codecs.samples import decode_floats, kv_like

    known, pages = _layout(), _layout(kv_order="engine-pages")
    by_order = codec_config(codec).build(known).params()
    by_elements = codec_config(codec).build(pages).params()
    assert by_order.items() >= default_order.items()
    assert by_elements.items() >= other_order.items()
    if codec != "int4":
        assert by_elements["group_size"] == DEFAULT_ELEMENT_GROUP

    written = CodecStage(codec_config(codec).build(pages), pages)
    chunk = kv_like(pages)
    payload = written.scratch(1)[0]
    length = written.encode(memoryview(chunk), payload)
    with pytest.raises(CodecMismatchError):
        CodecStage(codec_config(codec).build(known), known).decode(
            payload[:length], memoryview(bytearray(known.slot_bytes))
        )
    # Read in its own grouping, the chunk comes back within the codec's error.
    decoded = bytearray(pages.slot_bytes)
    written.decode(payload[:length], memoryview(decoded))
    exact = decode_floats(chunk, pages)
    error = np.abs(decode_floats(decoded, pages) - exact).mean() / np.abs(exact).mean()
    assert error < {"int8": 0.02, "fp8": 0.05, "int4": 0.25}[codec]


def test_kivi_grouping_beats_consecutive_elements_on_kv_with_outlier_channels() -> None:
    """Where the order is known, int4 keeps KIVI's grouping: the outlier key
    channels get scales of their own."""
    import numpy as np

    from kvtier.codecs import CodecStage, codec_config
    from kvtier.codecs.samples import decode_floats, kv_like

    errors = {}
    for order in ("layer,kv,token,head,dim", "engine-pages"):
        layout = _layout(kv_order=order)
        chunk = kv_like(layout, seed=3)
        decoded = CodecStage(codec_config("int4").build(layout), layout).round_trip(chunk)
        exact = decode_floats(chunk, layout)
        errors[order] = float(np.abs(decode_floats(decoded, layout) - exact).mean())
    assert errors["layer,kv,token,head,dim"] < errors["engine-pages"]


def test_a_group_size_that_does_not_divide_the_chunk_is_refused() -> None:
    from kvtier.codecs import codec_config

    layout = _layout(kv_order="engine-pages")  # 16,384 elements
    with pytest.raises(CodecLayoutError, match="group_size=48 does not divide"):
        codec_config({"type": "int8", "group_size": 48}).build(layout)
