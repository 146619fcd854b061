"""Checks on what callers hand :class:`~kvtier.KVCache`, done before anything changes.

Each returns the value in the form kvtier uses, or raises ``TypeError`` /
``ValueError`` saying what was wrong and where. Token ids must be integers:
a float is refused rather than truncated (``1.2`` would otherwise share the
key of ``1``), and so is a bool.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.layout import KVLayout

TokenIds = Sequence[int] | np.ndarray

_TOKEN_DTYPE = np.dtype("<i8")
_INT64_MAX = np.iinfo(np.int64).max


def token_array(tokens: Any, where: str = "tokens") -> np.ndarray:
    """``tokens`` (a sequence of ints, or a 1-D integer numpy array or torch
    tensor) as a 1-D little-endian int64 array."""
    if type(tokens) is list or type(tokens) is tuple:  # what engines hand most often
        return np.frombuffer(token_list_bytes(tokens, where), _TOKEN_DTYPE)
    if isinstance(tokens, str | bytes | bytearray | AbstractSet | Mapping) or not hasattr(
        tokens, "__len__"
    ):
        raise TypeError(
            f"{where}: expected a sequence of int token ids, got {type(tokens).__name__}"
        )
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        dtype = tokens.dtype
        if dtype.is_floating_point or dtype.is_complex:  # bfloat16 has no numpy type
            raise TypeError(f"{where}: token ids must be integers, got dtype {dtype}")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        array = tokens
    else:
        return np.frombuffer(token_list_bytes(list(tokens), where), _TOKEN_DTYPE)
    if array.ndim != 1:
        raise ValueError(f"{where}: expected one sequence (1-D), got shape {array.shape}")
    if array.dtype.kind not in "iu" and array.size:
        raise TypeError(f"{where}: token ids must be integers, got dtype {array.dtype}")
    if array.dtype == np.uint64 and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"{where}: a token id does not fit in 64 bits")
    return array.astype(_TOKEN_DTYPE, copy=False)


def token_bytes(tokens: Any, where: str = "tokens") -> bytes:
    """``tokens`` checked as by :func:`token_array`, as the bytes of its
    little-endian int64 ids: what chunk keys hash."""
    if type(tokens) is list or type(tokens) is tuple:
        return token_list_bytes(tokens, where)
    return token_array(tokens, where).tobytes()


@functools.lru_cache(maxsize=64)
def _int64s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def token_list_bytes(tokens: list[Any] | tuple[Any, ...], where: str = "tokens") -> bytes:
    """A list or tuple of token ids as little-endian int64 bytes, checked.

    ``struct`` converts and checks in one C pass, several times faster than
    ``array('q')`` or numpy: it takes exactly what Python's integer protocol
    takes (no float, no str), bools included, which are looked for after.
    """
    if not tokens:  # chain_key of an engine's own page hash: no token ids
        return b""
    try:
        data = _int64s(len(tokens)).pack(*tokens)
    except struct.error:
        _refuse_non_integer(tokens, where)
        raise ValueError(f"{where}: a token id does not fit in 64 bits") from None
    # Bools pass as 0 and 1 (a bool is an int): only those ids need a look.
    ids = np.frombuffer(data, "<u8")  # negative ids are past 1 as unsigned
    # The lowest id found by argmin: on a prompt-sized array a fixed cost of
    # about a third of a ufunc's reduce (ndarray.min), paid by every request.
    if ids.size and ids.item(ids.argmin()) < 2:
        suspects = np.flatnonzero(ids < 2)
        if any(isinstance(tokens[index], bool) for index in suspects):
            _refuse_non_integer(tokens, where)
    return data


def _refuse_non_integer(tokens: Any, where: str) -> None:
    """Raise ``TypeError`` naming the first token id that is not an integer (or is a bool)."""
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise TypeError(
                f"{where}[{index}] = {token!r} ({type(token).__name__}): token ids must be integers"
            )


def seconds(value: Any, where: str) -> float:
    """A duration: a number >= 0 (``inf`` allowed: for ever; ``nan`` and ``bool`` refused)."""
    if type(value) is float and value >= 0:  # every lookup's defaults, checked at once
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{where} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def count(value: Any, where: str, minimum: int = 0) -> int:
    """An int >= ``minimum`` (``bool`` and ``float`` refused)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{where} must be >= {minimum}, got {value}")
    return int(value)


def check_str(value: Any, where: str) -> None:
    """Refuse what is not a string, as a request id or a shared-memory name:
    ``5`` and ``"5"`` would name two requests, and an unhashable id would fail
    deep in the tiers' bookkeeping."""
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected a str, got {type(value).__name__}")


def chunks_of(num_tokens: Any, chunk_tokens: int, available: int, where: str) -> int:
    """Chunks in ``num_tokens``: a multiple of ``chunk_tokens``, at most ``available`` tokens."""
    tokens = count(num_tokens, where)
    if tokens % chunk_tokens:
        raise ValueError(f"{where}={tokens} is not a multiple of chunk_tokens={chunk_tokens}")
    if tokens > available:
        raise ValueError(f"{where}={tokens} exceeds the {available} tokens available")
    return tokens // chunk_tokens


def chunk_rows(
    array: Any, rows: int, layout: KVLayout, where: str, *, writable: bool
) -> np.ndarray:
    """``array`` viewed as ``(len(array), slot_bytes)`` bytes, one chunk per row.

    Accepts ``(n, slot_bytes)`` ``uint8`` or ``(n, *chunk_shape)`` (or any
    ``(n, ...)`` of the same size) in the layout's dtype, C-contiguous, with
    ``n >= rows``. Anything else would be copied into whole slots as garbage.
    """
    if not isinstance(array, np.ndarray):
        if writable or not hasattr(array, "__array__"):
            raise TypeError(
                f"{where}: expected a numpy array or a chunk copier, got {type(array).__name__}"
            )
        try:
            array = np.asarray(array)
        except (TypeError, ValueError, RuntimeError) as error:  # a GPU or bfloat16 tensor
            raise TypeError(f"{where}: cannot be read as a numpy array: {error}") from None
    expected = (
        f"({rows}, {layout.slot_bytes}) uint8 or ({rows}, "
        f"{', '.join(map(str, layout.chunk_shape))}) {layout.numpy_dtype}, C-contiguous, "
        "one row per chunk"
    )
    row_items = int(np.prod(array.shape[1:])) if array.ndim >= 2 else 0
    right_dtype = array.dtype in (np.dtype(np.uint8), layout.numpy_dtype)
    if (
        array.ndim < 2
        or array.shape[0] < rows
        or not right_dtype
        or row_items * array.dtype.itemsize != layout.slot_bytes
    ):
        raise ValueError(f"{where}: shape {array.shape} {array.dtype}; expected {expected}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{where}: the array is not C-contiguous; expected {expected}")
    if writable and not array.flags.writeable:
        raise ValueError(f"{where}: the array is read-only")
    # The row length spelled out: -1 cannot be inferred for zero rows.
    return array.reshape(array.shape[0], row_items).view(np.uint8)


def unwritable_file_problem(path: str | Path) -> str | None:
    """Why no file can be written at ``path`` now, or ``None``: for files an
    engine writes later (a trace, statistics), checked when it starts."""
    target = Path(path).absolute()
    if target.is_dir():
        return f"{target} is a directory: name a file"
    if not target.parent.is_dir() or not os.access(target.parent, os.W_OK | os.X_OK):
        return f"cannot write in {target.parent}: not a directory this process can write"
    return None
