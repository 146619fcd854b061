"""The primary tier's per-chunk loops: which keys are ready, pinned, reserved.

Every request walks its chain a few times under the primary tier's lock;
these are those walks, over the tier's dicts (``ready`` and ``writing`` map
keys to slots, ``pins`` to reader counts) and its list of free slots. They
run compiled (``_native/_slots.c``) where kvtier was built with a C compiler,
else as written here: the same functions, results and errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import takewhile
from typing import NamedTuple

from kvtier.keys import ChunkKey

Slots = dict[ChunkKey, int]


def _ready_count(ready: Slots, keys: Sequence[ChunkKey]) -> int:
    """How many leading ``keys`` are in ``ready``."""
    return len(list(takewhile(ready.__contains__, keys)))


def _pin_prefix(ready: Slots, pins: Slots, keys: Iterable[ChunkKey]) -> list[int]:
    """A reader added to each leading ready key, up to the first that is not
    ready; their slots."""
    slots = []
    for key in keys:
        slot = ready.get(key)
        if slot is None:
            break
        pins[key] = pins.get(key, 0) + 1
        slots.append(slot)
    return slots


def _unpin(pins: Slots, keys: Sequence[ChunkKey]) -> int:
    """A reader taken from each key; ``-1``, or the index of the first key
    with none left to take, after every reader taken before it is given back."""
    for done, key in enumerate(keys):
        count = pins.pop(key, 0)  # most chunks have one reader: one dict operation
        if count > 1:
            pins[key] = count - 1
        elif count <= 0:
            for undone in keys[:done]:
                pins[undone] = pins.get(undone, 0) + 1
            return done
    return -1


def _new_keys(ready: Slots, writing: Slots, keys: Iterable[ChunkKey]) -> Slots:
    """``{key: -1}`` for the keys in neither dict, each once, in order."""
    return {key: -1 for key in keys if key not in ready and key not in writing}


def _idle_resident(ready: Slots, pins: Slots, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
    """The keys in ``ready`` and not in ``pins``."""
    return [key for key in keys if key in ready and key not in pins]


def _take_slots(reserved: Slots, free: list[int], writing: Slots) -> None:
    """Each reserved key gets the slot popped from the end of ``free``, in
    order; then they all join ``writing``."""
    for key in reserved:
        reserved[key] = free.pop()
    writing.update(reserved)


def _free_victims(ready: Slots, free: list[int], victims: Iterable[ChunkKey]) -> None:
    """Each victim leaves ``ready`` and its slot joins ``free`` (``KeyError``
    for a victim not in ``ready``)."""
    for victim in victims:
        free.append(ready.pop(victim))


def _finish_writes(writing: Slots, keys: Iterable[ChunkKey]) -> Slots:
    """``{key: slot}`` of the keys being written, each once, in order, taken
    out of ``writing``; other keys are skipped."""
    written = {}
    for key in keys:
        slot = writing.pop(key, None)
        if slot is not None:
            written[key] = slot
    return written


class SlotLoops(NamedTuple):
    """One implementation of the loops."""

    ready_count: Callable[[Slots, Sequence[ChunkKey]], int]
    pin_prefix: Callable[[Slots, Slots, Iterable[ChunkKey]], list[int]]
    unpin: Callable[[Slots, Sequence[ChunkKey]], int]
    new_keys: Callable[[Slots, Slots, Iterable[ChunkKey]], Slots]
    idle_resident: Callable[[Slots, Slots, Iterable[ChunkKey]], list[ChunkKey]]
    take_slots: Callable[[Slots, list[int], Slots], None]
    free_victims: Callable[[Slots, list[int], Iterable[ChunkKey]], None]
    finish_writes: Callable[[Slots, Iterable[ChunkKey]], Slots]


#: Every implementation present, by name.
IMPLEMENTATIONS: dict[str, SlotLoops] = {
    "python": SlotLoops(
        _ready_count,
        _pin_prefix,
        _unpin,
        _new_keys,
        _idle_resident,
        _take_slots,
        _free_victims,
        _finish_writes,
    )
}
try:
    from kvtier.primary._native import _slots
except ImportError:  # built without a C compiler
    IMPLEMENTATION = "python"
else:
    IMPLEMENTATIONS["compiled"] = SlotLoops(
        _slots.ready_count,
        _slots.pin_prefix,
        _slots.unpin,
        _slots.new_keys,
        _slots.idle_resident,
        _slots.take_slots,
        _slots.free_victims,
        _slots.finish_writes,
    )
    IMPLEMENTATION = "compiled"

#: The implementation the primary tier runs.
active = IMPLEMENTATIONS[IMPLEMENTATION]
