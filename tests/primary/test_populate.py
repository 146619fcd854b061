"""Mapping the primary buffer ahead, on a thread that stays out of the engine's way."""

import errno
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.primary import SlotBuffer
from kvtier.primary import buffer as buffer_module
from kvtier.primary.buffer import populate_now
from tests.primary.test_primary import resident_bytes

#: Whether kvtier's compiled parts were built (they touch private buffers' pages).
COMPILED = buffer_module._touch_pages is not None

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


@pytest.mark.parametrize("shared", [False, True], ids=["private", "named"])
def test_populating_runs_at_the_lowest_priority_and_keeps_what_the_pages_hold(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    priorities: list[int] = []
    map_ahead = SlotBuffer._map_ahead

    def recorded(buffer: SlotBuffer) -> None:
        priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        map_ahead(buffer)

    monkeypatch.setattr(SlotBuffer, "_map_ahead", recorded)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    buffer = SlotBuffer(4, 2 << 20, shared_name=f"kvtier-test-{os.getpid()}" if shared else None)
    try:
        buffer.array[1] = 7
        buffer.array[3, 4095:4097] = 9  # across a page boundary
        buffer.populate_in_background()
        assert buffer.wait_populated(60)
        assert priorities == [19]
        assert (buffer.array[1] == 7).all() and (buffer.array[3, 4095:4097] == 9).all()
        assert not buffer.array[[0, 2]].any() and buffer.array[3].sum() == 18
        assert resident_bytes(buffer._mmap) >= 8 << 20
    finally:
        buffer.close()
    # The caller's thread keeps its own.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


@pytest.mark.skipif(not COMPILED, reason="kvtier was built without a C compiler")
@pytest.mark.parametrize("shared", [False, True], ids=["private", "named"])
def test_a_buffer_is_mapped_by_touching_its_pages_not_by_madvise(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """``madvise`` would hold the process's memory-map lock, which every other
    thread's ``mmap`` waits for."""
    advised: list[int] = []
    monkeypatch.setattr(buffer_module, "_populate_range", lambda *args: advised.append(1))
    name = f"kvtier-test-{os.getpid()}" if shared else None
    buffer = SlotBuffer(3, 2 << 20, shared_name=name)
    try:
        buffer.populate_in_background()
        assert buffer.wait_populated(60)
        assert advised == [] and resident_bytes(buffer._mmap) >= 6 << 20
        if name is not None:  # the file's pages allocated, not only mapped
            assert os.stat(f"/dev/shm/{name}").st_blocks * 512 >= 6 << 20
    finally:
        buffer.close()


@pytest.mark.skipif(not COMPILED, reason="kvtier was built without a C compiler")
def test_touching_maps_every_page_a_view_overlaps_and_keeps_their_bytes() -> None:
    from kvtier.primary._native._slots import touch_pages

    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 8 * page)
    view = memoryview(region)
    try:
        region[page + 5] = 42  # page 1 mapped by this write, pages 2 and 3 not yet
        touch_pages(view[page + 100 : 4 * page - 1], page)  # from inside page 1 into page 3
        touch_pages(view[5 * page : 5 * page], page)  # empty: nothing
        touch_pages(view[4 * page :], page, bytearray(b"\x01"))  # told to stop: nothing more
        assert resident_bytes(region) == 3 * page
        assert region[page + 5] == 42 and bytes(region).count(0) == 8 * page - 1
        with pytest.raises(BufferError):
            touch_pages(bytes(page), page)  # type: ignore[arg-type]  # read-only
        with pytest.raises(ValueError, match="one-byte"):
            touch_pages(view, page, bytearray(2))
        with pytest.raises(ValueError, match="piece"):
            touch_pages(view, 0)
    finally:
        view.release()
        region.close()


@pytest.mark.skipif(not COMPILED, reason="kvtier was built without a C compiler")
def test_touching_a_files_mapping_allocates_each_piece_first(tmp_path: Path) -> None:
    """Where the file system has no room for a page, touching it would kill
    the process (``SIGBUS``): an allocation that fails is an ``OSError``."""
    from kvtier.primary._native._slots import touch_pages

    page = mmap.PAGESIZE
    path = tmp_path / "slots"
    with open(path, "w+b") as file:
        file.truncate(8 * page)
        region = mmap.mmap(file.fileno(), 8 * page)
        region[3] = 42
        assert os.stat(path).st_blocks * 512 < 8 * page  # a hole, but for the page written
        touch_pages(memoryview(region), 2 * page, bytearray(1), file.fileno())
        assert os.stat(path).st_blocks * 512 >= 8 * page
        assert region[3] == 42 and bytes(region).count(0) == 8 * page - 1
        region.close()
    with open(path, "rb") as read_only, mmap.mmap(-1, page) as other:
        with pytest.raises(OSError) as failed:  # cannot allocate through this descriptor
            touch_pages(memoryview(other), page, None, read_only.fileno())
        assert failed.value.errno == errno.EBADF
