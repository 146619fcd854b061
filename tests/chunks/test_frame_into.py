"""``integrity.frame_into``: the reusable-buffer twin of ``frame``."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.integrity import HEADER_BYTES, copy_bytes, frame, frame_into, unframe_into

NAMESPACE, KEY = b"n" * 32, b"k" * 32


def test_frame_into_writes_exactly_what_frame_returns() -> None:
    payload = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    buffer = bytearray(b"\xff" * (HEADER_BYTES + len(payload)))
    frame_into(buffer, NAMESPACE, KEY, memoryview(payload))
    assert bytes(buffer) == frame(NAMESPACE, KEY, payload)
    out = bytearray(len(payload))
    unframe_into(buffer, memoryview(out), namespace=NAMESPACE, key=KEY)
    assert out == payload


@pytest.mark.parametrize("delta", [-1, 1])
def test_frame_into_refuses_a_buffer_of_another_size(delta: int) -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        frame_into(bytearray(HEADER_BYTES + 64 + delta), NAMESPACE, KEY, b"x" * 64)


def test_copy_bytes_copies_any_byte_buffer_and_refuses_another_length() -> None:
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    for source in (data, memoryview(data), bytearray(data)):
        out = bytearray(len(data))
        copy_bytes(memoryview(out), source)
        assert out == data
    with pytest.raises(ValueError):
        copy_bytes(memoryview(bytearray(len(data) - 1)), data)
    with pytest.raises(ValueError):
        copy_bytes(memoryview(bytes(len(data))), data)  # read-only destination
