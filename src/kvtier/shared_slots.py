"""The primary slots of a :class:`~kvtier.KVCache`, mapped by another process.

An engine whose workers copy KV pages (vLLM's) maps the cache's slots by the
name :attr:`KVCache.shared_memory_name` gives, then copies into and out of
the slots the scheduler's :meth:`KVCache.pin` and :meth:`KVCache.reserve` named.
"""

from __future__ import annotations

from kvtier.inputs import check_str, count
from kvtier.primary import SlotBuffer

__all__ = ["MappedSlots", "map_slots"]

#: A mapping of a cache's slots: ``slot(i)`` (slot ``i``, a writable ``uint8``
#: array), ``view`` (a memoryview of them all), ``shared_name``, ``close()``.
MappedSlots = SlotBuffer


def map_slots(name: str, num_slots: int, slot_bytes: int) -> MappedSlots:
    """Map the slots another process's cache keeps under ``name`` in shared memory.

    ``OSError`` if the name does not exist; ``ValueError`` if it holds other
    than ``num_slots`` slots of ``slot_bytes``.
    """
    check_str(name, "name")
    return SlotBuffer.attach(name, count(num_slots, "num_slots"), count(slot_bytes, "slot_bytes"))
