"""The primary tier's memory: one page-aligned buffer of fixed-size slots."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import sys
import threading
from collections.abc import Callable

import numpy as np

from kvtier.units import format_bytes

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
#: ``MADV_POPULATE_WRITE`` (Linux 5.14): maps pages writable, contents kept.
#: Python 3.11's ``mmap`` lacks the name; the value is the kernel's.
_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
#: Bytes mapped ahead between two looks at the stop flag, so that ``close()``
#: waits for one piece at most; advised, bytes per call, so that the process's
#: memory-map lock is never held long. One huge page.
_POPULATE_PIECE = 2 << 20
#: The populating thread's nice value: the lowest priority, so that it takes
#: only CPU time nothing else wants (in an engine, the model's).
_POPULATE_NICE = 19
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def _libc_madvise() -> Callable[..., int]:
    """libc's ``madvise`` through ctypes, which releases the interpreter lock
    during the call; CPython's ``mmap.madvise`` holds it. Holding
    it, the populating thread kept an engine's scheduler thread waiting up to
    a switch interval (5 ms) each time that thread wanted it back."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise() if _POPULATE_WRITE is not None else None


def _compiled_touch() -> Callable[..., None] | None:
    """The compiled :func:`touch_pages` (``_native/_slots.c``), or ``None``
    where kvtier was built without a C compiler."""
    try:
        from kvtier.primary._native._slots import touch_pages
    except ImportError:
        return None
    return touch_pages


_touch_pages = _compiled_touch()


def populate_now(region: mmap.mmap) -> bool:
    """Map every page of ``region`` writable now, contents kept, outside the
    interpreter lock (as the primary buffer's populating thread does);
    ``False`` where the kernel cannot (before Linux 5.14: pages map on first use)."""
    if _POPULATE_WRITE is None:
        return False
    try:
        # Exported while the kernel maps it: the region cannot be closed meanwhile.
        anchor = ctypes.c_char.from_buffer(region)
    except (TypeError, ValueError):  # read-only or closed
        return False
    try:
        _populate_pieces(ctypes.addressof(anchor), len(region))
    except OSError:
        return False
    finally:
        del anchor
    return True


def _populate_pieces(address: int, size: int, stop: bytearray | None = None) -> None:
    """``MADV_POPULATE_WRITE`` on ``size`` bytes at ``address``, a piece at a
    time (see :data:`_POPULATE_PIECE`), until done or ``stop[0]`` is set."""
    assert _POPULATE_WRITE is not None
    for start in range(0, size, _POPULATE_PIECE):
        if stop is not None and stop[0]:
            return
        _populate_range(address + start, min(_POPULATE_PIECE, size - start), _POPULATE_WRITE)


def _populate_range(address: int, length: int, advice: int) -> None:
    """``madvise`` a range without holding the interpreter lock."""
    if _madvise is None:
        raise OSError("madvise is not available here")
    if _madvise(address, length, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _lower_this_threads_priority() -> None:
    """Give the calling thread (Linux: priorities are per thread) the lowest priority."""
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: the process's priority stays
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _POPULATE_NICE)


def shared_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a buffer in ``/dev/shm``, or ``None`` if it can."""
    if not _NAME.match(name) or name.startswith("."):
        return "use 1-200 letters, digits, '_', '-' or '.', not starting with '.'"
    return None


def _shm_path(name: str) -> str:
    problem = shared_name_problem(name)
    if problem is not None:
        raise ValueError(f"shared memory name {name!r}: {problem}")
    return os.path.join(_SHM_DIR, name)


def _check_room(size: int) -> None:
    """Refuse a named buffer larger than the free space of ``/dev/shm``.

    Its pages are allocated as they are first written, and a write that
    finds no room there kills the process with ``SIGBUS``: a container's
    ``/dev/shm`` is 64 MiB unless it is given more.
    """
    stats = os.statvfs(_SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    if size > free:
        raise OSError(
            errno.ENOSPC,
            f"{_SHM_DIR} has {format_bytes(free)} free: give it more "
            "(a container's --shm-size) or ask for less",
        )


def _advise_huge_pages(region: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages
            region.madvise(advice)


class SlotBuffer:
    """``num_slots × slot_bytes`` bytes, private or in named shared memory.

    ``mmap`` hands out whole pages, so the buffer and every slot whose size is
    a multiple of the page size are page-aligned, as direct I/O requires.
    A named buffer lives in ``/dev/shm/NAME`` so an engine worker in another
    process can map the same slots with :meth:`attach`.

    Both ask for transparent huge pages, on which direct I/O moves a slot in
    far fewer DMA segments (docs/tuning.md, 'Memory for direct I/O').
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        shared_name: str | None = None,
        _attach: bool = False,
    ) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(
                f"need positive num_slots and slot_bytes, got {num_slots}, {slot_bytes}"
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.shared_name = shared_name
        self._owner = shared_name is not None and not _attach
        self._file: int | None = None  # a named buffer's file, open
        size = num_slots * slot_bytes
        if shared_name is None:
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            path = _shm_path(shared_name)
            if not _attach:
                _check_room(size)
            flags = os.O_RDWR if _attach else os.O_RDWR | os.O_CREAT | os.O_EXCL
            fd = os.open(path, flags, 0o600)
            try:
                if _attach:
                    if os.fstat(fd).st_size != size:
                        raise ValueError(
                            f"shared memory {shared_name!r} holds {os.fstat(fd).st_size} bytes, "
                            f"expected {num_slots} slots × {slot_bytes} bytes"
                        )
                else:
                    os.ftruncate(fd, size)
                self._mmap = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            if _attach:  # never mapped ahead: its creator does that
                os.close(fd)
            else:  # kept for mapping ahead, which allocates the file's pages first
                self._file = fd
        _advise_huge_pages(self._mmap)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_slots, slot_bytes)
        #: The contract handed to secondary tiers: shape ``(num_slots, slot_bytes)``.
        self.view = memoryview(self._mmap).cast("B", (num_slots, slot_bytes))
        self._populated = threading.Event()
        #: Set to 1 by :meth:`close`: the populating thread stops within a piece.
        self._stop_populating = bytearray(1)
        self._populator: threading.Thread | None = None
        # The slots found unbacked (see when_unbacked), and who retires them.
        self._unbacked_lock = threading.Lock()
        self._unbacked: list[int] = []
        self._retire: Callable[[list[int]], None] | None = None

    def populate_in_background(self) -> None:
        """Map every page of the buffer now, on a thread of its own, keeping
        what the pages hold (other processes may use a shared buffer already).

        Otherwise a promotion's direct reads fault the pages in, many threads
        at once and slowly (docs/tuning.md). The thread runs at the lowest
        priority, outside the interpreter lock while pages are mapped. Where
        it cannot map them (built without a C compiler, before Linux 5.14 as
        well), they are mapped on first use.
        """
        if self._populator is not None or (_touch_pages is None and _POPULATE_WRITE is None):
            self._populated.set()
            return
        self._populator = threading.Thread(
            target=self._populate, name="kvtier-primary-populate", daemon=True
        )
        self._populator.start()

    def _populate(self) -> None:
        size = len(self._mmap)
        try:
            _lower_this_threads_priority()
            self._map_ahead()
        except OSError as exc:
            # /dev/shm or memory ran out
            if exc.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
                unbacked = self._unbacked_slots()
                logger.warning(
                    "primary buffer: only part of its %s could be mapped ahead (%s): "
                    "the memory left to the machine or in %s is short%s",
                    format_bytes(size),
                    exc,
                    _SHM_DIR,
                    f"; {len(unbacked)} of its {self.num_slots} slots lack memory "
                    "and are taken out of use"
                    if unbacked
                    else "",
                )
                self._report_unbacked(unbacked)
            else:  # an older kernel: first use maps them
                logger.info("primary buffer not populated ahead: %s", exc)
        finally:
            self._populated.set()

    def _unbacked_slots(self) -> list[int]:
        """The slots of a named buffer that its file does not wholly back, in
        order: where ``/dev/shm`` ran out while mapping ahead, a first write
        there would kill the process with ``SIGBUS``. The file's holes, which
        hold every page not yet written, allocated but untouched ones too."""
        if self._file is None:
            return []
        size, slot_bytes = len(self._mmap), self.slot_bytes
        slots: list[int] = []
        offset = 0
        while offset < size:
            hole = os.lseek(self._file, offset, os.SEEK_HOLE)
            if hole >= size:
                break
            try:
                data = min(size, os.lseek(self._file, hole, os.SEEK_DATA))
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no data after the hole
                    raise
                data = size
            first = max(hole // slot_bytes, slots[-1] + 1 if slots else 0)
            slots.extend(range(first, (data - 1) // slot_bytes + 1))
            offset = data
        return slots

    def _report_unbacked(self, slots: list[int]) -> None:
        with self._unbacked_lock:
            self._unbacked = slots
            retire = self._retire
        if retire is not None and slots:
            retire(slots)

    def when_unbacked(self, retire: Callable[[list[int]], None]) -> None:
        """Have ``retire(slots)`` called, from the mapping thread, with the
        slots a named buffer's file could not be given memory for (a full
        ``/dev/shm``), which must never be written: at once for those found
        already. Mapping ahead finds them; nothing else does."""
        with self._unbacked_lock:
            self._retire = retire
            found = self._unbacked
        if found:
            retire(found)

    def _map_ahead(self) -> None:
        """Map every page, until done or :meth:`close` says stop.

        The pages are touched (compiled: a write each that keeps the page's
        contents), each fault holding a lock of this mapping only, and a
        named buffer's file is allocated a piece ahead, so that a full
        ``/dev/shm`` is an error to log, not ``SIGBUS``. ``MADV_POPULATE_WRITE``,
        the fallback, holds the process's memory-map lock instead, and at the
        lowest priority it is preempted holding it: every other thread's
        ``mmap`` (a new thread's stack, an allocator's arena) then waits for
        it (docs/tuning.md, 'A seventh day').
        """
        if _touch_pages is not None:
            file = -1 if self._file is None else self._file
            _touch_pages(self.array.reshape(-1), _POPULATE_PIECE, self._stop_populating, file)
        else:
            _populate_pieces(self.array.ctypes.data, len(self._mmap), self._stop_populating)

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Block until :meth:`populate_in_background` is done (for tools and benchmarks)."""
        return self._populated.wait(timeout)

    @classmethod
    def attach(cls, shared_name: str, num_slots: int, slot_bytes: int) -> SlotBuffer:
        """Map a named buffer another process created."""
        return cls(num_slots, slot_bytes, shared_name=shared_name, _attach=True)

    def slot(self, index: int) -> np.ndarray:
        """Slot ``index`` as a writable ``uint8`` array (no copy)."""
        return self.array[index]

    def unlink(self) -> None:
        """Remove a named buffer's name; every mapping of it stays valid.

        Once all processes that need the slots have mapped them, this makes
        sure a crashed process leaves nothing behind in ``/dev/shm``.
        """
        if self.shared_name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_shm_path(self.shared_name))
        # Once only: a later buffer of the same name belongs to someone else.
        self._owner = False

    def close(self) -> None:
        """Unmap; the creator of a named buffer also removes its name."""
        self._stop_populating[0] = 1
        if self._populator is not None:
            self._populator.join()  # at most one piece: never populate an unmapped range
        if self._file is not None:
            os.close(self._file)
            self._file = None
        self.view.release()
        del self.array
        # A caller may still hold a view into the slots; the mapping then
        # lives on until that view is dropped, which is safe.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        if self._owner:
            self.unlink()
