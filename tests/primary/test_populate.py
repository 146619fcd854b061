"""Mapping the primary buffer ahead, on a thread that stays out of the engine's way."""

import mmap
import os
import sys
import threading
from collections.abc import Iterator

import pytest

from kvtier.primary import SlotBuffer
from kvtier.primary import buffer as buffer_module
from kvtier.primary.buffer import populate_now

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="MADV_POPULATE_WRITE and per-thread priorities are Linux's",
)


@pytest.fixture
def no_forced_switches() -> Iterator[None]:
    """A thread holding the interpreter lock keeps it until it lets it go itself."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_populating_lets_go_of_the_interpreter_lock(no_forced_switches: None) -> None:
    buffer = SlotBuffer(64, 2 << 20)  # 128 MiB: many pieces, each a call into the kernel
    try:
        buffer.populate_in_background()
        # Starting the thread handed it the lock. Had it kept the lock
        # through its kernel calls, this thread would only get here once
        # every piece was mapped.
        assert not buffer.wait_populated(0)
        assert buffer.wait_populated(60)
    finally:
        buffer.close()


def test_populating_a_region_now_lets_go_of_the_interpreter_lock(
    no_forced_switches: None,
) -> None:
    region = mmap.mmap(-1, 128 << 20)  # many pieces, each a call into the kernel
    mapped: list[bool] = []
    try:
        thread = threading.Thread(target=lambda: mapped.append(populate_now(region)))
        thread.start()
        # As above: the populating thread let go of the lock in the kernel.
        assert not mapped
        thread.join()
        assert mapped == [True]
        assert region[:16] == bytes(16)
    finally:
        region.close()  # no export of it outlives the call


def test_populating_runs_at_the_lowest_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    priorities: list[int] = []
    populate = buffer_module._populate_range

    def recorded(address: int, length: int, advice: int) -> None:
        priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        populate(address, length, advice)

    monkeypatch.setattr(buffer_module, "_populate_range", recorded)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    buffer = SlotBuffer(4, 2 << 20)
    try:
        buffer.array[1] = 7
        buffer.populate_in_background()
        assert buffer.wait_populated(60)
        assert len(priorities) == 4 and set(priorities) == {19}
        assert (buffer.array[1] == 7).all() and not buffer.array[[0, 2, 3]].any()
    finally:
        buffer.close()
    # The caller's thread keeps its own.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
