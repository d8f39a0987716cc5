"""Copying a file's bytes to another file through the kernel, with their checksum.

``copy_file_range`` (else ``sendfile``, else a pread/pwrite loop through a small buffer) moves
the bytes without a user-space write loop; the checksum is taken right after each range is
copied, while it is in the page cache: from a mapping of the file's pages where the file is one
nobody else can shrink (:func:`checksum_into`), else read back through a reused 1 MiB buffer.
Used by the POSIX destination (drain and restore) and by the local fast path of restore.
Blocking: worker threads only; every loop checks ``stop`` between ranges.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from ckptdrain.daemon import checksums
from ckptdrain.daemon.checksums import ALGO, Stopped
from ckptdrain.daemon.errors import DaemonError

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.base import ThreadFlow

log = logging.getLogger(__name__)

# One kernel copy call moves this much; the stop event is checked between calls. Small enough
# that pacing (one token reservation per range) stays smooth at modest rates.
COPY_RANGE_BYTES = 16 << 20
# Checksums read the page cache through a buffer this size (small: it stays in CPU cache).
CHECKSUM_BUFFER_BYTES = 1 << 20

# One checksum buffer per worker thread, reused for every file: fresh memory costs ~10x more
# to fill than a buffer already mapped.
_buffers = threading.local()


class Truncated(DaemonError):
    """The source file ended before the size it was declared to have."""


# The drain yields to the hand-off: training waits on a hand-off, nobody waits on a drain
# second by second. Drain threads run at this nice value and the lowest best-effort I/O
# priority, so a put beside a full drain keeps its share of the cores and the disk.
DRAIN_NICE = 10
_SYS_IOPRIO_SET = 251  # x86_64 and arm64's ioprio_set
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_BEST_EFFORT_LOWEST = (2 << 13) | 7


def yield_to_handoffs() -> None:
    """Lower the calling thread's CPU and I/O priority (a pool's ``initializer``); best
    effort: a kernel or scheduler that ignores it changes nothing else."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, DRAIN_NICE)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, _IOPRIO_BEST_EFFORT_LOWEST)


_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
_sync_file_range: Callable[[int, int, int, int], int] | None
try:
    _fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    _fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _sync_file_range = _fn
except (OSError, AttributeError):  # not Linux/glibc: the final fsync does all the work
    _sync_file_range = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range back now, without waiting for it."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def finish_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Wait until a range whose writeback was started is on disk (a file system that does not
    support it returns at once; the final fsync still makes everything durable)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WAIT_BEFORE
                         | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)


def checksum_buffer() -> memoryview:
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = memoryview(bytearray(CHECKSUM_BUFFER_BYTES))
        _buffers.buf = buf
    return buf


def checksum_into(fd: int, offset: int, length: int, digest: checksums.Digest, *,
                  owned: bool) -> int:
    """Add ``length`` bytes of ``fd`` at ``offset`` to ``digest``; returns how many it added
    (fewer only where the file ends first).

    ``owned`` is for a file only this side writes and nobody shrinks: a staged shard (the
    daemon's, immutable once handed off) or a restore's own temp file. Its pages are mapped and
    checksummed where they lie in the page cache (:func:`checksum_mapped`). Any other file (a
    client's, the destination's) is read through the thread's buffer.
    """
    done = checksum_mapped(fd, offset, length, digest) if owned else 0
    return done + checksum_read(fd, offset + done, length - done, digest)


# A mapped checksum maps this much at a time, so the pages it holds mapped (which count in the
# process's RSS, though they are the page cache's) stay few whatever the part or file size:
# 16 MiB windows added 86 MiB to a worker's peak RSS with 8 parts in flight; 2 MiB costs no
# more CPU (0.17 CPU s per GiB in the page cache, as 16 MiB).
#
# Only whole windows are mapped; what is left is read through the buffer. Every mapping ends
# in a munmap, and a munmap in a TLB shootdown: an interrupt to every core that runs one of the
# process's threads. For a small range that costs more than the copy it saves: 64 KiB mapped
# took 42-45 us of CPU against 15-17 read (1 MiB about even, 2 MiB mapped 0.13 CPU s/GB
# against 0.17 read), and in a commit of 10,000 shards of 64 KiB the shootdowns were an
# eighth of the drain threads' samples (perf).
CHECKSUM_WINDOW_BYTES = 2 << 20


def checksum_mapped(fd: int, offset: int, length: int, digest: checksums.Digest) -> int:
    """Add the first whole windows (:data:`CHECKSUM_WINDOW_BYTES`) of ``length`` bytes of
    ``fd`` at ``offset`` to ``digest`` from mappings of its pages, with no copy. Only for an
    ``owned`` file (:func:`checksum_into`): touching a mapped page past a file's end kills the
    process (SIGBUS), so a file someone else could truncate meanwhile is never mapped.
    Returns how many bytes it added: every whole window, or fewer where the file is shorter or
    cannot be mapped (opened write-only, a file system without mmap); the caller reads the
    rest, and all of a range shorter than a window."""
    if length < CHECKSUM_WINDOW_BYTES or os.fstat(fd).st_size < offset + length:
        return 0
    done = 0
    while length - done >= CHECKSUM_WINDOW_BYTES:
        start = offset + done
        base = start - start % mmap.ALLOCATIONGRANULARITY
        want = CHECKSUM_WINDOW_BYTES
        try:
            mapping = mmap.mmap(fd, start + want - base, mmap.MAP_SHARED, mmap.PROT_READ,
                                offset=base)
        except (OSError, ValueError):
            return done
        try:
            with memoryview(mapping) as whole, whole[start - base:] as part:
                digest.update(part)
        finally:
            mapping.close()
        done += want
    return done


def checksum_read(fd: int, offset: int, length: int, digest: checksums.Digest) -> int:
    """Add up to ``length`` bytes of ``fd`` at ``offset`` to ``digest``, read with pread
    through the thread's reused buffer; returns how many (fewer where the file ends)."""
    view = checksum_buffer()
    done = 0
    while done < length:
        got = os.preadv(fd, [view[: min(len(view), length - done)]], offset + done)
        if got == 0:
            break
        digest.update(view[:got])
        done += got
    return done


def copy_and_checksum(
    src_fd: int, out: int, size: int, stop: threading.Event, name: str, algo: str = ALGO, *,
    flow: ThreadFlow | None = None, progress: Callable[[int], None] | None = None,
    write_behind: bool = True, mapped: int | None = None,
) -> str:
    """Copy ``size`` bytes of ``src_fd`` (from offset 0) into ``out`` through the kernel
    (:func:`kernel_copy`), and return their checksum, taken right after each range is copied,
    while it is in the page cache.
    ``write_behind`` (see :func:`copy_segment`) is for a copy that is fsynced when done; a
    restore, which is not, leaves writeback to the kernel and runs at page-cache speed.
    ``mapped`` names the one of the two fds whose pages the checksum maps (an ``owned`` file
    of :func:`checksum_into`); None, or a file that cannot be mapped, reads the source
    through the buffer.

    The checksum is taken after each range is copied, so a byte that changed between the copy
    and the checksum makes it disagree with what a later verify finds, never the other way
    round; the staged copy is immutable once handed off anyway.
    """
    digest = checksums.new(algo)
    copy_segment(src_fd, out, 0, size, digest, stop, name, flow=flow, progress=progress,
                 write_behind=write_behind, mapped=mapped)
    return digest.value()


def next_range(offset: int, size: int, stop: threading.Event, flow: ThreadFlow | None) -> int:
    """How many bytes the next range of a copy at ``offset`` of ``size`` takes, once the
    drain's pacing lets it go; raises :class:`Stopped` where ``stop`` is set first."""
    if stop.is_set():
        raise Stopped
    want = min(COPY_RANGE_BYTES, size - offset)
    if flow is not None and not flow.pace(want, stop):
        raise Stopped
    return want


def copy_segment(
    src_fd: int, out: int, start: int, length: int, digest: checksums.Digest,
    stop: threading.Event, name: str, *, flow: ThreadFlow | None = None,
    progress: Callable[[int], None] | None = None, write_behind: bool = True,
    mapped: int | None = None,
) -> None:
    """Copy bytes ``start`` to ``start + length`` of ``src_fd`` to the same offsets of ``out``,
    adding them to ``digest`` in order (see :func:`copy_and_checksum`)."""
    offset = start
    size = start + length
    # Write-behind: each range's writeback starts as soon as it is copied, and the range
    # before it must be on disk before the next is copied. A drain thus never has more than
    # two ranges dirty in the page cache, so a hand-off's fsync does not queue behind
    # gigabytes of the drain's dirty pages, and the drain's own final fsync has little left.
    behind: tuple[int, int] | None = None
    while offset < size:
        want = next_range(offset, size, stop, flow)
        copied = kernel_copy(src_fd, out, offset, want)
        if copied == 0:
            raise Truncated(f"source of {name} ended at byte {offset} of {size}: the staged "
                            "file was truncated")
        if write_behind:
            start_writeback(out, offset, copied)
            if behind is not None:
                finish_writeback(out, *behind)
            behind = (offset, copied)
        done = 0 if mapped is None else checksum_mapped(mapped, offset, copied, digest)
        if done + checksum_read(src_fd, offset + done, copied - done, digest) < copied:
            raise Truncated(f"source of {name} shrank while it was copied")
        offset += copied
        if flow is not None:
            flow.moved(copied)
        if progress is not None:
            progress(copied)


# Below this a shard is one sequential copy; above it, PARALLEL_SEGMENTS segments at once.
PARALLEL_MIN_BYTES = 4 * COPY_RANGE_BYTES
PARALLEL_SEGMENTS = 4


def parallel_copy_and_checksum(
    pool: Executor, src_fd: int, out: int, size: int, stop: threading.Event, name: str, *,
    flow: ThreadFlow | None = None,
) -> str:
    """:func:`copy_and_checksum` of a large file as contiguous segments copied at once by
    ``pool``'s threads (a striped Lustre file takes writes to several OSTs at a time); their
    CRC64NVMEs are combined. Every segment has ended (done, failed or stopped) on return."""
    # sendfile writes at the file position, which segments sharing ``out`` would race on.
    if size < PARALLEL_MIN_BYTES or copy_mode(src_fd, out) != "copy_file_range":
        return copy_and_checksum(src_fd, out, size, stop, name, flow=flow, mapped=src_fd)
    step = -(-size // PARALLEL_SEGMENTS)
    step = -(-step // COPY_RANGE_BYTES) * COPY_RANGE_BYTES  # whole ranges per segment
    segments = [(start, min(step, size - start)) for start in range(0, size, step)]
    digests = [checksums.Crc64nvme() for _ in segments]
    # One failing segment stops the others at their next range.
    failed = threading.Event()

    def run(i: int) -> None:
        start, length = segments[i]
        try:
            copy_segment(src_fd, out, start, length, digests[i], _Either(stop, failed), name,
                         flow=flow, mapped=src_fd)
        except BaseException:
            failed.set()
            raise

    futures = [pool.submit(run, i) for i in range(len(segments))]
    concurrent.futures.wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None and not isinstance(error, Stopped):
            raise error
    if stop.is_set() or failed.is_set():
        raise Stopped
    return checksums.combine([(d.crc, length) for d, (_, length) in zip(digests, segments,
                                                                          strict=True)])


class _Either(threading.Event):
    """Set when either of two events is (a segment's stop: the caller's or a sibling's)."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        super().__init__()
        self._a = a
        self._b = b

    def is_set(self) -> bool:
        return self._a.is_set() or self._b.is_set()


# Which kernel copy works is learnt per pair of filesystems (the two files' st_dev):
# copy_file_range refuses some pairs (EXDEV across filesystems on older kernels, EINVAL from a
# memfd, ...), and sendfile then serves; the plain read/write loop is the last resort. A mode
# is learnt only once the next one has worked for the same call, at a file's start: an fd that
# fails every mode (a client's read-only fd to restore into gets EBADF from each) teaches
# nothing, and a refusal mid-file serves that call alone. (Learnt process-wide from any
# failure, one such fd put every later copy of the daemon, drains included, on that loop.)
COPY_MODES = ("copy_file_range", "sendfile", "readwrite")
_learnt: dict[tuple[int, int], int] = {}
_modes_lock = threading.Lock()
_COPY_FALLBACK_ERRNOS = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
)


def _pair(src_fd: int, out: int) -> tuple[int, int]:
    return os.fstat(src_fd).st_dev, os.fstat(out).st_dev


def copy_mode(src_fd: int, out: int) -> str:
    """The kernel copy :func:`kernel_copy` starts with between these two files."""
    return COPY_MODES[_learnt.get(_pair(src_fd, out), 0)]


def kernel_copy(src_fd: int, out: int, offset: int, count: int) -> int:
    """Copy up to ``count`` bytes of ``src_fd`` at ``offset`` to the same offset of ``out``
    without bringing them into user space where the kernel allows it; returns how many were
    copied (0 only at the source's end)."""
    pair = _pair(src_fd, out)
    first = _learnt.get(pair, 0)
    for index in range(first, len(COPY_MODES)):
        mode = COPY_MODES[index]
        if mode == "sendfile" and index != first and offset != 0:
            # Refused mid-file: sendfile writes at out's file position, which the parallel
            # segments of one file share; the positional read/write loop serves this call.
            continue
        try:
            if mode == "copy_file_range":
                copied = os.copy_file_range(src_fd, out, count, offset, offset)
            elif mode == "sendfile":
                os.lseek(out, offset, os.SEEK_SET)
                copied = os.sendfile(out, src_fd, offset, count)
            else:
                copied = _read_write(src_fd, out, offset, count)
        except OSError as exc:
            if exc.errno not in _COPY_FALLBACK_ERRNOS or index == len(COPY_MODES) - 1:
                raise
            continue
        if index != first and offset == 0:
            with _modes_lock:
                if _learnt.get(pair, 0) < index:
                    _learnt[pair] = index
                    log.info("%s refused between devices %d and %d; copying with %s",
                             COPY_MODES[first], *pair, mode)
        return copied
    raise AssertionError("unreachable: the last mode returns or raises")


def _read_write(src_fd: int, out: int, offset: int, count: int) -> int:
    view = checksum_buffer()
    got = os.preadv(src_fd, [view[: min(len(view), count)]], offset)
    done = 0
    while done < got:
        done += os.pwritev(out, [view[done:got]], offset + done)
    return got


def hash_file(fd: int, stop: threading.Event, algo: str = ALGO, *, owned: bool = False) -> str:
    """The checksum (``algo``) of everything ``fd`` holds from offset 0; ``owned`` as for
    :func:`checksum_into` (a staged shard's pages are mapped, not copied)."""
    digest = checksums.new(algo)
    size = os.fstat(fd).st_size
    offset = 0
    while True:
        if stop.is_set():
            raise Stopped
        # Past the size fstat gave, read to the end (a file that grew is hashed whole).
        inside = offset < size
        want = min(COPY_RANGE_BYTES, size - offset) if inside else COPY_RANGE_BYTES
        got = checksum_into(fd, offset, want, digest, owned=owned and inside)
        if got == 0:
            return digest.value()
        offset += got
