"""The chunk header: only the exact stored bytes pass."""

import pytest

from kvtier import CorruptChunkError
from kvtier.integrity import HEADER_BYTES, frame, unframe_into
from kvtier.testing import small_layout

NS = small_layout().namespace
OTHER_NS = small_layout(model_id="other").namespace
KEY, OTHER_KEY = b"k" * 32, b"q" * 32
PAYLOAD = bytes(range(256)) * 4


def load(
    value: bytes, *, namespace: bytes = NS, key: bytes = KEY, size: int = len(PAYLOAD)
) -> bytes:
    out = bytearray(size)
    unframe_into(value, memoryview(out), namespace=namespace, key=key)
    return bytes(out)


def test_round_trip() -> None:
    value = frame(NS, KEY, PAYLOAD)
    assert len(value) == HEADER_BYTES + len(PAYLOAD)
    assert load(value) == PAYLOAD


@pytest.mark.parametrize("offset", [0, 5, 20, HEADER_BYTES - 1, HEADER_BYTES, -1])
def test_any_flipped_byte_is_caught(offset: int) -> None:
    value = bytearray(frame(NS, KEY, PAYLOAD))
    value[offset] ^= 0x01
    with pytest.raises(CorruptChunkError):
        load(bytes(value))


def test_truncated_foreign_and_misplaced_chunks_are_caught() -> None:
    value = frame(NS, KEY, PAYLOAD)
    with pytest.raises(CorruptChunkError, match="payload"):
        load(value[:-1])
    with pytest.raises(CorruptChunkError, match="truncated"):
        load(value[:10])
    with pytest.raises(CorruptChunkError, match="namespace"):
        load(value, namespace=OTHER_NS)
    with pytest.raises(CorruptChunkError, match="another key"):
        load(value, key=OTHER_KEY)
    with pytest.raises(CorruptChunkError, match="slot holds"):
        load(value, size=len(PAYLOAD) * 2)


def test_a_corrupt_value_never_touches_the_output() -> None:
    value = bytearray(frame(NS, KEY, PAYLOAD))
    value[-1] ^= 0xFF
    out = bytearray(b"\xaa" * len(PAYLOAD))
    with pytest.raises(CorruptChunkError):
        unframe_into(bytes(value), memoryview(out), namespace=NS, key=KEY)
    assert out == b"\xaa" * len(PAYLOAD)


def test_a_shorter_payload_leaves_nothing_of_an_earlier_one_in_the_buffer() -> None:
    namespace, key = b"n" * 32, b"k" * 32
    out = memoryview(bytearray(b"\xee" * 64))
    unframe_into(frame(namespace, key, b"abc"), out, namespace=namespace, key=key, exact_size=False)
    assert bytes(out) == b"abc" + bytes(61)
    with pytest.raises(CorruptChunkError):  # a slot-sized read takes only its own size
        unframe_into(frame(namespace, key, b"abc"), out, namespace=namespace, key=key)
