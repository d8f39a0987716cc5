"""Writing a staged shard to a local destination with direct I/O (``O_DIRECT``).

A buffered copy (``copy_file_range``) makes the kernel copy every byte from the staged file's
pages into new page-cache pages of the destination file, which then sit there until they are
written back and evicted: on ext4 here that copy is most of a drain's CPU (1 GiB: 0.44-0.49
CPU s and 0.84-0.98 s, against 0.02-0.04 CPU s and 0.44-0.58 s written direct from a mapping of
the staged pages), and the copies push the training job's own cached files out of memory.

So, where the destination is a local block filesystem (ext4, XFS: posixlayout.writes_direct), the
staged file's pages are mapped and written from there with ``O_DIRECT``, and the checksum is
taken from the same mapping right after the write. Only the last partial block goes through the
page cache (direct I/O takes whole blocks). The staged file is the daemon's own and immutable
once handed off, so mapping it cannot fault past its end (filecopy.checksum_mapped says why
that matters). Blocking: worker threads only; the loop checks ``stop`` between ranges.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING

from ckptdrain.daemon import checksums
from ckptdrain.daemon.checksums import ALGO
from ckptdrain.daemon.filecopy import Truncated, copy_segment, next_range

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.base import ThreadFlow

log = logging.getLogger(__name__)

# Direct I/O takes buffers, offsets and lengths in whole logical blocks; a page is a whole
# number of them on every device the filesystems in posixlayout.DIRECT_WRITE_FILESYSTEMS use.
DIRECT_ALIGN_BYTES = mmap.PAGESIZE
# The staged pages are mapped this much at a time (mapped pages count in the daemon's RSS,
# though they are the page cache's). 1 GiB here: 2 MiB windows 0.07 CPU s, 8 MiB 0.03-0.04,
# 16 MiB 0.02; all write at the disk's speed.
DIRECT_WINDOW_BYTES = 8 << 20
# Smaller shards are not worth a second kind of write (the small-shard batch has its own path).
DIRECT_MIN_BYTES = 1 << 20

# Devices whose files refused direct I/O (EINVAL: a block size direct I/O cannot meet, a
# filesystem mounted without it): learnt once per device, then copied through the page cache.
_refused: set[int] = set()
_refused_lock = threading.Lock()


def direct_copy_and_checksum(
    src_fd: int, out: int, size: int, stop: threading.Event, name: str, *,
    flow: ThreadFlow | None = None,
) -> str:
    """Copy ``size`` bytes of the staged ``src_fd`` to ``out`` (a new, empty file), whole
    blocks with direct I/O and the last partial block buffered, and return their checksum
    (CRC64NVME), taken from the mapping each window was written from. Where the device refuses
    direct I/O, the rest is copied through the kernel as filecopy does; the caller fsyncs."""
    digest = checksums.new(ALGO)
    device = os.fstat(out).st_dev
    direct = device not in _refused and _set_direct(out, True)
    offset = 0
    try:
        while offset < size:
            want = next_range(offset, size, stop, flow)
            _check_size(src_fd, offset + want, name)
            whole = want - want % DIRECT_ALIGN_BYTES if direct else 0
            if whole:
                try:
                    _write_mapped(src_fd, out, offset, whole, digest, name)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or offset != 0:
                        raise
                    # Refused in the first range: this device takes no direct I/O. The range
                    # is copied again from byte 0, and checksummed afresh.
                    _learn_refused(device)
                    direct, whole = False, 0
                    _set_direct(out, False)
                    digest = checksums.new(ALGO)
            if whole < want:
                if direct:
                    direct = False
                    _set_direct(out, False)  # the tail: not a whole block
                # Already paced: the range goes through the kernel copy, checksummed as ever.
                copy_segment(src_fd, out, offset + whole, want - whole, digest, stop, name,
                             mapped=src_fd)
            offset += want
            if flow is not None:
                flow.moved(want)
    finally:
        if direct:
            _set_direct(out, False)
    return digest.value()


def _write_mapped(src_fd: int, out: int, offset: int, length: int,
                  digest: checksums.Digest, name: str) -> None:
    """Write ``length`` bytes of ``src_fd`` at ``offset`` (both block-aligned) to the same
    offset of ``out`` straight from mappings of the staged pages, checksumming each window
    after it is written.

    A staged file that shrinks meanwhile (only the daemon's user can: staging is 0700) is
    found before each window is mapped and again before its checksum reads it, and a write
    from pages that went away fails with EFAULT: each is :class:`Truncated`. Only a shrink
    in the moment between the last check and the checksum's read can still fault."""
    done = 0
    while done < length:
        start = offset + done
        want = min(DIRECT_WINDOW_BYTES, length - done)
        _check_size(src_fd, start + want, name)
        try:
            mapping = mmap.mmap(src_fd, want, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
        except ValueError:  # shorter than the window now
            raise _shrank(name, start) from None
        try:
            with memoryview(mapping) as view:
                written = 0
                while written < want:
                    # Every view of the mapping is released before it is closed, on errors too.
                    with view[written:] as rest:
                        try:
                            n = os.pwrite(out, rest, start + written)
                        except OSError as exc:
                            if exc.errno == errno.EFAULT:  # the pages went with the file's end
                                raise _shrank(name, start) from None
                            raise
                    if n <= 0:  # pragma: no cover - a regular file takes some or raises
                        raise OSError(errno.EIO, f"direct write of {want - written} bytes "
                                                 "wrote nothing")
                    written += n
                _check_size(src_fd, start + want, name)
                digest.update(view)
        finally:
            mapping.close()
        done += want


def _check_size(src_fd: int, end: int, name: str) -> None:
    # Never map or read a mapping past the end: touching such a page kills the process (SIGBUS).
    staged = os.fstat(src_fd).st_size
    if staged < end:
        raise Truncated(f"source of {name} ended at byte {staged}, before byte {end}: the "
                        "staged file was truncated")


def _shrank(name: str, offset: int) -> Truncated:
    return Truncated(f"source of {name} shrank while it was copied (at byte {offset})")


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    wanted = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, wanted)
    except OSError as exc:
        if not on or exc.errno != errno.EINVAL:
            raise
        _learn_refused(os.fstat(fd).st_dev)
        return False
    return True


def _learn_refused(device: int) -> None:
    with _refused_lock:
        if device not in _refused:
            _refused.add(device)
            log.info("direct I/O refused on device %d; copying through the page cache", device)
