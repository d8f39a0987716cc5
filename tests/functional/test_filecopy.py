"""Kernel copies with their checksum (daemon/filecopy.py), on real files: sequential and in
parallel segments, a source shorter than declared, a stop, and the fallbacks."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.daemon import bufferedcopy, checksums, filecopy
from ckptdrain.daemon.checksums import Stopped, of_bytes

MiB = 1 << 20


def _files(tmp_path: Path, data: bytes) -> tuple[int, int, Path]:
    src = tmp_path / "src"
    src.write_bytes(data)
    out_path = tmp_path / "out"
    return (os.open(src, os.O_RDONLY),
            os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), out_path)


@pytest.mark.parametrize("size", [0, 1, filecopy.COPY_RANGE_BYTES + 3,
                                  filecopy.PARALLEL_MIN_BYTES + 5 * MiB + 7])
def test_parallel_copy_matches_the_bytes_and_their_checksum(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    src, out, out_path = _files(tmp_path, data)
    moved: list[int] = []

    class Flow:
        def pace(self, nbytes: int, stop: threading.Event) -> bool:
            return True

        def moved(self, nbytes: int) -> None:
            moved.append(nbytes)

    try:
        with ThreadPoolExecutor(4) as pool:
            checksum = filecopy.parallel_copy_and_checksum(
                pool, src, out, size, threading.Event(), "x", flow=Flow())  # type: ignore[arg-type]
    finally:
        os.close(src)
        os.close(out)
    assert checksum == of_bytes(data)
    assert out_path.read_bytes() == data
    assert sum(moved) == size


def test_a_source_shorter_than_declared_is_refused_in_every_segment_mode(tmp_path: Path) -> None:
    size = filecopy.PARALLEL_MIN_BYTES + MiB
    data = os.urandom(size - MiB)
    src, out, _ = _files(tmp_path, data)
    try:
        with ThreadPoolExecutor(4) as pool, pytest.raises(filecopy.Truncated):
            filecopy.parallel_copy_and_checksum(pool, src, out, size, threading.Event(), "x")
        with pytest.raises(filecopy.Truncated):
            filecopy.copy_and_checksum(src, out, size, threading.Event(), "x")
    finally:
        os.close(src)
        os.close(out)


def test_a_stopped_copy_ends_at_its_next_range(tmp_path: Path) -> None:
    size = filecopy.PARALLEL_MIN_BYTES
    src, out, _ = _files(tmp_path, os.urandom(size))
    stop = threading.Event()
    stop.set()
    try:
        with ThreadPoolExecutor(4) as pool, pytest.raises(Stopped):
            filecopy.parallel_copy_and_checksum(pool, src, out, size, stop, "x")
    finally:
        os.close(src)
        os.close(out)


def test_sendfile_and_read_write_serve_when_copy_file_range_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may refuse copy_file_range between two files (EXDEV across filesystems on
    # older kernels): the copy goes on with sendfile, and with pread/pwrite after that.
    data = os.urandom(3 * MiB + 11)

    def refused(*_: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(filecopy, "_learnt", {})
    monkeypatch.setattr(os, "copy_file_range", refused)
    for expected_mode in ("sendfile", "readwrite"):
        where = tmp_path / expected_mode
        where.mkdir()
        src, out, out_path = _files(where, data)
        try:
            assert filecopy.copy_and_checksum(src, out, len(data), threading.Event(), "x") \
                == of_bytes(data)
        finally:
            os.close(src)
            os.close(out)
        assert out_path.read_bytes() == data
        (where / "again").mkdir()
        src, out, _ = _files(where / "again", data)
        try:
            assert filecopy.copy_mode(src, out) == expected_mode  # learnt for this pair
        finally:
            os.close(src)
            os.close(out)
        monkeypatch.setattr(os, "sendfile", refused)


def test_segments_refused_mid_file_go_on_positionally_and_teach_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # sendfile writes at the file position, which the segments of one file share: a refusal
    # mid-file must not send them there (their bytes would land at each other's offsets).
    monkeypatch.setattr(filecopy, "_learnt", {})
    real = os.copy_file_range
    sendfiles: list[int] = []

    def refused_mid_file(src: int, dst: int, count: int, offset_src: int | None = None,
                         offset_dst: int | None = None) -> int:
        if offset_src:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, count, offset_src, offset_dst)

    def recording_sendfile(*args: Any) -> int:
        sendfiles.append(args[2])
        raise AssertionError("sendfile was used mid-file")

    monkeypatch.setattr(os, "copy_file_range", refused_mid_file)
    monkeypatch.setattr(os, "sendfile", recording_sendfile)
    data = os.urandom(filecopy.PARALLEL_MIN_BYTES + 5 * MiB + 7)
    src, out, out_path = _files(tmp_path, data)
    try:
        with ThreadPoolExecutor(filecopy.PARALLEL_SEGMENTS) as pool:
            assert filecopy.parallel_copy_and_checksum(
                pool, src, out, len(data), threading.Event(), "x") == of_bytes(data)
        assert filecopy.copy_mode(src, out) == "copy_file_range"
    finally:
        os.close(src)
        os.close(out)
    assert out_path.read_bytes() == data
    assert sendfiles == []


def test_an_fd_that_fails_every_copy_mode_teaches_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found: a client's read-only fd passed to restore into got EBADF from copy_file_range,
    # then from sendfile; each failure demoted the copy mode of the whole process, so every
    # later drain of the daemon ran the read/write loop. The fd's own error is raised, and
    # the next copy between the same filesystems still goes through copy_file_range.
    monkeypatch.setattr(filecopy, "_learnt", {}, raising=False)
    data = os.urandom(3 * MiB + 11)
    src, out, out_path = _files(tmp_path, data)
    read_only = os.open(out_path, os.O_RDONLY)
    real = os.copy_file_range
    kernel_copies: list[int] = []

    def recording(*args: Any) -> int:
        kernel_copies.append(args[2])
        return real(*args)

    try:
        with pytest.raises(OSError) as caught:
            filecopy.copy_and_checksum(src, read_only, len(data), threading.Event(), "x")
        assert caught.value.errno == errno.EBADF
        monkeypatch.setattr(os, "copy_file_range", recording)
        assert filecopy.copy_and_checksum(src, out, len(data), threading.Event(), "x") \
            == of_bytes(data)
    finally:
        for fd in (src, out, read_only):
            os.close(fd)
    assert kernel_copies, "the next copy did not go through copy_file_range"
    assert out_path.read_bytes() == data


def test_drain_threads_yield_to_hand_offs() -> None:
    # A drain thread runs niced (and at the lowest best-effort I/O priority where the kernel
    # has it), so a put beside a full drain keeps its share of the cores.
    seen: list[int] = []

    def probe() -> None:
        filecopy.yield_to_handoffs()
        stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat").read_text()
        seen.append(int(stat.rpartition(")")[2].split()[16]))  # field 19: nice

    with ThreadPoolExecutor(1) as pool:
        pool.submit(probe).result()
    assert seen == [filecopy.DRAIN_NICE]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # the caller's own


def test_a_copy_writes_behind_keeping_at_most_two_ranges_dirty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A drain that left gigabytes dirty in the page cache made a hand-off's fsync beside it
    # wait for them. Each range's writeback starts once it is copied, and the range before it
    # is waited for before the next is copied (the real sync_file_range runs; calls recorded).
    real = filecopy._sync_file_range
    assert real is not None, "sync_file_range is Linux's; this machine has it"
    calls: list[tuple[int, int, int]] = []

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(filecopy, "_sync_file_range", recording)
    data = os.urandom(3 * filecopy.COPY_RANGE_BYTES + 4096)
    src, out, out_path = _files(tmp_path, data)
    try:
        checksum = filecopy.copy_and_checksum(src, out, len(data), threading.Event(), "x")
    finally:
        os.close(src)
        os.close(out)
    assert checksum == of_bytes(data) and out_path.read_bytes() == data
    r = filecopy.COPY_RANGE_BYTES
    start, wait = 2, 1 | 2 | 4  # SYNC_FILE_RANGE_WRITE; WAIT_BEFORE | WRITE | WAIT_AFTER
    assert calls == [
        (0, r, start),
        (r, r, start), (0, r, wait),
        (2 * r, r, start), (r, r, wait),
        (3 * r, 4096, start), (2 * r, r, wait),
    ]


@pytest.mark.parametrize(("offset", "length", "windows"),
                         [(0, 1, 0), (4096, 3 * MiB, 3), (4097, MiB + 5, 1), (7, 2 * MiB - 7, 1),
                          (0, MiB - 1, 0)])
def test_a_mapped_checksum_equals_the_read_one_at_any_offset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int, length: int,
        windows: int) -> None:
    # Small windows, so that a few MiB are mapped a window at a time, as big parts are.
    monkeypatch.setattr(filecopy, "CHECKSUM_WINDOW_BYTES", MiB)
    data = os.urandom(2 * MiB + 4 * MiB)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        expected = checksums.Crc64nvme()
        expected.update(data[offset:offset + length])
        # Whole windows only are mapped; the caller reads the rest, and all of a short range
        # (a mapping's munmap costs more than reading a few pages).
        mapped = checksums.Crc64nvme()
        assert filecopy.checksum_mapped(fd, offset, length, mapped) == windows * MiB
        whole = checksums.Crc64nvme()
        whole.update(data[offset:offset + windows * MiB])
        assert mapped.crc == whole.crc
        into, read = checksums.Crc64nvme(), checksums.Crc64nvme()
        assert filecopy.checksum_into(fd, offset, length, into, owned=True) == length
        assert filecopy.checksum_read(fd, offset, length, read) == length
        assert into.crc == read.crc == expected.crc
        # Past the end nothing is mapped (a page there would be SIGBUS): the caller reads.
        past = checksums.Crc64nvme()
        assert filecopy.checksum_mapped(fd, len(data) - MiB - 10, MiB + 11, past) == 0
        assert past.crc == 0
    finally:
        os.close(fd)


def test_a_file_that_cannot_be_mapped_is_read_from_the_source_instead(tmp_path: Path) -> None:
    # A write-only target cannot be mapped: the copy's checksum falls back to reading the
    # source, and is still right.
    data = os.urandom(filecopy.COPY_RANGE_BYTES + 12345)
    src, out, out_path = _files(tmp_path, data)
    try:
        assert filecopy.checksum_mapped(out, 0, 1, checksums.Crc64nvme()) == 0
        checksum = filecopy.copy_and_checksum(src, out, len(data), threading.Event(), "x",
                                              write_behind=False, mapped=out)
    finally:
        os.close(src)
        os.close(out)
    assert checksum == of_bytes(data) and out_path.read_bytes() == data


def _recording_mmap(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The files filecopy maps (the real mmap runs), by inode."""
    mapped: list[int] = []
    real = filecopy.mmap.mmap

    def recording(fd: int, *args: object, **kwargs: object) -> object:
        mapped.append(os.fstat(fd).st_ino)
        return real(fd, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(filecopy.mmap, "mmap", recording)
    return mapped


@pytest.mark.asyncio
async def test_restore_maps_no_file_and_never_writes_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore's copy (and the daemon's fetch for a reader) checksums each piece in the
    buffer it writes from (bufferedcopy.py): nothing is mapped, so no file anyone may
    truncate (a client's fd, the destination's file) can SIGBUS the daemon, and nothing is
    read twice. A restore is not fsynced, so it starts no writeback."""
    from ckptdrain.daemon.backends.posix import PosixBackend
    from ckptdrain.daemon.config import DestinationConfig

    mapped = _recording_mmap(monkeypatch)
    syncs: list[int] = []
    monkeypatch.setattr(filecopy, "_sync_file_range",
                        lambda fd, offset, nbytes, flags: syncs.append(offset) or 0)
    backend = PosixBackend(DestinationConfig(uri=f"file://{tmp_path / 'dest'}"), "n1")
    data = os.urandom(2 * filecopy.COPY_RANGE_BYTES + 99)
    try:
        assert await backend.put_bytes("job/1/model.bin", data)
        for owned in (False, True):
            target = tmp_path / f"restored-{owned}"
            fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            moved: list[int] = []
            try:
                size, checksum = await backend.copy_into("job/1/model.bin", fd, owned=owned,
                                                         progress=moved.append)
            finally:
                os.close(fd)
            assert (size, checksum) == (len(data), of_bytes(data))
            assert target.read_bytes() == data
            # Told of progress a range at a time, not a piece at a time.
            assert sum(moved) == len(data), moved
            assert len(moved) <= len(data) // filecopy.COPY_RANGE_BYTES + 1, moved
    finally:
        await backend.aclose()
    assert mapped == [] and syncs == []


def test_a_buffered_copy_says_what_stopped_it(tmp_path: Path) -> None:
    """bufferedcopy: a source shorter than its size is Truncated (never a short file taken
    for whole), a set stop is Stopped, a write the target refuses is its OSError; a
    write-only target takes the copy (nothing is read back from it)."""
    data = os.urandom(3 * bufferedcopy.PIECE_BYTES + 7)
    src_path = tmp_path / "src"
    src_path.write_bytes(data)
    src = os.open(src_path, os.O_RDONLY)
    try:
        out = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            assert bufferedcopy.buffered_copy_and_checksum(
                src, out, len(data), threading.Event(), "w") == of_bytes(data)
        finally:
            os.close(out)
        assert (tmp_path / "w").read_bytes() == data
        out = os.open(tmp_path / "t", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(filecopy.Truncated, match=f"ended at byte {len(data)}"):
                bufferedcopy.buffered_copy_and_checksum(src, out, len(data) + 1,
                                                        threading.Event(), "t")
            stop = threading.Event()
            stop.set()
            with pytest.raises(checksums.Stopped):
                bufferedcopy.buffered_copy_and_checksum(src, out, len(data), stop, "t")
        finally:
            os.close(out)
        read_only = os.open(tmp_path / "w", os.O_RDONLY)
        try:
            with pytest.raises(OSError) as refused:
                bufferedcopy.buffered_copy_and_checksum(src, read_only, len(data),
                                                        threading.Event(), "w")
            assert refused.value.errno == errno.EBADF
        finally:
            os.close(read_only)
    finally:
        os.close(src)
