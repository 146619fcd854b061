"""Textbook models of the built-in cache policies: plain lists, one step at a time.

Slow and obviously correct on purpose: each model does what the policy's
documentation says, victim by victim and key by key, with none of the
shortcuts the real policies take for speed (batched inserts, deferred ghost
trims, one-pass queue walks, group take-overs). ``tests/policies/test_policy_models.py``
drives a model and the real policy with the same calls and asserts identical
answers, so the real policies can be made faster without changing a choice.

Every model has the :class:`~kvtier.policies.CachePolicy` methods the primary
tier calls (``get``, ``insert``, ``insert_all``, ``remove``, ``touch``,
``evict``, ``clear``, ``len``, ``in``); ``insert_all`` is ``insert`` per key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence

from kvtier.keys import ChunkKey


class ModelPolicy(ABC):
    """What every model shares: ``insert_all`` as ``insert`` key by key."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def insert_all(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self.insert(key)

    def clear(self) -> None:
        """Forget everything: the state of a new model of the same capacity."""
        vars(self).update(vars(type(self)(self.capacity)))


def _oldest_unprotected(entries: list[ChunkKey], protected: Collection[ChunkKey]) -> int | None:
    """Index of the first key of ``entries`` outside ``protected``, if any."""
    for index, key in enumerate(entries):
        if key not in protected:
            return index
    return None


class LRUModel(ModelPolicy):
    """A list, least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: list[ChunkKey] = []

    def get(self, key: ChunkKey) -> bool:
        if key not in self.order:
            return False
        self.order.remove(key)
        self.order.append(key)
        return True

    def insert(self, key: ChunkKey) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    def remove(self, key: ChunkKey) -> None:
        if key in self.order:
            self.order.remove(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.get(key)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        victims = [key for key in self.order if key not in protected][:n]
        if len(victims) < n:
            return None
        for key in victims:
            self.order.remove(key)
        return victims

    def clear(self) -> None:
        self.order.clear()

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order


class ARCModel(ModelPolicy):
    """ARC: resident lists T1 (seen once) and T2 (seen again), ghosts B1 and B2.

    Insert and evict are separate calls (the primary tier evicts first), so
    REPLACE runs per victim in :meth:`evict`: from T1 while ``|T1| > p``,
    else from T2, and from the other list when protected keys exhaust one.
    A hit moves a key to T2's end; a ghost hit adapts ``p`` and enters T2; a
    new key enters T1 and the directory is trimmed (``|T1| + |B1| <= c``,
    all four ``<= 2c``, oldest ghosts first). Removal leaves no ghost.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: list[ChunkKey] = []
        self.t2: list[ChunkKey] = []
        self.b1: list[ChunkKey] = []
        self.b2: list[ChunkKey] = []
        self.p = 0

    def get(self, key: ChunkKey) -> bool:
        for resident in (self.t1, self.t2):
            if key in resident:
                resident.remove(key)
                self.t2.append(key)
                return True
        return False

    def insert(self, key: ChunkKey) -> None:
        if self.get(key):
            return
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(1, len(self.b2) // len(self.b1)))
            self.b1.remove(key)
            self.t2.append(key)
        elif key in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // len(self.b2)))
            self.b2.remove(key)
            self.t2.append(key)
        else:
            self.t1.append(key)
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while len(self.t1) + len(self.b1) > self.capacity and self.b1:
            del self.b1[0]
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            if not self.b2:
                break
            del self.b2[0]

    def remove(self, key: ChunkKey) -> None:
        for resident in (self.t1, self.t2):
            if key in resident:
                resident.remove(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.get(key)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        t1, t2 = list(self.t1), list(self.t2)
        b1, b2 = list(self.b1), list(self.b2)
        victims: list[ChunkKey] = []
        for _ in range(n):
            in_t1 = _oldest_unprotected(t1, protected)
            in_t2 = _oldest_unprotected(t2, protected)
            if in_t1 is not None and (len(t1) > self.p or in_t2 is None):
                victim = t1.pop(in_t1)
                b1.append(victim)
            elif in_t2 is not None:
                victim = t2.pop(in_t2)
                b2.append(victim)
            else:
                return None  # the copies are dropped: nothing changed
            victims.append(victim)
        self.t1, self.t2, self.b1, self.b2 = t1, t2, b1, b2
        self._trim_ghosts()
        return victims

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


MAX_FREQ = 3


class S3FIFOModel(ModelPolicy):
    """S3-FIFO: a small FIFO (a tenth of the capacity, at least 1), a main FIFO,
    a ghost FIFO of keys evicted from small (bounded by the capacity).

    An access raises a resident key's frequency, saturating at 3. A new key
    enters small, a ghost one main, each with frequency 0. Per victim: small's
    turn while ``|small| >= small share`` (counting protected keys set aside),
    else main's; the other queue when the first has no victim. Small's head:
    accessed, it moves to main's tail (frequency kept); else it is the victim
    and leaves a ghost. Main's head: frequency left, it is re-queued at the
    tail with one less; else the victim. A protected key at a head is set
    aside; when the eviction ends, set-aside keys return to their queue's
    head in the order they were met. Atomic: possible exactly when ``n`` keys
    are unprotected, else nothing changes.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_capacity = max(1, capacity // 10)
        self.small: list[ChunkKey] = []
        self.main: list[ChunkKey] = []
        self.ghost: list[ChunkKey] = []
        self.freq: dict[ChunkKey, int] = {}

    def get(self, key: ChunkKey) -> bool:
        if key not in self.freq:
            return False
        self.freq[key] = min(MAX_FREQ, self.freq[key] + 1)
        return True

    def insert(self, key: ChunkKey) -> None:
        if self.get(key):
            return
        if key in self.ghost:
            self.ghost.remove(key)
            self.main.append(key)
        else:
            self.small.append(key)
        self.freq[key] = 0

    def remove(self, key: ChunkKey) -> None:
        if self.freq.pop(key, None) is not None:
            for queue in (self.small, self.main):
                if key in queue:
                    queue.remove(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.get(key)

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        if sum(key not in protected for key in self.small + self.main) < n:
            return None
        held_small: list[ChunkKey] = []
        held_main: list[ChunkKey] = []
        victims: list[ChunkKey] = []
        while len(victims) < n:
            if len(self.small) + len(held_small) >= self.small_capacity:
                victim = self._from_small(protected, held_small)
                if victim is None:
                    victim = self._from_main(protected, held_main)
            else:
                victim = self._from_main(protected, held_main)
                if victim is None:
                    victim = self._from_small(protected, held_small)
            if victim is not None:
                victims.append(victim)
            # else: small promoted all it had into main; main's turn next
        self.small[:0] = held_small
        self.main[:0] = held_main
        return victims

    def _from_small(self, protected: Collection[ChunkKey], held: list[ChunkKey]) -> ChunkKey | None:
        while self.small:
            key = self.small.pop(0)
            if key in protected:
                held.append(key)
            elif self.freq[key] > 0:
                self.main.append(key)
            else:
                del self.freq[key]
                self.ghost.append(key)
                if len(self.ghost) > self.capacity:
                    del self.ghost[0]
                return key
        return None

    def _from_main(self, protected: Collection[ChunkKey], held: list[ChunkKey]) -> ChunkKey | None:
        while self.main:
            key = self.main.pop(0)
            if key in protected:
                held.append(key)
            elif self.freq[key] > 0:
                self.freq[key] -= 1
                self.main.append(key)
            else:
                del self.freq[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: object) -> bool:
        return key in self.freq


class LeafFirstLRUModel(ModelPolicy):
    """Leaf-first LRU: groups of keys, least recently used group first.

    Each group holds keys oldest first and is *announced* (a request's: it
    gives up its newest keys first) or not (inserts no eviction announced:
    oldest first, as LRU). The last group is the current one.

    * ``touch(keys)`` opens a new announced group and moves each tracked key
      into it, in order (a key met twice moves to its end again); it ends any
      announcement, and remembers the group and its size.
    * ``evict(n)`` takes victims group by group; then, unless the current
      group is still the one the last touch opened, at the size it had then,
      it opens a new announced group; the next ``n`` inserts are announced.
    * ``insert`` of an announced key joins the current group; an unannounced
      one joins the current group if that is unannounced, else opens one. A
      key tracked in another group moves; one already in the current group
      stays where it is.
    * ``get`` of a tracked key is a ``touch`` of it alone.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # [keys oldest first, announced]; the current group is the last one
        # opened (after clear: one not in this list, which nothing can join).
        self.groups: list[tuple[list[ChunkKey], bool]] = []
        self.current: tuple[list[ChunkKey], bool] = ([], True)
        self.announced = 0
        self.touched: tuple[list[ChunkKey], int] | None = None

    def _open(self, announced: bool) -> None:
        # Empty groups decide nothing: dropped, to keep the model quick.
        self.groups = [group for group in self.groups if group[0]]
        self.current = ([], announced)
        self.groups.append(self.current)

    def _group_of(self, key: ChunkKey) -> list[ChunkKey] | None:
        for keys, _ in self.groups:
            if key in keys:
                return keys
        return None

    def get(self, key: ChunkKey) -> bool:
        if self._group_of(key) is None:
            return False
        self.touch([key])
        return True

    def insert(self, key: ChunkKey) -> None:
        if self.announced:
            self.announced -= 1
        elif self.current[1]:
            self._open(announced=False)
        current = self.current[0]
        group = self._group_of(key)
        if group is current:
            return
        if group is not None:
            group.remove(key)
        current.append(key)

    def remove(self, key: ChunkKey) -> None:
        group = self._group_of(key)
        if group is not None:
            group.remove(key)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        self.announced = 0
        self._open(announced=True)
        current = self.current[0]
        for key in keys:
            group = self._group_of(key)
            if group is not None:
                group.remove(key)
                current.append(key)
        self.touched = (current, len(current))

    def evict(self, n: int, protected: Collection[ChunkKey]) -> list[ChunkKey] | None:
        if n <= 0:
            return []
        victims: list[ChunkKey] = []
        for keys, announced in self.groups:
            for key in reversed(keys) if announced else keys:
                if key not in protected and len(victims) < n:
                    victims.append(key)
        if len(victims) < n:
            return None
        for key in victims:
            self.remove(key)
        touched = self.touched
        if touched is None or touched[0] is not self.current[0] or touched[1] != len(touched[0]):
            self._open(announced=True)
        self.touched = None
        self.announced = n
        return victims

    def __len__(self) -> int:
        return sum(len(keys) for keys, _ in self.groups)

    def __contains__(self, key: object) -> bool:
        return any(key in keys for keys, _ in self.groups)


MODELS: dict[str, type[ModelPolicy]] = {
    "lru": LRUModel,
    "arc": ARCModel,
    "s3fifo": S3FIFOModel,
    "leaf-lru": LeafFirstLRUModel,
}
