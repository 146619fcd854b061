"""The fs tier's chunk-file system calls, in each implementation (compiled and Python)."""

from __future__ import annotations

import errno
import mmap
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier import integrity
from kvtier.errors import CorruptChunkError
from kvtier.layout import KEY_BYTES
from kvtier.tiers.fs import io

pytestmark = pytest.mark.usefixtures("chunk_io")

PAYLOAD = 3 * 4096


def _pages(size: int, fill: int = 0) -> memoryview:
    region = mmap.mmap(-1, size)
    region.write(bytes([fill]) * size)
    return memoryview(region)


def _summed(trailer: bytes, payload: bytes | memoryview) -> bytes:
    """``trailer`` with the checksum of ``payload`` where the packed header holds it."""
    start = integrity.DIGEST_OFFSET
    return trailer[:start] + integrity.checksum(payload) + trailer[start + 16 :]


def test_store_then_load_moves_every_byte_and_the_checksum(tmp_path: Path) -> None:
    payload, trailer = _pages(PAYLOAD, 7), _pages(4096, 9)
    final = str(tmp_path / "chunk")
    assert io._store_file(final + ".tmp", final, payload, trailer, False, True) is True
    assert os.listdir(tmp_path) == ["chunk"]
    assert Path(final).read_bytes() == b"\x07" * PAYLOAD + _summed(b"\x09" * 4096, payload)
    out, back = _pages(PAYLOAD), _pages(4096)
    assert io._load_file(final, out, back, False, 60.0) == (
        PAYLOAD + 4096,
        integrity.checksum(payload),
    )
    assert bytes(out) == bytes(payload) and bytes(back) == bytes(trailer)


def test_a_load_sums_what_it_read_not_what_the_trailer_says(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    payload = os.urandom(PAYLOAD)
    path.write_bytes(payload + bytes(4096))  # no checksum in the trailer at all
    out = _pages(PAYLOAD)
    done, digest = io._load_file(str(path), out, _pages(4096), False, 60.0)
    assert (done, digest) == (PAYLOAD + 4096, integrity.checksum(payload))


def test_direct_io_round_trip_where_the_filesystem_takes_it(tmp_path: Path) -> None:
    if io.probe_direct_io(str(tmp_path / ".probe")) is not None:
        pytest.skip(f"O_DIRECT is not available in {tmp_path}")
    payload, trailer = _pages(PAYLOAD, 3), _pages(4096, 4)
    final = str(tmp_path / "chunk")
    io._store_file(final + ".tmp", final, payload, trailer, True, False)
    out, back = _pages(PAYLOAD), _pages(4096)
    assert io._load_file(final, out, back, True, 60.0) == (
        PAYLOAD + 4096,
        integrity.checksum(payload),
    )
    assert bytes(out) == bytes(payload)


def test_a_complete_file_of_the_chunk_is_not_written_again(tmp_path: Path) -> None:
    final = tmp_path / "chunk"
    final.write_bytes(b"s" * (PAYLOAD + 4096))  # stored by another writer
    payload, trailer = _pages(PAYLOAD, 1), _pages(4096, 2)
    assert io._store_file(str(final) + ".tmp", str(final), payload, trailer, False, False) is False
    assert final.read_bytes() == b"s" * (PAYLOAD + 4096) and os.listdir(tmp_path) == ["chunk"]
    assert bytes(trailer) == b"\x02" * 4096  # not even hashed
    final.write_bytes(b"s" * 100)  # not a complete chunk file: replaced
    assert io._store_file(str(final) + ".tmp", str(final), payload, trailer, False, False) is True
    assert final.read_bytes() == b"\x01" * PAYLOAD + _summed(b"\x02" * 4096, payload)


def test_a_short_file_reads_short_and_unsummed(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 5000)
    out, back = _pages(PAYLOAD), _pages(4096)
    assert io._load_file(str(path), out, back, False, 60.0) == (5000, None)


@pytest.mark.parametrize("extra", [1, 4096, 1 << 20])
def test_a_file_longer_than_a_chunk_is_not_read_and_gives_its_size(
    tmp_path: Path, extra: int
) -> None:
    path = tmp_path / "long"
    path.write_bytes(b"x" * (PAYLOAD + 4096 + extra))
    out, back = _pages(PAYLOAD, 5), _pages(4096, 6)
    assert io._load_file(str(path), out, back, False, 60.0) == (PAYLOAD + 4096 + extra, None)
    assert bytes(out) == b"\x05" * PAYLOAD and bytes(back) == b"\x06" * 4096


def test_a_missing_file_is_file_not_found_naming_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "gone")
    with pytest.raises(FileNotFoundError) as caught:
        io._load_file(missing, _pages(PAYLOAD), _pages(4096), False, 60.0)
    assert caught.value.filename == missing


def test_a_store_into_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    final = str(tmp_path / "ab" / "chunk")
    with pytest.raises(FileNotFoundError):
        io._store_file(final + ".tmp", final, _pages(PAYLOAD), _pages(4096), False, False)
    assert os.listdir(tmp_path) == []


def test_a_failed_rename_removes_the_temp_file_and_names_the_target(tmp_path: Path) -> None:
    final = tmp_path / "chunk"
    (final / "occupied").mkdir(parents=True)  # a non-empty directory where the file goes
    with pytest.raises(OSError) as caught:
        io._store_file(str(final) + ".tmp", str(final), _pages(PAYLOAD), _pages(4096), False, False)
    assert caught.value.filename in (str(final), str(final) + ".tmp")
    assert sorted(os.listdir(tmp_path)) == ["chunk"]


def test_an_existing_temp_file_is_never_overwritten(tmp_path: Path) -> None:
    temp = tmp_path / "chunk.tmp"
    temp.write_bytes(b"another writer")
    with pytest.raises(FileExistsError):
        io._store_file(
            str(temp), str(tmp_path / "chunk"), _pages(PAYLOAD), _pages(4096), False, False
        )
    assert temp.read_bytes() == b"another writer"


def test_a_load_stamps_the_use_time_of_a_file_unused_for_a_while(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"y" * (PAYLOAD + 4096))
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    io._load_file(str(path), _pages(PAYLOAD), _pages(4096), False, 7200.0)
    assert path.stat().st_mtime == pytest.approx(hour_ago)  # used within the window
    io._load_file(str(path), _pages(PAYLOAD), _pages(4096), False, 60.0)
    assert path.stat().st_mtime > time.time() - 60


def test_the_compiled_implementation_is_built() -> None:
    if "compiled" in io.IMPLEMENTATIONS:
        assert io.IMPLEMENTATION == "compiled"
        assert io.COMPILED_CHECKSUM  # python-xxhash's XXH3 was found and agrees
    elif os.environ.get("CI"):
        pytest.fail("CI builds kvtier with a C compiler, but its compiled fs chunk I/O is missing")
    else:
        pytest.skip("kvtier was built without a C compiler: the fs tier does its I/O in Python")


def test_a_load_reads_nothing_but_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"t" * (PAYLOAD + 4096))
    hour_ago = time.time() - 3600
    os.utime(target, (hour_ago, hour_ago))
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")  # an open that could block would hang here
    (tmp_path / "dir").mkdir()
    expected = {
        "link": errno.ELOOP,
        "fifo": io.NOT_REGULAR_ERRNO,
        "dir": io.NOT_REGULAR_ERRNO,
    }
    for name, code in expected.items():
        out = _pages(PAYLOAD, 5)
        with pytest.raises(OSError) as caught:
            io._load_file(str(tmp_path / name), out, _pages(4096), False, 0.0)
        assert caught.value.errno == code, name
        assert bytes(out) == b"\x05" * PAYLOAD  # not a byte read
    assert target.stat().st_mtime == pytest.approx(hour_ago)  # the use-stamp never follows


def test_a_symlink_at_the_final_path_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"t" * (PAYLOAD + 4096))  # the size of a complete chunk file
    final = tmp_path / "chunk"
    final.symlink_to(target)
    payload, trailer = _pages(PAYLOAD, 1), _pages(4096, 2)
    assert io._store_file(str(final) + ".tmp", str(final), payload, trailer, False, False) is True
    assert not final.is_symlink() and final.read_bytes()[:1] == b"\x01"
    assert target.read_bytes() == b"t" * (PAYLOAD + 4096)


def test_the_compiled_checksum_is_python_xxhash_s() -> None:
    if not io.COMPILED_CHECKSUM:
        pytest.skip("the compiled chunk I/O is not built or hashes in Python")
    from kvtier.tiers.fs._native import _chunkio

    rng = random.Random(7)
    region = mmap.mmap(-1, 3 << 20)
    region.write(rng.randbytes(3 << 20))
    view = memoryview(region)
    for size in (0, 1, 15, 16, 17, 128, 129, 240, 241, 4096, 262144, 2 << 20):
        start = rng.randrange(64)
        piece = view[start : start + size]
        assert _chunkio.checksum(piece) == integrity.checksum(piece), size


def test_compiled_calls_with_the_checksum_taken_in_python_store_and_load_the_same(
    tmp_path: Path,
) -> None:
    """Where python-xxhash's XXH3 cannot be bound, the compiled calls run with
    the checksum taken around them: same files, same digests."""
    if "compiled" not in io.IMPLEMENTATIONS:
        pytest.skip("kvtier was built without a C compiler")
    from kvtier.tiers.fs._native import _chunkio

    unbound = io._compiled_io(_chunkio, hashing=False)
    payload, trailer = _pages(PAYLOAD, 7), _pages(4096, 9)
    final = str(tmp_path / "chunk")
    assert unbound.store(final + ".tmp", final, payload, trailer, False, False) is True
    assert Path(final).read_bytes() == b"\x07" * PAYLOAD + _summed(b"\x09" * 4096, payload)
    out = _pages(PAYLOAD)
    assert unbound.load(final, out, _pages(4096), False, 60.0) == (
        PAYLOAD + 4096,
        integrity.checksum(payload),
    )
    Path(final).write_bytes(b"x" * 5000)
    assert unbound.load(final, _pages(PAYLOAD), _pages(4096), False, 60.0) == (5000, None)


def test_a_batch_load_gives_each_file_what_a_load_of_it_alone_gives(tmp_path: Path) -> None:
    """Whole, short, long, missing, not a regular file: in one call, each file
    read (or not) exactly as on its own, its error in its place."""
    whole = os.urandom(PAYLOAD) + os.urandom(4096)
    (tmp_path / "whole").write_bytes(whole)
    (tmp_path / "short").write_bytes(whole[:-1])
    (tmp_path / "long").write_bytes(whole + b"x")
    (tmp_path / "link").symlink_to(tmp_path / "whole")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    names = ["whole", "short", "missing", "link", "whole", "long", "fifo", "dir"]
    paths = [str(tmp_path / name) for name in names]

    def outcome(got: object, out: memoryview, trailer: memoryview) -> object:
        if isinstance(got, OSError):
            return type(got), got.errno, got.filename
        return got, bytes(out), bytes(trailer)

    alone: list[Any] = []
    for path in paths:
        out, trailer = _pages(PAYLOAD, 5), _pages(4096, 5)
        try:
            got: object = io._load_file(path, out, trailer, False, 60.0)
        except OSError as exc:
            got = exc
        alone.append(outcome(got, out, trailer))
    outs = [_pages(PAYLOAD, 5) for _ in paths]
    trailers = [_pages(4096, 5) for _ in paths]
    together = io._load_files(paths, outs, trailers, False, 60.0)
    assert [outcome(*each) for each in zip(together, outs, trailers, strict=True)] == alone
    assert alone[0][0] == (PAYLOAD + 4096, integrity.checksum(whole[:PAYLOAD]))
    assert alone[2][0] is FileNotFoundError
    assert [alone[i][1] for i in (3, 6, 7)] == [errno.ELOOP] + [io.NOT_REGULAR_ERRNO] * 2
    assert io._load_files([], [], [], False, 60.0) == []


def test_read_chunks_verifies_each_chunk_of_a_batch_as_read_chunk_does(tmp_path: Path) -> None:
    namespace, payload = b"n" * KEY_BYTES, os.urandom(PAYLOAD)
    keys = [bytes([i]) * KEY_BYTES for i in range(4)]
    paths = [str(tmp_path / f"chunk{i}") for i in range(4)]
    for path, key in zip(paths, keys, strict=True):
        io.write_chunk(
            path, path + ".tmp", namespace, key, memoryview(payload), direct=False, fsync=False
        )
    flipped = bytearray(Path(paths[1]).read_bytes())
    flipped[7] ^= 1
    Path(paths[1]).write_bytes(flipped)
    os.unlink(paths[2])
    keys[3] = b"z" * KEY_BYTES  # another chunk's file at this one's path
    outs = [_pages(PAYLOAD) for _ in paths]
    errors = io.read_chunks(paths, outs, namespace, keys, direct=False)
    assert errors[0] is None and bytes(outs[0]) == payload
    assert isinstance(errors[1], CorruptChunkError)
    assert isinstance(errors[2], FileNotFoundError)
    assert isinstance(errors[3], CorruptChunkError)
    for path, key, error in zip(paths, keys, errors, strict=True):
        alone: object = None
        try:
            io.read_chunk(path, _pages(PAYLOAD), namespace, key, direct=False)
        except Exception as exc:
            alone = exc
        assert type(alone) is type(error) and str(alone) == str(error)
