"""Direct I/O drains to a local disk (directcopy.py): real files on this machine's disk."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.daemon import directcopy, filecopy
from ckptdrain.daemon.backends import posixlayout
from ckptdrain.daemon.backends.base import open_backend
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.checksums import Stopped, of_bytes
from ckptdrain.daemon.config import DestinationConfig

MiB = 1 << 20
KEY = "job/00000000000000000001/model.bin"


def _on_a_direct_filesystem(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return posixlayout.writes_direct(fd)
    finally:
        os.close(fd)


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """A directory on a local block filesystem (this machine's temp dir is on ext4)."""
    if not _on_a_direct_filesystem(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext4 or XFS")
    return tmp_path


@pytest.fixture(autouse=True)
def _forget_refusals() -> Iterator[None]:
    directcopy._refused.clear()
    yield
    directcopy._refused.clear()


@pytest_asyncio.fixture
async def backend(disk: Path) -> AsyncIterator[PosixBackend]:
    made = open_backend(DestinationConfig(uri=f"file://{disk / 'dest'}"), "gpu1")
    assert isinstance(made, PosixBackend)
    yield made
    await made.aclose()


def _staged(disk: Path, data: bytes) -> int:
    path = disk / "staged.bin"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def _resident_bytes(path: Path) -> int:
    # fincore (util-linux) asks mincore(2) which of the file's pages are in the page cache.
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip())


@pytest.mark.asyncio
async def test_a_shard_drained_to_a_local_disk_leaves_no_copy_in_the_page_cache(
    backend: PosixBackend, disk: Path
) -> None:
    # A buffered copy left every drained byte cached a second time (the staged copy is the
    # first), pushing the training job's own files out of memory, and the kernel's copy into
    # those pages was most of the drain's CPU. Only the last partial block may be cached now.
    data = os.urandom(filecopy.COPY_RANGE_BYTES * 2 + 3 * MiB + 123)
    fd = _staged(disk, data)
    try:
        checksum = await backend.put_file(KEY, fd, len(data))
    finally:
        os.close(fd)
    final = disk / "dest" / KEY
    # Asked before anything reads the file back (a read would bring its pages in).
    assert _resident_bytes(final) <= 2 * directcopy.DIRECT_ALIGN_BYTES
    assert backend.direct_writes is True
    assert checksum == of_bytes(data)
    assert final.read_bytes() == data
    assert not directcopy._refused


@pytest.mark.parametrize("size", [
    directcopy.DIRECT_ALIGN_BYTES - 1,          # less than one block: all through the cache
    4 * MiB,                                    # whole blocks, one range
    filecopy.COPY_RANGE_BYTES,                  # exactly one range
    filecopy.COPY_RANGE_BYTES + 1,              # a range and one byte
    2 * filecopy.COPY_RANGE_BYTES + 4097,       # ranges, windows and a tail past a block
])
def test_every_size_is_copied_whole_with_its_checksum(disk: Path, size: int) -> None:
    data = os.urandom(size)
    src = _staged(disk, data)
    out = os.open(disk / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        checksum = directcopy.direct_copy_and_checksum(src, out, size, threading.Event(), "x")
        os.fsync(out)
        assert fcntl_flags(out) & os.O_DIRECT == 0  # handed back as it came
    finally:
        os.close(out)
        os.close(src)
    assert checksum == of_bytes(data)
    assert (disk / "out.bin").read_bytes() == data


def fcntl_flags(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_device_that_refuses_direct_writes_is_copied_through_the_cache_and_remembered(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Direct I/O can be refused where a filesystem is mounted without it, or a device's block
    # is larger than a page: EINVAL at the first write. The shard is still written whole (the
    # refused range again from byte 0, its checksum afresh), and that device is not asked again.
    calls: list[int] = []
    real = os.pwrite

    def refusing(fd: int, data: Any, offset: int) -> int:
        calls.append(offset)
        # Refused after a first window went direct: the fallback must redo it.
        if fcntl_flags(fd) & os.O_DIRECT and offset >= directcopy.DIRECT_WINDOW_BYTES:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(directcopy.os, "pwrite", refusing)
    data = os.urandom(filecopy.COPY_RANGE_BYTES + 99)
    for name in ("a.bin", "b.bin"):
        src = _staged(disk, data)
        out = os.open(disk / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            checksum = directcopy.direct_copy_and_checksum(src, out, len(data),
                                                           threading.Event(), name)
        finally:
            os.close(out)
            os.close(src)
        assert checksum == of_bytes(data)
        assert (disk / name).read_bytes() == data
        if name == "a.bin":
            assert calls == [0, directcopy.DIRECT_WINDOW_BYTES]
            assert directcopy._refused == {os.stat(disk).st_dev}
            calls.clear()
    assert calls == []  # b.bin: straight through the kernel copy, no direct write tried


def test_a_staged_file_shorter_than_its_size_fails_typed_and_is_never_mapped_past_its_end(
    disk: Path,
) -> None:
    # Mapping past a file's end and touching it kills the process (SIGBUS): the size is
    # checked before each range is mapped.
    data = os.urandom(filecopy.COPY_RANGE_BYTES + 4096)
    src = _staged(disk, data)
    out = os.open(disk / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with pytest.raises(filecopy.Truncated):
            directcopy.direct_copy_and_checksum(src, out, len(data) + 3 * MiB,
                                                threading.Event(), "short.bin")
    finally:
        os.close(out)
        os.close(src)


def test_a_set_stop_ends_the_copy_between_ranges(disk: Path) -> None:
    data = os.urandom(2 * filecopy.COPY_RANGE_BYTES)
    src = _staged(disk, data)
    out = os.open(disk / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    stop = threading.Event()
    stop.set()
    try:
        with pytest.raises(Stopped):
            directcopy.direct_copy_and_checksum(src, out, len(data), stop, "x")
    finally:
        os.close(out)
        os.close(src)
    assert os.path.getsize(disk / "out.bin") == 0


def test_local_block_filesystems_are_told_apart_by_their_statfs_type(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kind = posixlayout.filesystem_type(fd)
        assert posixlayout.writes_direct(fd) == (kind in (0xEF53, 0x58465342))
    finally:
        os.close(fd)
    shm = Path("/dev/shm")
    if shm.is_dir():
        fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert not posixlayout.writes_direct(fd)  # tmpfs keeps every byte in memory anyway
        finally:
            os.close(fd)


_SHRINK_AFTER_FIRST_WRITE = '''
import os, sys, threading
from ckptdrain.daemon import directcopy, filecopy
src_path, out_path, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
src = os.open(src_path, os.O_RDWR)
size = os.fstat(src).st_size
real = os.pwrite
def shrinking(fd, data, offset):
    n = real(fd, data, offset)
    if offset == 0:
        os.ftruncate(src, keep)  # someone shrinks the staged file under the copy
    return n
directcopy.os.pwrite = shrinking
out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
try:
    directcopy.direct_copy_and_checksum(src, out, size, threading.Event(), "x.bin")
except filecopy.Truncated as exc:
    print("Truncated:", exc)
'''


@pytest.mark.parametrize("keep", [
    12 * MiB,   # inside the range's second window: found before that window is mapped
    4 * MiB,    # inside the window just written: found before its checksum reads the mapping
], ids=["next-window", "this-window"])
def test_a_staged_file_shrunk_mid_range_is_a_typed_error_never_a_crash(
    disk: Path, keep: int
) -> None:
    # The size was checked once per 16 MiB range while each 8 MiB window is mapped: a shrink
    # after the first window escaped as a bare ValueError from mmap (an internal error with a
    # traceback in the daemon's log), and one inside the window just written killed the
    # process with SIGBUS when the checksum read the mapping. A child process runs the copy,
    # so a crash fails this test instead of ending the test run.
    src = disk / "staged.bin"
    src.write_bytes(os.urandom(filecopy.COPY_RANGE_BYTES + MiB))
    done = subprocess.run(
        [sys.executable, "-c", _SHRINK_AFTER_FIRST_WRITE, str(src), str(disk / "out.bin"),
         str(keep)],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("Truncated: source of x.bin"), done.stdout


def test_a_direct_write_whose_pages_went_away_is_a_truncation(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A staged file shrunk during the direct write itself: the kernel finds the mapped pages
    # gone and says EFAULT ("Bad address"), which read as a generic I/O error.
    def faulting(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(directcopy.os, "pwrite", faulting)
    src = _staged(disk, os.urandom(2 * MiB))
    out = os.open(disk / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with pytest.raises(filecopy.Truncated, match="shrank while it was copied"):
            directcopy.direct_copy_and_checksum(src, out, 2 * MiB, threading.Event(), "x")
        assert fcntl_flags(out) & os.O_DIRECT == 0
    finally:
        os.close(out)
        os.close(src)
