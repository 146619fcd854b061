"""Reading prefix-reuse traces: Mooncake's JSONL format, gzipped or not.

One request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2353]}

``hash_ids`` are prefix block ids, ``block_size`` tokens a block: equal ids
mean equal prefixes up to the end of that block. When ``input_length`` is not
a multiple of the block size the last id hashes a partial block, which kvtier
never stores, so it is dropped. kvtier's recorder writes the same format and
adds each request's ``block_size``, which then overrides the one given.
"""

from __future__ import annotations

import gzip
import json
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import KVTierError

#: Mooncake's traces hash 512-token blocks.
DEFAULT_BLOCK_SIZE = 512


class TraceFormatError(KVTierError, ValueError):
    """A trace file is unreadable or breaks the format; names the file and line."""

    def __init__(self, path: Path | str, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Request:
    """One request of a trace: its full blocks, in prefix order.

    Blocks are renumbered densely from 1 in order of first sight, so that a
    replay holds small ints whatever the file's ids were (and no id is falsy).
    """

    timestamp: float
    blocks: tuple[int, ...]


def read_trace(
    path: Path | str, *, block_size: int = DEFAULT_BLOCK_SIZE, limit: int | None = None
) -> list[Request]:
    """Every request of the trace at ``path`` (at most ``limit``), checked.

    Raises :class:`TraceFormatError` naming the file and line for a missing or
    non-list ``hash_ids``, a non-integer id, a block whose id follows two
    different ids, unreadable or truncated gzip, or a file with no request.
    """
    path = Path(path)
    return parse_records(
        ((number, _parse(path, number, line)) for number, line in _lines(path)),
        path,
        block_size=block_size,
        limit=limit,
    )


def parse_records(
    records: Iterable[tuple[int, dict[str, object] | None]],
    source: Path | str,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    limit: int | None = None,
) -> list[Request]:
    """Requests of numbered records (``None`` for a blank line), checked as :func:`read_trace`."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    requests: list[Request] = []
    for request in _iter_requests(records, source, block_size):
        if limit is not None and len(requests) >= limit:
            break
        requests.append(request)
    if not requests:
        raise TraceFormatError(source, None, "no request in the trace")
    return requests


def _iter_requests(
    records: Iterable[tuple[int, dict[str, object] | None]], path: Path | str, block_size: int
) -> Iterator[Request]:
    # Ids renumbered densely from 1; parent_of[d] is the dense id before d (0: the
    # start), one parent only. A flat array: 8 bytes a distinct block.
    dense: dict[int, int] = {}
    parent_of = array("q", [0])
    for number, record in records:
        if record is None:
            continue
        ids = record.get("hash_ids")
        if not isinstance(ids, list):
            found = "missing" if ids is None else f"a {type(ids).__name__}"
            raise TraceFormatError(path, number, f"'hash_ids' must be a list of ints, is {found}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TraceFormatError(path, number, "'hash_ids' holds a value that is not an int")
        own = record.get("block_size", block_size)  # kvtier's recorder writes its own
        if not isinstance(own, int) or isinstance(own, bool) or own < 1:
            raise TraceFormatError(path, number, "'block_size' must be a positive int")
        full = _full_blocks(path, number, record, len(ids), own)
        blocks: list[int] = []
        parent = 0
        for block in ids[:full]:
            renumbered = dense.get(block)
            if renumbered is None:
                renumbered = dense[block] = len(dense) + 1
                parent_of.append(parent)
            elif parent_of[renumbered] != parent:
                original = {v: k for k, v in dense.items()}  # only to say what was wrong
                raise TraceFormatError(
                    path,
                    number,
                    f"block {block} follows {_describe(original.get(parent))} here but "
                    f"{_describe(original.get(parent_of[renumbered]))} earlier: "
                    "ids are not prefix hashes",
                )
            blocks.append(renumbered)
            parent = renumbered
        timestamp = record.get("timestamp", 0)
        if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
            raise TraceFormatError(path, number, "'timestamp' must be a number")
        yield Request(float(timestamp), tuple(blocks))


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines of a plain or gzipped file, with read errors made clear."""
    if not path.is_file():
        raise TraceFormatError(path, None, "no such file")
    number = 0
    try:
        with path.open("rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        with (
            gzip.open(path, "rt", encoding="utf-8") if gzipped else path.open(encoding="utf-8")
        ) as lines:
            for number, line in enumerate(lines, 1):
                yield number, line
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        # The line being read when it failed: the one after the last good one.
        raise TraceFormatError(path, number + 1, _reason(exc)) from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "truncated gzip stream"
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    return f"cannot read: {exc}"


def _parse(path: Path | str, number: int, line: str) -> dict[str, object] | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, number, f"not JSON: {exc.msg}") from None
    if not isinstance(record, dict):
        raise TraceFormatError(path, number, "a request must be a JSON object")
    return record


def _full_blocks(
    path: Path | str, number: int, record: dict[str, object], ids: int, block_size: int
) -> int:
    """Ids that hash a full block: all but a partial last one."""
    length = record.get("input_length")
    if length is None:
        return ids
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise TraceFormatError(path, number, "'input_length' must be a non-negative int")
    return min(ids, length // block_size)


def _describe(parent: int | None) -> str:
    return "the start" if parent is None else f"block {parent}"


def distinct_blocks(requests: list[Request]) -> int:
    """How many distinct full blocks the trace holds: what capacity shares refer to."""
    return len({block for request in requests for block in request.blocks})
