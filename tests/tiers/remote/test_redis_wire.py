"""Pipelined GETs, EXISTS and SETs against scripted server bytes: what is sent, and
how the replies are read."""

from __future__ import annotations

import socket
import time
from contextlib import nullcontext
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from kvtier.errors import CorruptChunkError  # noqa: E402
from kvtier.tiers.backend import FramedValue, ReadCut  # noqa: E402
from kvtier.tiers.redis_wire import exists, get_into, pack, set_many  # noqa: E402


class ScriptedConnection:
    """A redis-py-like connection whose server answers with the given bytes."""

    def __init__(self, answer: bytes, *, then_close: bool = False) -> None:
        self._sock, self.server = socket.socketpair()
        self.answer, self.then_close = answer, then_close
        self.sent = b""
        self.pieces: list[bytes | memoryview] = []
        self.disconnected = False

    def send_packed_command(
        self, packed: list[bytes | memoryview], check_health: bool = True
    ) -> None:
        self.pieces = packed
        self.sent = b"".join(packed)
        self.server.sendall(self.answer)
        if self.then_close:
            self.server.close()

    def disconnect(self) -> None:
        self.disconnected = True
        self._sock.close()


def test_pushes_nulls_and_errors_are_told_apart_from_values() -> None:
    answer = (
        b">3\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n%1\r\n+a\r\n:1\r\n"  # a RESP3 push
        b"$4\r\nabcd\r\n"
        b"_\r\n"
        b"$-1\r\n"
        b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        b"!9\r\nERR other\r\n"
        b"$7\r\ntoolong\r\n"
        b":1\r\n:0\r\n>1\r\n+notice\r\n:1\r\n!5\r\nERR x\r\n:1\r\n:1\r\n"
    )
    connection = ScriptedConnection(answer)
    buffers = [bytearray(4) for _ in range(6)]
    names = ["a", "b", "c", "d", "e", "f"]
    replies = get_into(connection, names, buffers, ttl_ms=500)
    assert bytes(replies[0]) == b"abcd"  # type: ignore[arg-type]
    assert replies[1] is None and replies[2] is None
    assert isinstance(replies[3], CorruptChunkError)
    assert isinstance(replies[4], redis.exceptions.ResponseError)
    assert "other" in str(replies[4])
    assert isinstance(replies[5], CorruptChunkError)  # 7 bytes where a chunk has 4
    assert buffers[0] == b"abcd" and buffers[5] == bytearray(4)
    assert connection.sent.count(b"PEXPIRE") == 6
    assert not connection.disconnected  # every reply read: the connection is reusable


def test_commands_are_packed_as_redis_py_packs_them() -> None:
    payload = bytearray(range(256)) * 64  # long: sent from where it lies
    header = b"H" * 48
    commands: list[tuple[Any, ...]] = [
        ("GET", "kvtier:0123abcd"),
        ("PEXPIRE", "kvtier:0123abcd", 86_400_000),
        ("EXISTS", "préfixe:ключ"),  # a key prefix need not be ASCII
        ("EXISTS", ""),
        ("SET", "kvtier:a", FramedValue(header, memoryview(payload)), "PX", 500),
        ("SET", "kvtier:b", memoryview(payload)[:100]),  # short: copied into the buffer
        ("SET", "kvtier:c", bytes(payload)),
        ("SET", "kvtier:d", FramedValue(header, memoryview(payload)[:10])),
    ]
    as_redis_py = [
        tuple(bytes(a.header) + bytes(a.payload) if isinstance(a, FramedValue) else a for a in c)
        for c in commands
    ]
    packer = redis.Redis().connection_pool.make_connection()
    packed = pack(commands)
    assert b"".join(packed) == b"".join(packer.pack_commands(as_redis_py))
    # The long payloads are sent apart, the first two with no copy at all.
    apart = [piece for piece in packed if isinstance(piece, memoryview)]
    assert [len(piece) for piece in apart] == [len(payload)] * 2
    assert apart[0].obj is payload
    # The small parts between them are joined: no send a name or a number.
    assert len(packed) == 2 * len(apart) + 1
    # A value of wider items is as long as its bytes, not its items.
    wide = memoryview(bytearray(8000)).cast("H")
    start = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$8000\r\n"
    assert b"".join(pack([("SET", "k", wide)])) == start + bytes(8000) + b"\r\n"


def test_existence_replies_pushes_and_item_errors() -> None:
    answer = (
        b":1\r\n"
        b">2\r\n+invalidate\r\n*1\r\n$1\r\nk\r\n:0\r\n"  # a RESP3 push first
        b"-NOPERM this user has no permissions to access one of the keys\r\n"
        b"!7\r\nERR bad\r\n"
    )
    connection = ScriptedConnection(answer)
    found = exists(connection, ["a", "b", "c", "d"])
    assert found[:2] == [True, False]
    assert isinstance(found[2], redis.exceptions.NoPermissionError)  # as redis-py tells it
    assert isinstance(found[3], redis.exceptions.ResponseError) and "bad" in str(found[3])
    assert connection.sent.count(b"EXISTS") == 4
    assert not connection.disconnected


def test_write_replies_pushes_and_item_errors_as_redis_py_tells_them() -> None:
    answer = (
        b"+OK\r\n"
        b">2\r\n+invalidate\r\n*1\r\n$1\r\nk\r\n+OK\r\n"  # a RESP3 push first
        b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
        b"-READONLY You can't write against a read only replica.\r\n"
        b"-NOPERM this user has no permissions to access one of the keys\r\n"
        b"!7\r\nERR bad\r\n"
    )
    connection = ScriptedConnection(answer)
    names = ["a", "b", "c", "d", "e", "f"]
    errors = set_many(connection, names, [b"v"] * len(names), ttl_ms=250)
    assert errors[:2] == [None, None]
    assert isinstance(errors[2], redis.exceptions.OutOfMemoryError)
    assert isinstance(errors[3], redis.exceptions.ReadOnlyError)
    assert isinstance(errors[4], redis.exceptions.NoPermissionError)
    assert type(errors[5]) is redis.exceptions.ResponseError and "bad" in str(errors[5])
    assert connection.sent.count(b"$2\r\nPX\r\n$3\r\n250\r\n") == len(names)
    assert not connection.disconnected


def check(connection: Any) -> object:
    return exists(connection, ["a"])


def write(connection: Any) -> object:
    return set_many(connection, ["a"], [b"v"], ttl_ms=None)


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        (check, b"$1\r\nx\r\n"),
        (check, b":1\r\n:1\r\n"),
        (check, b":1"),
        (write, b"$1\r\nx\r\n"),
        (write, b"+OK\r\n+OK\r\n"),
        (write, b"+O"),
    ],
    ids=[f"{c}-{a}" for c in ("exists", "set") for a in ("a value", "one too many", "cut")],
)
def test_a_check_or_write_reply_out_of_place_fails_the_batch(call: Any, answer: bytes) -> None:
    connection = ScriptedConnection(answer, then_close=True)
    with pytest.raises(redis.exceptions.ConnectionError):
        call(connection)
    assert connection.disconnected


def test_a_reply_cut_short_fails_the_batch_and_closes_the_connection() -> None:
    connection = ScriptedConnection(b"$4\r\nabcd\r\n$4\r\nab", then_close=True)
    with pytest.raises(redis.exceptions.ConnectionError, match="closed"):
        get_into(connection, ["a", "b"], [bytearray(4), bytearray(4)], ttl_ms=None)
    assert connection.disconnected


def test_an_unexpected_reply_fails_the_batch_and_closes_the_connection() -> None:
    connection = ScriptedConnection(b"+OK\r\n")
    with pytest.raises(redis.exceptions.ConnectionError, match="unexpected reply"):
        get_into(connection, ["a"], [bytearray(4)], ttl_ms=None)
    assert connection.disconnected


def test_a_silent_server_times_out_as_redis_py_does() -> None:
    connection = ScriptedConnection(b"$4\r\nab")
    connection._sock.settimeout(0.05)
    with pytest.raises(redis.exceptions.TimeoutError):
        get_into(connection, ["a"], [bytearray(4)], ttl_ms=None)
    assert connection.disconnected


def test_a_reply_line_that_never_ends_fails_the_batch_and_closes_the_connection() -> None:
    connection = ScriptedConnection(b"-" + b"x" * ((1 << 16) + 8192), then_close=True)
    with pytest.raises(redis.exceptions.ConnectionError, match="no reply line"):
        get_into(connection, ["a"], [bytearray(4)], ttl_ms=None)
    assert connection.disconnected


def test_a_value_received_split_fills_its_header_and_its_slot_exactly() -> None:
    connection = ScriptedConnection(b"$6\r\nhhabcd\r\n$5\r\nhhabc\r\n$-1\r\n")
    headers = [memoryview(bytearray(2)) for _ in range(3)]
    slots = [memoryview(bytearray(b"....")) for _ in range(3)]
    replies = get_into(connection, ["a", "b", "c"], headers, ttl_ms=None, payloads=slots)
    assert replies[0] is slots[0] and bytes(headers[0]) == b"hh" and bytes(slots[0]) == b"abcd"
    assert isinstance(replies[1], CorruptChunkError)  # one byte short: never received
    assert bytes(slots[1]) == b"...." and replies[2] is None
    assert not connection.disconnected


def read_one_split(connection: ScriptedConnection, slot: memoryview, **bounds: Any) -> None:
    """Read the value of one name: 2 header bytes, the rest into ``slot``."""
    header = memoryview(bytearray(2))
    get_into(connection, ["a"], [header], ttl_ms=None, payloads=[slot], **bounds)


def test_a_read_past_its_deadline_is_cut_and_closes_the_connection() -> None:
    connection = ScriptedConnection(b"$6\r\nhhab")  # the rest never comes
    connection._sock.settimeout(60)  # the connection's own bound: far later
    with pytest.raises(ReadCut):
        read_one_split(connection, memoryview(bytearray(4)), deadline=time.monotonic() + 0.05)
    assert connection.disconnected


def test_replies_for_slots_no_longer_ours_are_not_read() -> None:
    connection = ScriptedConnection(b"$6\r\nhhabcd\r\n")
    slot = memoryview(bytearray(b"...."))
    with pytest.raises(ReadCut):
        read_one_split(connection, slot, touch=lambda: nullcontext(False))
    assert bytes(slot) == b"...." and connection.disconnected


def test_nothing_is_asked_for_past_the_deadline() -> None:
    connection = ScriptedConnection(b"$6\r\nhhabcd\r\n")
    with pytest.raises(ReadCut):
        read_one_split(connection, memoryview(bytearray(4)), deadline=time.monotonic() - 1)
    assert connection.sent == b"" and not connection.disconnected  # still clean: reusable
