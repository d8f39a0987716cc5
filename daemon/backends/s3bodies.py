"""How an upload worker puts a part's bytes into its HTTP request: ``sendfile`` from the staged
file straight into the connection's socket.

Written from user space, every byte of a part was copied twice on its way out: from the page
cache into a part buffer (a pread), then from that buffer into the socket (``send``), the second
on the worker's event-loop thread, which made it the busiest thread of the S3 drain. With
``sendfile`` the kernel hands page-cache pages to the socket itself, in a thread of its own,
and the checksum the request declares is read beforehand through a small reused buffer
(:func:`checksum_range`, in the page cache right after the hand-off). The server checks that
checksum against the bytes it receives, so a staged file that changed in between is refused,
never stored. Where ``sendfile`` cannot serve (TLS, a transport that buffers), the body is read
through the same small buffer and written as slices: no part-sized buffer either way.
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
from typing import Any

import aiohttp.payload

from ckptdrain.daemon import checksums
from ckptdrain.daemon.filecopy import checksum_into
from ckptdrain.daemon.threads import settled

# How long one part may wait for its socket to take more bytes; botocore's read timeout bounds
# the answer, this bounds the body (a server that stops reading).
SEND_STALL_S = 60.0
# How often a sending thread looks whether its request was given up.
_POLL_MS = 200
# The slice size of the fallback path.
_SLICE_BYTES = 1 << 20


def checksum_range(fd: int, offset: int, length: int) -> int:
    """The CRC64NVME of ``length`` bytes of the staged file ``fd`` at ``offset``, from a
    mapping of its pages (the daemon's own file, never shrunk: see filecopy.checksum_into)
    (blocking: worker threads only)."""
    digest = checksums.Crc64nvme()
    done = checksum_into(fd, offset, length, digest, owned=True)
    if done < length:
        raise OSError(f"staged file ended at byte {offset + done}, before the "
                      f"{offset + length} bytes declared: it was truncated after hand-off")
    return digest.crc


def _sendfile_all(sock_fd: int, fd: int, offset: int, length: int,
                  stop: threading.Event) -> None:
    """Send ``length`` bytes of ``fd`` at ``offset`` to the non-blocking socket ``sock_fd``."""
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    sent = 0
    stalled_ms = 0
    while sent < length:
        if stop.is_set():
            raise ConnectionAbortedError("the part was given up while it was sent")
        try:
            n = os.sendfile(sock_fd, fd, offset + sent, length - sent)
        except BlockingIOError:
            if poller.poll(_POLL_MS):
                stalled_ms = 0
            else:
                stalled_ms += _POLL_MS
                if stalled_ms >= SEND_STALL_S * 1000:
                    raise TimeoutError(f"the server took no bytes for {SEND_STALL_S:g} s") from None
            continue
        if n == 0:
            raise OSError(f"staged file ended at byte {offset + sent}, before the "
                          f"{offset + length} bytes declared: it was truncated after hand-off")
        sent += n


class FileBody(aiohttp.payload.Payload):
    """``length`` bytes of the staged file ``fd`` at ``offset`` as a request body (the caller
    owns ``fd`` and keeps it open until the request is done).

    Only for clients built with ``file_bodies`` (parameter validation off: botocore does not
    know this type, and must not treat it as a file, which would add ``Expect: 100-continue``).
    """

    _autoclose = True

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__(b"", content_type="application/octet-stream")
        self._fd = fd
        self._offset = offset
        self._size = length
        self.sendfile_used = False  # tests: whether the kernel path served

    def __len__(self) -> int:
        return int(self._size or 0)

    def seek(self, offset: int, whence: int = 0) -> int:
        """botocore rewinds a request's body before each retry (and gives the request up if
        it cannot): this body is always written from its first byte, so rewinding is a no-op."""
        return 0

    def tell(self) -> int:
        return 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a shard body is binary")

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        length = len(self) if content_length is None else min(len(self), content_length)
        transport = writer.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if (sock is None or transport.get_extra_info("sslcontext") is not None
                or getattr(writer, "chunked", False) or getattr(writer, "_compress", None)):
            await self._write_slices(writer, length)
            return
        # The headers go first, through the transport; the body may only follow once the
        # transport holds nothing back, or the two would interleave on the socket.
        writer.send_headers()
        await writer.drain()
        for _ in range(1000):
            if not transport.get_write_buffer_size():
                break
            await asyncio.sleep(0.005)
        else:
            await self._write_slices(writer, length)
            return
        self.sendfile_used = True
        await in_thread(_sendfile_all, sock.fileno(), self._fd, self._offset, length)
        writer.output_size += length
        if writer.length is not None:
            writer.length = max(0, writer.length - length)

    async def _write_slices(self, writer: Any, length: int) -> None:
        buf = memoryview(bytearray(min(_SLICE_BYTES, max(length, 1))))
        done = 0
        while done < length:
            want = min(len(buf), length - done)
            n = await in_thread(os.preadv, self._fd, [buf[:want]], self._offset + done)
            if n == 0:
                raise OSError("the staged file ended before the part did: it was truncated")
            await writer.write(bytes(buf[:n]))
            done += n


async def in_thread(fn: Any, *args: Any) -> Any:
    """``fn`` in the loop's executor; a cancelled caller waits for the thread to end, so no
    thread still reads the fd or writes to the socket once the request is given up. A
    sendfile in flight is told to stop (its ``stop`` argument) at its next poll."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    call_args = (*args, stop) if fn is _sendfile_all else args
    return await settled(loop.run_in_executor(None, fn, *call_args), stop=stop)
