"""The ``redis`` tier's commands on one pooled connection, pipelined without
redis-py's pipeline: ``GET``\\s whose values are received with ``recv_into``
into a worker's buffer, or split between a header buffer and a slot, not
copied into a fresh ``bytes``; ``EXISTS`` checks; and ``SET``\\s whose values
are sent as they lie in their slots. Commands are packed here too:
redis-py's packer costs about 4.6 µs a command, ten times this one, and a
cold prefix of 2,048 chunks sends them twice (its checks, then its reads).
A connection goes back to the pool only once every reply was read; on any
error it is closed. Errors are classified as redis-py classifies them.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from kvtier.errors import CorruptChunkError
from kvtier.tiers.backend import BackendSkipped, Exists, Fetched, FramedValue, PutErrors, ReadCut

#: Per name: a view of the value in its buffer, ``None`` when absent, or that item's error.
Reply = memoryview | None | BaseException

#: A command's argument: a name or a number, or a value (sent as it lies when long).
Argument = str | int | bytes | bytearray | memoryview | FramedValue
#: Packed commands: buffers to send one after the other.
Packed = list[bytes | memoryview]

_T = TypeVar("_T")

_CRLF = b"\r\n"
_LINE_READ = 4096
#: Longer than any reply line these commands get (a length, an error message).
_LINE_LIMIT = 1 << 16
#: Values at least this long are sent from where they lie, not copied into
#: the packed buffer (redis-py's own cut-off between the two).
_SEND_APART = 6000


class _Replies:
    """RESP2 or RESP3 replies read from one socket, values received into given buffers."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._pending = bytearray()  # read past the last line, not yet consumed
        self._deadline = deadline
        self._timeout = sock.gettimeout()  # the connection's own, between deadlines

    def _bound(self) -> None:
        """Let the next socket call wait no later than the deadline."""
        if self._deadline == math.inf:
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ReadCut("the job's deadline passed while its values were read")
        self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))

    def restore(self) -> None:
        if self._deadline != math.inf:
            self._sock.settimeout(self._timeout)

    def _recv(self, size: int) -> bytes:
        self._bound()
        data = self._sock.recv(size)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def line(self) -> bytes:
        while (end := self._pending.find(_CRLF)) < 0:
            if len(self._pending) > _LINE_LIMIT:
                raise ConnectionError(f"no reply line within {_LINE_LIMIT} bytes")
            self._pending += self._recv(_LINE_READ)
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def into(self, out: memoryview) -> None:
        """Fill ``out`` exactly: what was read ahead first, then from the socket."""
        taken = min(len(self._pending), len(out))
        out[:taken] = self._pending[:taken]
        del self._pending[:taken]
        while taken < len(out):
            self._bound()
            got = self._sock.recv_into(out[taken:])
            if not got:
                raise ConnectionError("the server closed the connection")
            taken += got

    def skip(self, size: int) -> None:
        """Read and drop ``size`` bytes (a value that cannot be a chunk)."""
        scratch = memoryview(bytearray(max(1, min(size, 1 << 20))))
        while size:
            part = min(size, len(scratch))
            self.into(scratch[:part])
            size -= part

    def end_of_value(self) -> None:
        if self.line():
            raise ConnectionError("a bulk reply did not end where its length said")

    @property
    def clean(self) -> bool:
        return not self._pending


def pack(commands: Iterable[tuple[Argument, ...]]) -> Packed:
    """``commands`` as RESP arrays of bulk strings: names encoded as UTF-8, as
    redis-py's default encoder does, and every part joined into one buffer
    but long values, sent apart from where they lie (a :class:`FramedValue`
    as one bulk string: its header, then its payload)."""
    packed: Packed = []
    parts: list[bytes] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, (str, int)):
                data = str(arg).encode()
                parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
                continue
            header, payload = arg if isinstance(arg, FramedValue) else (b"", arg)
            value = memoryview(payload)
            parts.append(b"$%d\r\n%b" % (len(header) + value.nbytes, header))
            if value.nbytes < _SEND_APART:
                parts.append(value.tobytes())
            else:
                packed += (b"".join(parts), value)
                parts = []
            parts.append(_CRLF)
    packed.append(b"".join(parts))
    return packed


def set_many(
    connection: Any, names: Sequence[str], values: Sequence[Argument], *, ttl_ms: int | None
) -> PutErrors:
    """``SET`` each name to its value (to live ``ttl_ms``) in one round trip:
    per name, ``None`` or that item's error (redis-py's class: ``OutOfMemoryError``,
    ``ReadOnlyError``, ...). A whole-batch failure as :func:`get_into`'s."""
    expiry: tuple[str | int, ...] = () if ttl_ms is None else ("PX", ttl_ms)
    return _exchange(
        connection,
        [("SET", name, value, *expiry) for name, value in zip(names, values, strict=True)],
        math.inf,
        lambda replies: [_written(_status(replies, "SET", b"+")) for _ in names],
    )


def get_into(
    connection: Any,
    names: Sequence[str],
    buffers: Sequence[bytearray | memoryview],
    *,
    ttl_ms: int | None,
    payloads: Sequence[memoryview] | None = None,
    deadline: float = math.inf,
    touch: Callable[[], AbstractContextManager[bool]] = lambda: nullcontext(True),
) -> list[Fetched]:
    """``GET`` each name into its buffer (then ``PEXPIRE`` them when ``ttl_ms``) in
    one round trip. With ``payloads``, a value is received split: the length of
    its buffer, then the rest into its payload. The replies are read within
    ``touch()`` (false: the buffers are not ours now) and, past ``deadline``
    (``time.monotonic``), given up with :class:`ReadCut`. A whole-batch failure
    raises redis-py's ``ConnectionError`` or ``TimeoutError``; a value too long
    (split: not exactly as long) or not a string is that item's
    :class:`CorruptChunkError`, another server error its ``ResponseError``."""

    commands: list[tuple[Argument, ...]] = [("GET", name) for name in names]
    if ttl_ms is not None:
        commands += [("PEXPIRE", name, ttl_ms) for name in names]
    rests: Sequence[memoryview | None] = payloads or [None] * len(names)

    def read(replies: _Replies) -> list[Fetched]:
        with touch() as allowed:
            if not allowed:
                raise ReadCut("the job was answered before its values were read")
            results: list[Fetched] = [
                _value(replies, memoryview(buffer), rest)
                for buffer, rest in zip(buffers, rests, strict=True)
            ]
            if ttl_ms is not None:
                for _ in names:  # :1, :0 (gone meanwhile) or an error: nothing to do
                    _skip_reply(replies, _reply_line(replies))
        return results

    return _exchange(connection, commands, deadline, read)


def exists(connection: Any, names: Sequence[str]) -> list[Exists]:
    """``EXISTS`` each name in one round trip: per name, whether it is there,
    or that item's ``ResponseError``. A whole-batch failure as :func:`get_into`'s."""
    return _exchange(
        connection,
        [("EXISTS", name) for name in names],
        math.inf,
        lambda replies: [_present(_status(replies, "EXISTS", b":")) for _ in names],
    )


def _present(status: bytes | BaseException) -> Exists:
    """An ``EXISTS`` of one name: whether it is there (``:1``), or its error."""
    return status if isinstance(status, BaseException) else int(status) > 0


def _written(status: bytes | BaseException) -> BaseException | None:
    """A ``SET``: ``None`` once written, or its error."""
    return status if isinstance(status, BaseException) else None


def _exchange(
    connection: Any,
    commands: list[tuple[Argument, ...]],
    deadline: float,
    read: Callable[[_Replies], _T],
) -> _T:
    """Send ``commands``, then ``read`` every reply; the connection is closed
    on any error, which becomes redis-py's (or :class:`ReadCut`, past ``deadline``)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if time.monotonic() >= deadline:  # a retry after the job was answered: send nothing
        raise ReadCut("the job's deadline passed before its values were asked for")
    try:
        connection.send_packed_command(pack(commands), check_health=False)
        replies = _Replies(connection._sock, deadline)
        result = read(replies)
        if not replies.clean:
            raise ConnectionError("the server sent more than was asked")
        replies.restore()
    except BaseException as exc:
        connection.disconnect()
        if isinstance(exc, BackendSkipped):
            raise
        if isinstance(exc, socket.timeout):
            if time.monotonic() >= deadline:
                raise ReadCut(f"reading replies past the job's deadline: {exc}") from exc
            raise RedisTimeoutError(f"reading replies: {exc}") from exc
        if isinstance(exc, (OSError, ValueError)):
            raise RedisConnectionError(f"reading replies: {exc}") from exc
        raise
    return result


def _reply_line(replies: _Replies) -> bytes:
    """The first line of the next reply, past any RESP3 push (a server notice)."""
    line = replies.line()
    while line[:1] == b">":
        _skip_elements(replies, int(line[1:]))
        line = replies.line()
    return line


def _value(replies: _Replies, out: memoryview, rest: memoryview | None) -> Reply:
    """The next ``GET`` reply: the value received into ``out`` (``rest``: the
    part past ``out`` into it, which it returns), ``None``, or the item's error."""
    line = _reply_line(replies)
    kind, rest_of_line = line[:1], line[1:]
    if kind == b"$":
        length = int(rest_of_line)
        if length < 0:
            return None
        if rest is not None:
            return _split_value(replies, length, out, rest)
        if length > len(out):  # shorter ones are left to the integrity check
            replies.skip(length)
            replies.end_of_value()
            return CorruptChunkError(f"the value is {length} bytes, a chunk at most {len(out)}")
        value = out[:length]
        replies.into(value)
        replies.end_of_value()
        return value
    if kind == b"_":  # RESP3's null
        return None
    if kind in (b"-", b"!"):
        return _error(replies, kind, rest_of_line)
    raise ConnectionError(f"unexpected reply to GET: {line[:40]!r}")


def _split_value(replies: _Replies, length: int, out: memoryview, rest: memoryview) -> Reply:
    """A value of exactly ``len(out) + len(rest)`` bytes, received into both."""
    if length != len(out) + len(rest):
        replies.skip(length)
        replies.end_of_value()
        return CorruptChunkError(f"the value is {length} bytes, a chunk {len(out) + len(rest)}")
    replies.into(out)
    replies.into(rest)
    replies.end_of_value()
    return rest


def _status(replies: _Replies, command: str, expected: bytes) -> bytes | BaseException:
    """The next reply to one ``command`` of a name (``EXISTS``: ``:1``; ``SET``:
    ``+OK``): the rest of its line when it is of the ``expected`` kind, or the
    item's error."""
    line = _reply_line(replies)
    kind, rest = line[:1], line[1:]
    if kind == expected:
        return rest
    if kind in (b"-", b"!"):
        return _error(replies, kind, rest)
    raise ConnectionError(f"unexpected reply to {command}: {line[:40]!r}")


def _error(replies: _Replies, kind: bytes, rest: bytes) -> BaseException:
    """The item error an error reply stands for: simple, or (RESP3) with a length."""
    from redis._parsers import BaseParser

    if kind == b"!":
        message_bytes = bytearray(int(rest))
        replies.into(memoryview(message_bytes))
        replies.end_of_value()
        rest = bytes(message_bytes)
    message = rest.decode("utf-8", "replace")
    if message.startswith("WRONGTYPE"):
        return CorruptChunkError(f"the value is not a string: {message}")
    error: BaseException = BaseParser.parse_error(message)  # OOM, NOPERM, ... as redis-py's
    return error


def _skip_elements(replies: _Replies, count: int) -> None:
    """Read past ``count`` replies of any RESP2/RESP3 type."""
    for _ in range(count):
        _skip_reply(replies, replies.line())


def _skip_reply(replies: _Replies, line: bytes) -> None:
    """Read past the rest of the reply that ``line`` began."""
    kind, rest = line[:1], line[1:]
    if kind in (b"$", b"!", b"=") and int(rest) >= 0:
        replies.skip(int(rest))
        replies.end_of_value()
    elif kind in (b"*", b">", b"~"):
        _skip_elements(replies, max(0, int(rest)))
    elif kind in (b"%", b"|"):
        _skip_elements(replies, 2 * int(rest))
