"""Whole rows copied between slots and a caller's rows: the compiled copy and
numpy's give the same bytes, gathered, scattered or both, below and above
the size from which the compiled one streams, into rows at any alignment."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvtier.primary.rows import IMPLEMENTATIONS, RowCopy

compiled = IMPLEMENTATIONS.get("compiled")
implementations = pytest.mark.parametrize(
    "copy_rows",
    [
        IMPLEMENTATIONS["python"],
        pytest.param(
            compiled,
            marks=pytest.mark.skipif(
                compiled is None, reason="kvtier was built without a C compiler: numpy copies"
            ),
        ),
    ],
    ids=["python", "compiled"],
)
STREAMED = 4 << 20  # the compiled copy streams a call that copies more than this


def rows_at(count: int, length: int, offset: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random rows of ``length`` bytes starting ``offset`` bytes into
    an allocation: C-contiguous, but aligned as the offset makes them."""
    memory = np.empty(count * length + 64, np.uint8)
    array = memory[offset : offset + count * length].reshape(count, length)
    array[:] = rng.integers(0, 256, array.shape, dtype=np.uint8)
    return array


def expected_after(
    target: np.ndarray, target_rows: Sequence[int], source: np.ndarray, source_rows: Sequence[int]
) -> np.ndarray:
    expected = target.copy()
    for into, out_of in zip(target_rows, source_rows, strict=True):
        expected[into] = source[out_of]
    return expected


@implementations
@pytest.mark.parametrize("length", [1, 7, 4096, 64 + 13, (STREAMED // 3) + 5, STREAMED + 3])
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_gathers_and_scatters_copy_each_row_whole(
    copy_rows: RowCopy, length: int, offset: int
) -> None:
    rng = np.random.default_rng(length * 10 + offset)
    count = 6 if length < STREAMED // 3 else 4  # the long rows: more than STREAMED in all
    slots = rows_at(count + 3, length, 0, rng)
    caller = rows_at(count, length, offset, rng)
    picked = [int(i) for i in rng.permutation(count + 3)[:count]]

    # A load: slots gathered into a run of the caller's rows, from one on.
    expected = expected_after(caller, range(1, count), slots, picked[1:])
    copy_rows(caller, range(1, count), slots, picked[1:])
    np.testing.assert_array_equal(caller, expected)

    # A store: a run of the caller's rows scattered into slots.
    caller[:] = rng.integers(0, 256, caller.shape, dtype=np.uint8)
    expected = expected_after(slots, picked, caller, range(count))
    copy_rows(slots, picked, caller, range(count))
    np.testing.assert_array_equal(slots, expected)

    # A store of rows that are not a run, and nothing at all.
    caller[:] = rng.integers(0, 256, caller.shape, dtype=np.uint8)
    expected = expected_after(slots, picked[:2], caller, [count - 1, 0])
    copy_rows(slots, picked[:2], caller, [count - 1, 0])
    copy_rows(slots, [], caller, [])
    np.testing.assert_array_equal(slots, expected)


@implementations
@pytest.mark.parametrize(
    ("target_rows", "source_rows", "error"),
    [
        ([0, 4], [1, 2], IndexError),  # past the target's rows
        ([0, 1], [1, 8], IndexError),  # past the source's
        ([-1], [1], IndexError),
        ([0], [-1], IndexError),
        ([0, 1], [1], ValueError),  # not as many of each
    ],
)
def test_rows_out_of_range_or_unpaired_copy_nothing(
    copy_rows: RowCopy, target_rows: list[int], source_rows: list[int], error: type[Exception]
) -> None:
    target = np.zeros((4, 16), np.uint8)
    source = np.ones((8, 16), np.uint8)
    with pytest.raises(error):
        copy_rows(target, target_rows, source, source_rows)
    assert not target.any()


@implementations
def test_rows_of_another_length_are_refused(copy_rows: RowCopy) -> None:
    target = np.zeros((4, 16), np.uint8)
    with pytest.raises(ValueError):
        copy_rows(target, [0], np.ones((4, 8), np.uint8), [0])
    assert not target.any()


@pytest.mark.skipif(compiled is None, reason="kvtier was built without a C compiler")
def test_the_compiled_copy_refuses_what_it_cannot_copy_as_bytes() -> None:
    """What numpy would copy anyway (strided, overlapping), the compiled copy,
    which copies memory as it lies, refuses, and it never writes a read-only array."""
    assert compiled is not None
    rows = np.zeros((4, 16), np.uint8)
    source = np.ones((4, 16), np.uint8)
    read_only = rows.copy()
    read_only.flags.writeable = False
    refused: list[tuple[np.ndarray, np.ndarray, type[Exception], str]] = [
        (rows[:, ::2], source[:, :8], ValueError, "contiguous"),
        (rows.reshape(-1), source, ValueError, "two dimensions"),
        (rows, rows[2:], ValueError, "overlap"),
        (read_only, source, ValueError, "read-only"),
    ]
    for target, out_of, error, said in refused:
        with pytest.raises(error, match=said):
            compiled(target, [0], out_of, [1])
    with pytest.raises(TypeError, match="sequence"):
        compiled(rows, 0, source, [1])  # type: ignore[arg-type]
    assert not rows.any()


@implementations
@pytest.mark.parametrize("kind", [list, tuple, np.array])
def test_rows_are_any_sequence_of_integers(copy_rows: RowCopy, kind: type) -> None:
    source = np.arange(40, dtype=np.uint8).reshape(5, 8)
    target = np.zeros((3, 8), np.uint8)
    copy_rows(target, kind([2, 0]), source, kind([4, 1]))
    np.testing.assert_array_equal(target, [source[1], [0] * 8, source[4]])


@pytest.mark.skipif(compiled is None, reason="kvtier was built without a C compiler")
def test_rows_changed_by_an_index_method_never_reach_past_the_count() -> None:
    """An item's ``__index__`` runs Python, which may grow or shrink the list
    being read: the copy reads as many rows as it counted, or fails."""
    assert compiled is not None
    source = np.arange(32, dtype=np.uint8).reshape(4, 8)
    target = np.zeros((4, 8), np.uint8)

    class Growing:
        def __index__(self) -> int:
            rows.extend([0] * 1000)
            return 3

    rows: list[object] = [Growing(), 1]
    compiled(target, rows, source, [0, 1])  # type: ignore[arg-type]
    np.testing.assert_array_equal(target, [[0] * 8, source[1], [0] * 8, source[0]])

    class Shrinking:
        def __index__(self) -> int:
            del rows[1:]
            return 0

    rows = [Shrinking(), 1, 2]
    with pytest.raises(RuntimeError, match="changed size"):
        compiled(target, rows, source, [0, 1, 2])  # type: ignore[arg-type]
