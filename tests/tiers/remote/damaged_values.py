"""Damaged values at a remote tier's chunk names: none is ever served, each is
counted and removed, a value gone is a vanished chunk, and none of it is an outage."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvtier.integrity import DIGEST_OFFSET, HEADER_BYTES
from kvtier.layout import KEY_BYTES
from kvtier.testing import TierHarness
from kvtier.tiers.base import Lookup
from kvtier.tiers.remote import RemoteTier

#: Offsets of a stored value's header fields, and of its payload.
FIELDS = {
    "magic": 0,
    "format version": 4,
    "length field": 8,
    "checksum": DIGEST_OFFSET,
    "namespace": DIGEST_OFFSET + 16,
    "key": DIGEST_OFFSET + 16 + KEY_BYTES,
    "first payload byte": HEADER_BYTES,
}

#: ``damage(name, other_name)``: spoils the value at ``name`` (``other_name``
#: holds another chunk's value).
Damage = Callable[[str, str], None]


def flipped(value: bytes, at: int) -> bytes:
    spoiled = bytearray(value)
    spoiled[at] ^= 0x40
    return bytes(spoiled)


def assert_no_damaged_value_served(
    harness: TierHarness,
    damages: Sequence[Damage],
    remove: Callable[[str], None],
    present: Callable[[str], bool],
) -> None:
    """Store a chunk per damage plus two, spoil one per damage, ``remove`` one
    (gone: not corrupt), and load them all: only the intact one is served."""
    tier = harness.tier
    assert isinstance(tier, RemoteTier)
    count = len(damages)
    keys = harness.keys(count + 2)  # one per damage, one gone, one intact
    stored = harness.fill(range(count + 2))
    assert harness.store(keys, list(range(count + 2))).success
    names = [tier.store_name(key) for key in keys]
    for index, damage in enumerate(damages):
        damage(names[index], names[index + 1])
    remove(names[count])
    slots = list(range(count + 2, 2 * count + 4))
    harness.buffer.array[slots] = 7
    result = harness.load(keys, slots)
    assert result.succeeded == frozenset([keys[-1]])
    assert result.vanished == frozenset([keys[count]])
    np.testing.assert_array_equal(harness.buffer.array[slots[-1]], stored[-1])
    # A tier that verifies a value before copying it never lets a damaged one
    # reach its slot. One that receives values in their slots (redis) verifies
    # them there, and a failure leaves the slot unpublished: its KVCache tests
    # show such bytes never reach the engine.
    if not tier.store.receives_into:
        for index, slot in enumerate(slots[:count]):
            assert (harness.buffer.array[slot] == 7).all(), f"damage {index} served"
    # Each damaged value counted and deleted; none of it an outage.
    assert tier.stats.corrupt_chunks == count
    assert tier.stats.backend_errors == 0
    assert tier.breaker.closed
    assert [present(name) for name in names[:count]] == [False] * count
    assert [harness.lookup(key) for key in keys] == [Lookup.MISS] * (count + 1) + [Lookup.HIT]
