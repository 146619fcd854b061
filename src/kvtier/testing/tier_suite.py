"""The secondary tier contract, as tests any tier can inherit.

Both the harness and the suite are generic over the tier type, so a test
reaches what its tier adds (``TierHarness[RedisTier]``,
``TierContractTests[RedisTier]``) with the type checked when it is built.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ClassVar, Generic, cast, get_args, get_origin

import numpy as np
import pytest
from typing_extensions import TypeVar

from kvtier.codecs.samples import kv_like
from kvtier.config import load_config
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.layout import KVLayout
from kvtier.primary import SlotBuffer
from kvtier.specs.tiering import TieringSpec
from kvtier.testing import stored
from kvtier.testing.hang_guard import DEFAULT_CALL_TIMEOUT_S, HangGuard
from kvtier.tiers.base import JobResult, Lookup, SecondaryTier, TransferJob
from kvtier.tiers.drive import resolve_lookup, run_job
from kvtier.tiers.factory import SecondaryTierFactory

#: The type of the tier under test; a plain ``TierHarness`` is one over any
#: tier, and one over a ``FilesystemTier`` is one over a ``SecondaryTier`` too.
T = TypeVar("T", bound=SecondaryTier, default=SecondaryTier, covariant=True)


def small_layout(
    chunk_tokens: int = 16,
    model_id: str = "kvtier-test",
    head_dim: int = 64,
    dtype: str = "float16",
) -> KVLayout:
    """A tiny real layout: 2 layers, 2 KV heads (8 KiB chunks by default)."""
    return KVLayout(
        model_id=model_id,
        num_layers=2,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )


class TierHarness(Generic[T]):
    """A tier over its own primary buffer, with helpers to move random chunks.

    With ``tier_class`` the built tier must be one (``TypeError`` otherwise),
    and :attr:`tier` is typed as such.

    Every call the helpers make into the tier, its constructor included, runs
    under a :class:`~kvtier.testing.hang_guard.HangGuard`: one that does not
    return within ``call_timeout_s`` fails the test, naming the tier class and
    the method. ``call_timeout_s`` also bounds the wait for a job's result or
    a lookup's answer.
    """

    def __init__(
        self,
        tier_config: dict[str, Any],
        layout: KVLayout,
        num_slots: int = 32,
        *,
        tier_class: type[T] | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ):
        config = load_config(
            {
                "chunk_tokens": layout.chunk_tokens,
                "cpu_bytes_to_use": num_slots * layout.slot_bytes,
                "secondary_tiers": [tier_config],
            }
        )
        entry = config.secondary_tiers[0]
        self.layout = layout
        self.call_timeout_s = call_timeout_s
        self.guard = HangGuard(entry.tier_class, call_timeout_s)
        self.buffer = SlotBuffer(num_slots, layout.slot_bytes)
        self.spec = TieringSpec(config, layout)
        try:
            tier = self.guard(
                "__init__",
                lambda: SecondaryTierFactory.build_secondary_tier(
                    entry.tier_class,
                    entry.tier_type,
                    entry.options,
                    self.buffer.view,
                    self.spec,
                    codec=entry.codec,
                ),
            )
        except BaseException:
            self.buffer.close()
            raise
        if tier_class is not None and not isinstance(tier, tier_class):
            self.guard("shutdown", tier.shutdown)
            self.buffer.close()
            raise TypeError(
                f"tier_config built a {type(tier).__qualname__}, "
                f"not the {tier_class.__qualname__} the harness was asked for"
            )
        # Without tier_class, T is its default: any SecondaryTier.
        self.tier: T = cast(T, tier)
        self.rng = np.random.default_rng(1234)

    def keys(self, n: int) -> list[ChunkKey]:
        tokens = self.rng.integers(0, 2**31, n * self.layout.chunk_tokens)
        return chunk_keys(self.layout.namespace, tokens, self.layout.chunk_tokens)

    def fill(self, slots: range | list[int]) -> np.ndarray:
        """Random bytes into ``slots``; returns a copy of what was written."""
        data = self.rng.integers(0, 256, (len(slots), self.layout.slot_bytes), dtype=np.uint8)
        self.buffer.array[list(slots)] = data
        return data

    def store(self, keys: list[ChunkKey], slots: list[int]) -> JobResult:
        """Store ``keys`` from ``slots``; wait for the result."""
        return self._run(TransferJob(tuple(keys), tuple(slots)), loading=False)

    def load(self, keys: list[ChunkKey], slots: list[int]) -> JobResult:
        """Load ``keys`` into ``slots``; wait for the result."""
        return self._run(TransferJob(tuple(keys), tuple(slots)), loading=True)

    def lookup(self, key: ChunkKey) -> Lookup:
        """Ask until the tier answers HIT or MISS."""
        return resolve_lookup(self.tier, key, timeout=self.call_timeout_s, invoke=self.guard)

    def submit_store(self, job: TransferJob) -> None:
        """Submit ``job`` without waiting for its result."""
        self.guard("submit_store", lambda: self.tier.submit_store(job))

    def finished_jobs(self) -> list[JobResult]:
        return self.guard("get_finished_jobs", self.tier.get_finished_jobs)

    def drain(self) -> None:
        self.guard("drain", self.tier.drain)

    def shutdown(self) -> None:
        self.guard("shutdown", self.tier.shutdown)

    def close(self) -> None:
        """Shut the tier down (even after a hang: that may release it), free the buffer."""
        try:
            self.shutdown()
        finally:
            self.buffer.close()

    def _run(self, job: TransferJob, *, loading: bool) -> JobResult:
        return run_job(
            self.tier, job, loading=loading, timeout=self.call_timeout_s, invoke=self.guard
        )


#: A codec of varying sizes: every tier that takes codecs must store it.
VARIABLE_SIZE_CODEC = "lossless"

#: What a tier that cannot store that codec says when it refuses it at start.
_CODEC_REFUSALS = ("does not take a codec", "stores fixed-size values")


def codec_layout() -> KVLayout:
    """bf16 chunks of 64 KiB: large enough that ``lossless`` saves whole pages."""
    return small_layout(chunk_tokens=64, dtype="bfloat16")


class TierContractTests(Generic[T]):
    """Inherit and set :attr:`tier_config` (and optionally override fixtures).

    Inherit ``TierContractTests[YourTier]`` for a harness typed (and checked)
    as one over ``YourTier``; a plain ``TierContractTests`` takes any tier.

    The suite also stores chunks of a variable-size codec (``lossless``):
    byte-exact round trips in fewer stored bytes, and a torn chunk or one
    whose length is damaged never served. A tier that takes no codec must
    refuse one at start."""

    #: The ``secondary_tiers`` entry that builds the tier under test.
    tier_config: ClassVar[dict[str, Any]] = {}
    #: Whether stored chunks are still there after the tier restarts.
    persistent: ClassVar[bool] = False
    #: Seconds any one call into the tier may take before the test fails as
    #: hung, naming the method. A hang guard, not a speed check: raise it for
    #: a backend that is that slow.
    call_timeout_s: ClassVar[float] = DEFAULT_CALL_TIMEOUT_S

    def make_config(self) -> dict[str, Any]:
        """The tier entry; override to use fixtures (``tmp_path``, a server URL)."""
        return dict(self.tier_config)

    @classmethod
    def tier_class(cls) -> type[T] | None:
        """The tier type the suite was given (``TierContractTests[RedisTier]``), if any."""
        for klass in cls.__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                if get_origin(base) is TierContractTests:
                    tier_class = get_args(base)[0]
                    if isinstance(tier_class, type):
                        return tier_class
        return None

    def make_harness(self) -> TierHarness[T]:
        """A harness over the tier :meth:`make_config` describes."""
        return TierHarness(
            self.make_config(),
            small_layout(),
            tier_class=self.tier_class(),
            call_timeout_s=self.call_timeout_s,
        )

    def read_stored(self, harness: TierHarness, key: ChunkKey) -> bytes:
        """The bytes the tier's backend holds for ``key``; override for a
        tier of your own (the built-in tiers' are known). The damage tests
        that need it skip, saying so, for a tier that has none."""
        try:
            return harness.guard("read_stored", lambda: stored.read_stored(harness.tier, key))
        except NotImplementedError as exc:
            pytest.skip(f"{exc}: override read_stored and write_stored to run this test")

    def write_stored(self, harness: TierHarness, key: ChunkKey, value: bytes) -> None:
        """Make the tier's backend hold ``value`` for ``key``; override with
        :meth:`read_stored`."""
        harness.guard("write_stored", lambda: stored.write_stored(harness.tier, key, value))

    def length_offset(self, harness: TierHarness, value: bytes) -> int:
        """Where the payload length sits in a stored ``value``; override with
        :meth:`read_stored` for a tier that frames values its own way."""
        return stored.length_offset(harness.tier, value)

    @pytest.fixture
    def harness(self) -> Iterator[TierHarness[T]]:
        harness = self.make_harness()
        yield harness
        harness.close()

    def test_store_lookup_load_is_byte_exact(self, harness: TierHarness[T]) -> None:
        keys = harness.keys(4)
        data = harness.fill(range(4))
        stored = harness.store(keys, [0, 1, 2, 3])
        assert stored.success and stored.succeeded == frozenset(keys)
        harness.drain()
        assert [harness.lookup(k) for k in keys] == [Lookup.HIT] * 4
        harness.buffer.array[4:8] = 0
        loaded = harness.load(keys, [4, 5, 6, 7])
        assert loaded.success and loaded.succeeded == frozenset(keys)
        assert loaded.nbytes == 4 * harness.layout.slot_bytes
        np.testing.assert_array_equal(harness.buffer.array[4:8], data)

    def test_unknown_key_is_a_miss(self, harness: TierHarness[T]) -> None:
        assert harness.lookup(harness.keys(1)[0]) is Lookup.MISS

    def test_partial_load_reports_the_keys_that_made_it(self, harness: TierHarness[T]) -> None:
        present, absent = harness.keys(2)
        harness.fill([0])
        assert harness.store([present], [0]).success
        harness.drain()
        result = harness.load([present, absent], [1, 2])
        assert not result.success
        assert result.succeeded == frozenset([present])
        np.testing.assert_array_equal(harness.buffer.array[1], harness.buffer.array[0])

    def test_storing_a_held_chunk_again_succeeds(self, harness: TierHarness[T]) -> None:
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        harness.drain()
        again = harness.store(keys, [0, 1])
        assert again.success and again.succeeded == frozenset(keys)

    def test_a_slot_outside_the_primary_view_fails_its_chunk(self, harness: TierHarness[T]) -> None:
        beyond = len(harness.buffer.array)
        key, other = harness.keys(2)
        stored = harness.store([key], [beyond])
        assert not stored.success and stored.succeeded == frozenset()
        harness.drain()
        harness.fill([0])
        assert harness.store([other], [0]).success
        harness.drain()
        loaded = harness.load([other], [beyond])
        assert not loaded.success and loaded.succeeded == frozenset()

    def test_each_result_is_reported_once(self, harness: TierHarness[T]) -> None:
        keys = harness.keys(1)
        harness.fill([0])
        harness.store(keys, [0])
        harness.drain()
        assert harness.finished_jobs() == []

    def test_slots_are_not_touched_after_drain(self, harness: TierHarness[T]) -> None:
        keys = harness.keys(8)
        harness.fill(range(8))
        harness.submit_store(TransferJob(tuple(keys), tuple(range(8))))
        harness.drain()
        results = harness.finished_jobs()
        assert len(results) == 1 and results[0].success
        # Stored copies must be independent of the slots they came from.
        expected = harness.buffer.array[:8].copy()
        harness.buffer.array[:8] = 0
        assert harness.load(keys, list(range(8, 16))).success
        np.testing.assert_array_equal(harness.buffer.array[8:16], expected)

    def test_a_tier_that_announces_progress_announces_each_finished_job(
        self, harness: TierHarness[T]
    ) -> None:
        announced = threading.Event()
        if not harness.guard(
            "set_progress_listener", lambda: harness.tier.set_progress_listener(announced.set)
        ):
            return  # polled instead: nothing promised
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        # A lookup waiting for a promotion is woken by this, not by a poll.
        assert announced.is_set()
        announced.clear()
        assert harness.load(keys, [2, 3]).success
        assert announced.is_set()

    def test_rejects_unknown_options(self) -> None:
        from kvtier.errors import ConfigError

        config = {**self.make_config(), "no_such_option_xyz": 1}
        with pytest.raises(ConfigError, match="no_such_option_xyz"):
            load_config({"secondary_tiers": [config]})

    def test_shutdown_is_idempotent(self) -> None:
        harness = self.make_harness()
        harness.shutdown()
        harness.close()  # shuts down again

    def test_restart_keeps_chunks_exactly_when_persistent(self) -> None:
        first = self.make_harness()
        keys = first.keys(2)
        data = first.fill([0, 1])
        assert first.store(keys, [0, 1]).success
        first.close()
        second = self.make_harness()
        try:
            if not self.persistent:
                assert [second.lookup(k) for k in keys] == [Lookup.MISS] * 2
                return
            assert [second.lookup(k) for k in keys] == [Lookup.HIT] * 2
            assert second.load(keys, [2, 3]).success
            np.testing.assert_array_equal(second.buffer.array[2:4], data)
        finally:
            second.close()

    # Chunks of a variable-size codec ---------------------------------------

    def make_codec_harness(self) -> TierHarness | None:
        """A harness of the tier under ``lossless``; ``None`` once checked
        that the tier refuses it at start, saying why: it takes no codec, or
        stores values of one size only."""
        config = {**self.make_config(), "codec": VARIABLE_SIZE_CODEC}
        try:
            return TierHarness(config, codec_layout(), 8, call_timeout_s=self.call_timeout_s)
        except ValueError as exc:
            if not any(why in str(exc) for why in _CODEC_REFUSALS):
                raise
            return None

    @contextlib.contextmanager
    def _codec_harness(self, *, holding: bool = False) -> Iterator[TierHarness | None]:
        """:meth:`make_codec_harness`, closed afterwards; with ``holding``,
        ``None`` too for a tier that keeps nothing it is given to store."""
        harness = self.make_codec_harness()
        if harness is None:
            yield None
            return
        try:
            yield None if holding and not harness.tier.holds_stores else harness
        finally:
            harness.close()

    def _stored_chunks(self, harness: TierHarness, n: int) -> tuple[list[ChunkKey], np.ndarray]:
        keys = harness.keys(n)
        data = np.stack(
            [np.frombuffer(kv_like(harness.layout, seed), np.uint8) for seed in range(n)]
        )
        harness.buffer.array[:n] = data
        assert harness.store(keys, list(range(n))).success
        harness.drain()
        return keys, data

    def test_variable_size_chunks_round_trip_byte_exact_in_fewer_bytes(self) -> None:
        with self._codec_harness() as harness:
            if harness is None:
                return  # refused at start, with the reason
            keys, data = self._stored_chunks(harness, 4)
            assert [harness.lookup(k) for k in keys] == [Lookup.HIT] * 4
            harness.buffer.array[4:8] = 0xA5
            loaded = harness.load(keys, [4, 5, 6, 7])
            assert loaded.success and loaded.succeeded == frozenset(keys)
            np.testing.assert_array_equal(harness.buffer.array[4:8], data)
            stats = harness.tier.stats
            assert stats.codec_bytes_out < stats.codec_bytes_in == 4 * harness.layout.slot_bytes
            if harness.tier.holds_stores and stored.knows(harness.tier):
                sizes = [len(self.read_stored(harness, key)) for key in keys]
                assert max(sizes) < harness.layout.slot_bytes, sizes  # headers included

    def _assert_never_served(
        self, harness: TierHarness, damaged: dict[ChunkKey, bytes], intact: ChunkKey
    ) -> None:
        """``damaged`` (key: the value planted for it) all load as misses,
        leave their slots as they were and are counted; ``intact`` loads."""
        # Counted from before they are planted: a tier may find one damaged
        # by itself first (a re-index), and count it then.
        before = harness.tier.stats.corrupt_chunks
        for key, value in damaged.items():
            self.write_stored(harness, key, value)
        keys = [*damaged, intact]
        slots = list(range(len(keys)))
        harness.buffer.array[slots] = 0x5A
        loaded = harness.load(keys, slots)
        assert loaded.succeeded == frozenset([intact])
        assert (harness.buffer.array[slots[:-1]] == 0x5A).all()  # never written
        assert harness.tier.stats.corrupt_chunks - before == len(damaged)
        harness.drain()
        assert [harness.lookup(key) for key in damaged] == [Lookup.MISS] * len(damaged)

    def test_a_torn_variable_size_chunk_is_a_counted_miss(self) -> None:
        with self._codec_harness(holding=True) as harness:
            if harness is None:
                return  # refused at start (saying why), or keeps nothing to damage
            keys, _ = self._stored_chunks(harness, 4)
            value = self.read_stored(harness, keys[0])
            # Cut at a page, mid-payload and just short of the end: each a
            # plausible length for a shorter chunk of the same codec.
            cuts = (4096, len(value) // 2, len(value) - 1)
            damaged = {key: value[:cut] for key, cut in zip(keys, cuts, strict=False)}
            self._assert_never_served(harness, damaged, keys[3])

    def test_a_damaged_length_is_a_counted_miss(self) -> None:
        with self._codec_harness(holding=True) as harness:
            if harness is None:
                return  # refused at start (saying why), or keeps nothing to damage
            keys, _ = self._stored_chunks(harness, 4)
            damaged = {}
            # Shorter by a page, longer by a page, and the size a chunk of
            # a fixed-size codec would have: none may be read as a chunk.
            for key, claim in zip(keys, (-4096, 4096, None), strict=False):
                value = bytearray(self.read_stored(harness, key))
                at = self.length_offset(harness, bytes(value))
                held = int.from_bytes(value[at : at + 8], "little")
                length = harness.tier.stored_bytes if claim is None else held + claim
                assert length != held
                value[at : at + 8] = length.to_bytes(8, "little")
                damaged[key] = bytes(value)
            self._assert_never_served(harness, damaged, keys[3])
