"""The contract every chunk codec keeps, as a test-suite to inherit: chunks
that look like KV (normal values with a few outlier channels) in each float
dtype the codec accepts, plus raw random bytes for exact codecs, in the
default ``kv_order`` and in one the codec cannot know (an engine's pages).

See docs/codecs.md for an example.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest

from kvtier.codecs import (
    Codec,
    CodecLayoutError,
    CodecMismatchError,
    CodecStage,
    codec_config,
)
from kvtier.codecs.quantized import CHUNK_ORDER as DEFAULT_ORDER
from kvtier.codecs.samples import decode_floats, kv_like
from kvtier.errors import CorruptChunkError
from kvtier.layout import KVLayout

#: A ``kv_order`` no codec knows: the element order is an engine's secret.
OPAQUE_ORDER = "engine-pages:test"


def _layout(dtype: str, kv_order: str = DEFAULT_ORDER) -> KVLayout:
    return KVLayout("kvtier-codec-test", 2, 2, 64, dtype, 32, kv_order=kv_order)


class CodecContractTests:
    """Inherit and set :attr:`codec` (a name or a ``{type: ...}`` mapping)."""

    #: The ``codec`` entry under test, as configuration names it.
    codec: ClassVar[Any] = "none"
    #: Layout dtypes the codec must handle.
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    #: Element orders (``kv_order``) the codec must handle.
    kv_orders: ClassVar[tuple[str, ...]] = (DEFAULT_ORDER, OPAQUE_ORDER)
    #: Layouts the codec must refuse when built (with a reason).
    refused: ClassVar[tuple[KVLayout, ...]] = ()
    #: ``None``: exact, every byte back. Else the largest mean absolute error
    #: of a decoded chunk, relative to the chunk's mean absolute value.
    max_relative_error: ClassVar[float | None] = None

    def build(self, layout: KVLayout) -> Codec:
        return codec_config(self.codec).build(layout)

    def stage(self, layout: KVLayout) -> CodecStage:
        return CodecStage(self.build(layout), layout)

    def round_trip(self, layout: KVLayout, chunk: bytes) -> tuple[bytearray, int]:
        """``chunk`` encoded then decoded through a stage; and the payload length."""
        stage = self.stage(layout)
        payload = stage.scratch(1)[0]
        length = stage.encode(memoryview(chunk), payload)
        out = bytearray(layout.slot_bytes)
        stage.decode(payload[:length], memoryview(out))
        return out, length

    @pytest.fixture(
        params=[
            (dtype, order)
            for order in (DEFAULT_ORDER, OPAQUE_ORDER)
            for dtype in ("bfloat16", "float16", "float32")
        ],
        ids=lambda param: f"{param[0]}-{'default' if param[1] == DEFAULT_ORDER else 'opaque'}",
    )
    def layout(self, request: pytest.FixtureRequest) -> KVLayout:
        dtype, order = request.param
        if dtype not in self.dtypes:
            pytest.skip(f"the codec does not take {dtype} KV")
        if order not in self.kv_orders:
            pytest.skip(f"the codec does not take kv_order {order!r}")
        return _layout(dtype, order)

    def test_declares_its_kind(self, layout: KVLayout) -> None:
        codec = self.build(layout)
        assert isinstance(codec.lossy, bool) and isinstance(codec.fixed_size, bool)
        assert codec.max_encoded_bytes() > 0
        assert codec.params() == codec_config(self.codec).build(layout).params()

    def test_round_trip_of_kv(self, layout: KVLayout) -> None:
        chunk = kv_like(layout)
        decoded, _ = self.round_trip(layout, chunk)
        if self.max_relative_error is None:
            assert bytes(decoded) == chunk
            return
        expected = decode_floats(chunk, layout)
        got = decode_floats(decoded, layout)
        assert np.isfinite(got).all()
        error = float(np.abs(got - expected).mean() / np.abs(expected).mean())
        assert error <= self.max_relative_error, f"relative error {error:.4f}"

    def test_any_bytes_round_trip_exactly_or_to_a_whole_chunk(self, layout: KVLayout) -> None:
        """Exact codecs give back any bytes; a lossy one reads them as floats
        and either refuses them at encode (NaN, infinities: that store fails)
        or gives back a whole chunk, and gives zeros back as zeros."""
        rng = np.random.default_rng(7)
        noise = rng.integers(0, 256, layout.slot_bytes, dtype=np.uint8).tobytes()
        zeros = bytes(layout.slot_bytes)
        if self.max_relative_error is None:
            for chunk in (noise, zeros):
                assert bytes(self.round_trip(layout, chunk)[0]) == chunk
            return
        assert bytes(self.round_trip(layout, zeros)[0]) == zeros
        try:
            decoded, _ = self.round_trip(layout, noise)
        except ValueError:
            return
        assert len(decoded) == layout.slot_bytes

    def test_encoded_size_within_bounds(self, layout: KVLayout) -> None:
        codec = self.build(layout)
        out = bytearray(codec.max_encoded_bytes())
        written = codec.encode(memoryview(kv_like(layout)), memoryview(out))
        assert 0 < written <= codec.max_encoded_bytes()
        if codec.fixed_size:
            assert written == codec.max_encoded_bytes()

    def test_decode_refuses_truncated_data(self, layout: KVLayout) -> None:
        codec = self.build(layout)
        out = bytearray(codec.max_encoded_bytes())
        written = codec.encode(memoryview(kv_like(layout)), memoryview(out))
        with pytest.raises(Exception):  # noqa: B017 - any error, as long as it raises
            codec.decode(memoryview(out)[: written // 2], memoryview(bytearray(layout.slot_bytes)))

    def test_damaged_or_foreign_header_is_never_decoded(self, layout: KVLayout) -> None:
        stage = self.stage(layout)
        out = memoryview(bytearray(layout.slot_bytes))
        if stage.identity:
            # No header to damage: a payload not of the slot's size is refused
            # (the tier's checksum covers the bytes themselves).
            with pytest.raises(CorruptChunkError):
                stage.decode(memoryview(kv_like(layout))[:-1], out)
            return
        payload = stage.scratch(1)[0]
        length = stage.encode(memoryview(kv_like(layout)), payload)
        damaged = bytearray(payload[:length])
        damaged[0] ^= 0xFF
        with pytest.raises(CorruptChunkError):
            stage.decode(memoryview(damaged), out)
        with pytest.raises(CorruptChunkError):
            stage.decode(payload[:20], out)
        foreign = _ForeignStage(stage.codec, layout)
        with pytest.raises(CodecMismatchError):
            foreign.decode(payload[:length], out)

    def test_workers_encode_at_once(self, layout: KVLayout) -> None:
        stage = self.stage(layout)
        chunks = [kv_like(layout, seed) for seed in range(4)]
        expected = [bytes(self.round_trip(layout, chunk)[0]) for chunk in chunks]
        results: dict[int, bytes] = {}

        def work(index: int) -> None:
            for _ in range(3):
                buffer = stage.scratch(1)[0]
                length = stage.encode(memoryview(chunks[index]), buffer)
                out = bytearray(layout.slot_bytes)
                stage.decode(buffer[:length], memoryview(out))
                results[index] = bytes(out)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(chunks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [results[i] for i in range(len(chunks))] == expected

    def test_refuses_layouts_it_cannot_encode(self) -> None:
        for layout in self.refused:
            with pytest.raises(CodecLayoutError, match="cannot encode"):
                self.build(layout)


class _ForeignStage(CodecStage):
    """The same codec recorded under other parameters: what a reader
    configured differently sees."""

    def __init__(self, codec: Codec, layout: KVLayout) -> None:
        super().__init__(codec, layout)
        self.params = self.params + b" "
