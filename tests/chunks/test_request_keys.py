"""A request's token ids checked and hashed once: found again by identity,
checked against a copy, else by content."""

from typing import Any

import numpy as np
import pytest

from kvtier import chunk_keys
from kvtier import request_keys as request_keys_module
from kvtier.request_keys import RequestKeys

NS = b"ns"


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every sequence checked from here on."""
    lengths: list[int] = []
    real = request_keys_module.token_list_bytes

    def counting(tokens: Any, where: str = "tokens") -> bytes:
        lengths.append(len(tokens))
        return real(tokens, where)

    monkeypatch.setattr(request_keys_module, "token_list_bytes", counting)
    return lengths


@pytest.mark.parametrize("kind", [list, tuple])
def test_the_same_sequence_again_is_neither_checked_nor_hashed_again(
    checked: list[int], kind: type
) -> None:
    keys = RequestKeys(NS, 4)
    tokens = kind(range(100, 114))  # three full chunks and a tail
    first = keys.keys(tokens)
    assert first == (tuple(chunk_keys(NS, tokens, 4)), 14)
    assert keys.keys(tokens) == first
    assert checked == [14]
    # An equal sequence, another object: checked again.
    assert keys.keys(kind(list(tokens))) == first
    assert checked == [14, 14]


def test_a_list_changed_in_place_is_keyed_afresh(checked: list[int]) -> None:
    keys = RequestKeys(NS, 4)
    tokens = list(range(100, 112))
    keys.keys(tokens)
    tokens[5] += 1
    assert keys.keys(tokens)[0] == tuple(chunk_keys(NS, tokens, 4))
    tokens.extend(range(4))
    assert keys.keys(tokens) == (tuple(chunk_keys(NS, tokens, 4)), 16)
    assert checked == [12, 12, 16]
    tokens[0] = 2.5  # type: ignore[call-overload]  # a float on purpose
    with pytest.raises(TypeError, match=r"tokens\[0\] = 2.5"):
        keys.keys(tokens)
    tokens[0] = True
    with pytest.raises(TypeError, match=r"tokens\[0\] = True"):
        keys.keys(tokens)


@pytest.mark.parametrize(
    "tokens",
    [[70_000, False, 70_001], [70_000, 70_001, True], [False]],
    ids=["false-among-large-ids", "true-at-the-end", "false-alone"],
)
def test_a_bool_among_ids_is_refused_wherever_it_is(tokens: list[Any]) -> None:
    with pytest.raises(TypeError, match="token ids must be integers"):
        RequestKeys(NS, 4).keys(tokens)


def test_arrays_are_checked_every_time_and_hashed_once() -> None:
    keys = RequestKeys(NS, 4)
    tokens = np.arange(100, 112)
    assert keys.keys(tokens) == (tuple(chunk_keys(NS, tokens, 4)), 12)
    tokens[0] = 7  # an array's content, never its identity, is what counts
    assert keys.keys(tokens)[0] == tuple(chunk_keys(NS, tokens, 4))


def test_it_keeps_the_last_sequences_within_its_bounds(checked: list[int]) -> None:
    keys = RequestKeys(NS, 4, entries=2, max_tokens=20)
    lists = [list(range(i * 100, i * 100 + 8)) for i in range(3)]
    for tokens in lists:
        keys.keys(tokens)
    keys.keys(lists[2])
    keys.keys(lists[1])
    assert checked == [8, 8, 8]
    keys.keys(lists[0])  # the oldest, forgotten
    assert checked == [8, 8, 8, 8]
    long = list(range(24))  # more tokens than it keeps copies of: checked every time
    keys.keys(long)
    keys.keys(long)
    assert checked == [8, 8, 8, 8, 24, 24]


@pytest.mark.parametrize(
    "tokens",
    [[1, 2**63], (2**64,), [-(2**63) - 1], np.array([2**63], dtype=np.uint64)],
    ids=["list", "tuple", "negative", "uint64-array"],
)
def test_token_ids_past_64_bits_are_refused(tokens: Any) -> None:
    with pytest.raises(ValueError, match="tokens: a token id does not fit in 64 bits"):
        RequestKeys(NS, 4).keys(tokens)
