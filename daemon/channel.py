"""A client connection's socket, read with ``recvmsg_into`` into reused buffers.

``recvmsg`` (not ``StreamReader``) because ``put_fd`` hands the daemon an open file
descriptor with SCM_RIGHTS, and because reading straight into a reused buffer is several times
faster than ``readexactly`` for shard bytes. Received fds queue here until a frame claims them;
any left over are closed with the connection.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import fcntl
import os
import socket
import struct

MAX_FDS_PER_MESSAGE = 4
SPLICE_PIPE_BYTES = 1 << 20
_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_ANC_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


class IdleTimeout(Exception):
    """The client sent nothing for longer than the idle timeout."""


class Channel:
    def __init__(self, sock: socket.socket, *, idle_timeout_s: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.idle_timeout_s = idle_timeout_s
        self.fds: collections.deque[int] = collections.deque()
        self._pipe: tuple[int, int] | None = None
        self._loop = asyncio.get_running_loop()

    def peer_credentials(self) -> tuple[int, int, int]:
        """(pid, uid, gid) of the connected process, from the kernel (SO_PEERCRED)."""
        raw = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return pid, uid, gid

    async def recv_into(self, view: memoryview) -> int:
        """Read at least one byte into ``view`` (0 at EOF), collecting any passed fds."""
        while True:
            try:
                n, anc, flags, _ = self.sock.recvmsg_into([view], _ANC_BYTES)
            except BlockingIOError:
                await self._readable()
                continue
            except ConnectionResetError:
                return 0
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                    self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                # More fds than we accept in one message: the kernel dropped some. Refuse.
                raise ConnectionError("client passed too many file descriptors at once")
            return n

    async def _readable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        self._loop.add_reader(fd, wake)
        try:
            await asyncio.wait_for(fut, self.idle_timeout_s)
        except TimeoutError:
            raise IdleTimeout(f"client idle for {self.idle_timeout_s:g} s") from None
        finally:
            self._loop.remove_reader(fd)

    async def sendall(self, data: bytes) -> None:
        await asyncio.wait_for(self._loop.sock_sendall(self.sock, data), self.idle_timeout_s)

    async def splice_to(self, out_fd: int, max_bytes: int) -> int:
        """Move up to ``max_bytes`` from the socket into ``out_fd`` inside the kernel
        (socket -> pipe -> file with splice): no copy through Python buffers. 0 at EOF."""
        if self._pipe is None:
            r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._pipe = (r, w)
            with contextlib.suppress(OSError):  # the default 64 KiB works too, only slower
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, SPLICE_PIPE_BYTES)
        r, w = self._pipe
        want = min(max_bytes, SPLICE_PIPE_BYTES)
        while True:
            try:
                n = os.splice(self.sock.fileno(), w, want, flags=_SPLICE_FLAGS)
                break
            except BlockingIOError:
                await self._readable()
            except ConnectionResetError:
                return 0
        left = n
        while left:
            # The pipe holds exactly what was just spliced in: this never waits.
            left -= os.splice(r, out_fd, left, flags=os.SPLICE_F_MOVE)
        return n

    def take_fd(self) -> int | None:
        return self.fds.popleft() if self.fds else None

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.popleft())
        self.sock.close()
