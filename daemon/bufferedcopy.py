"""A copy checksummed on its way through one small buffer: each piece read into the buffer,
checksummed there while it is in the CPU's cache, and written from it. For the copies of the
``ckptdrain restore`` command from a ``file://`` destination into its own files, which nobody
fsyncs, so the drain's kernel copy (filecopy.py) wins nothing: its checksum must read every
byte again afterwards, from a mapping of the pages it wrote (page faults, a TLB shootdown per
window).

Measured on the test VM (ext4, the source in the page cache, 8 files copied by 8 threads;
a script outside the project, alternating): 8 x 128 MiB in 0.15-0.16 s and 0.27-0.29 CPU s,
against 0.20 s and 0.35-0.38 CPU s for the kernel copy with the checksum from the mapped
pages; 8 x 512 MiB in 0.79-1.46 s and 1.25-1.32 CPU s against 1.0-1.83 s and 1.5-1.65.
The written bytes are the checksummed ones: the checksum is of the buffer the write took.
Blocking: worker threads only; ``stop`` is checked between pieces.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from ckptdrain.daemon import checksums
from ckptdrain.daemon.checksums import ALGO, Stopped
from ckptdrain.daemon.filecopy import COPY_RANGE_BYTES, Truncated

# Not a multiple of the page size, on purpose: page-aligned pieces let the filesystem cache
# the new file in large folios, taken from free memory's large blocks, which a virtual
# machine's host reclaims while they are free (free page reporting) and backs again at the
# first write. 1 MiB pieces took 1.6-5.2 s (up to 5.7 system CPU s) for 8 x 512 MiB on the
# test VM, where this size took 0.8-1.5 s; 64 KiB to 1 MiB were alike at 8 x 128 MiB.
PIECE_BYTES = (256 << 10) - 1000

_buffers = threading.local()


def _buffer() -> memoryview:
    """The thread's own buffer, reused for every file it copies (fresh memory costs far more
    to fill than memory already mapped)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = memoryview(bytearray(PIECE_BYTES))
        _buffers.buf = buf
    return buf


def buffered_copy_and_checksum(
    src_fd: int, out: int, size: int, stop: threading.Event, name: str, algo: str = ALGO, *,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Copy ``size`` bytes of ``src_fd`` from offset 0 to the same offsets of ``out`` and
    return their checksum (``algo``). ``progress`` hears of every COPY_RANGE_BYTES moved (and
    of the rest at the end), not of every piece. Raises :class:`Truncated` when the source
    ends first, :class:`Stopped` when ``stop`` is set, and the OSError of a failed read or
    write as it came."""
    digest = checksums.new(algo)
    view = _buffer()
    offset = 0
    unreported = 0
    while offset < size:
        if stop.is_set():
            raise Stopped
        piece = view[: min(len(view), size - offset)]
        got = os.preadv(src_fd, [piece], offset)
        if got == 0:
            raise Truncated(f"source of {name} ended at byte {offset} of {size}")
        data = piece[:got]
        digest.update(data)
        done = 0
        while done < got:
            wrote = os.pwritev(out, [data[done:]], offset + done)
            if wrote == 0:  # a regular file never answers 0 for bytes given; never loop on it
                raise OSError(errno.EIO, f"a write of {name} took no bytes")
            done += wrote
        offset += got
        unreported += got
        if progress is not None and unreported >= COPY_RANGE_BYTES:
            progress(unreported)
            unreported = 0
    if progress is not None and unreported:
        progress(unreported)
    return digest.value()
