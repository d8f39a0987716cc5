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
import os
import socket
import time
from collections.abc import Callable, Iterator

from ckptdrain.daemon.dataplane import RateFloor, SocketPump
from ckptdrain.daemon.errors import DaemonError

MAX_FDS_PER_MESSAGE = 4
# Fds waiting for a frame to claim them. A client that passes fds on frames that take none,
# or pipelines many, is cut off here instead of growing the daemon's fd table.
MAX_QUEUED_FDS = 8
_ANC_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


class IdleTimeout(DaemonError):
    """The client sent nothing for longer than the idle timeout."""

    hint = "raise limits.client_idle_timeout_s or limits.open_rank_idle_timeout_s"


class TooSlow(IdleTimeout):
    """A frame or a shard's bytes came slower than limits.client_min_bytes_per_s."""

    hint = "send each request and its bytes without pausing, or lower limits.client_min_bytes_per_s"


class Channel:
    def __init__(self, sock: socket.socket, *, idle_timeout_s: float, min_bytes_per_s: int,
                 rate_grace_s: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.idle_timeout_s = idle_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self.rate_grace_s = rate_grace_s
        # The transfer under way (a frame begun, a shard's bytes due), paced by a rate floor;
        # None between requests, where only the idle timeout applies.
        self.transfer: RateFloor | None = None
        self.fds: collections.deque[int] = collections.deque()
        self._pump: SocketPump | None = None
        self._loop = asyncio.get_running_loop()

    def begin_transfer(self) -> RateFloor:
        if self.transfer is None:
            self.transfer = RateFloor(self.min_bytes_per_s, self.rate_grace_s)
        return self.transfer

    def end_transfer(self) -> None:
        self.transfer = None

    async def recv_into(self, view: memoryview) -> int:
        """Read at least one byte into ``view`` (0 at EOF), collecting any passed fds."""
        while True:
            floor = self.transfer
            if floor is not None and (now := time.monotonic()) > floor.deadline():
                raise TooSlow(str(floor.too_slow(now)))
            try:
                n, anc, flags, _ = self.sock.recvmsg_into([view], _ANC_BYTES)
            except BlockingIOError:
                await self._readable()
                continue
            except ConnectionResetError:
                return 0
            if floor is not None:
                floor.got += n
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                    self.fds.extend(fds)
            if len(self.fds) > MAX_QUEUED_FDS:
                self.close_fds()
                raise ConnectionError(f"client passed more than {MAX_QUEUED_FDS} file "
                                      "descriptors no request took")
            if flags & socket.MSG_CTRUNC:
                # More fds than we accept in one message: the kernel dropped some. Refuse.
                raise ConnectionError("client passed too many file descriptors at once")
            return n

    async def _readable(self) -> None:
        await self._ready(self._loop.add_reader, self._loop.remove_reader)

    async def _ready(self, add: Callable[..., None], remove: Callable[[int], object]) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        floor = self.transfer
        due = floor.deadline() - time.monotonic() if floor is not None else self.idle_timeout_s
        add(fd, wake)
        try:
            await asyncio.wait_for(fut, max(0.0, min(due, self.idle_timeout_s)))
        except TimeoutError:
            if floor is not None and due < self.idle_timeout_s:
                raise TooSlow(str(floor.too_slow(time.monotonic()))) from None
            raise IdleTimeout(f"client idle for {self.idle_timeout_s:g} s") from None
        finally:
            remove(fd)

    async def send_with_fd(self, data: bytes, fd: int) -> None:
        """Send ``data`` with ``fd`` riding on its first byte (SCM_RIGHTS): a reply that
        hands the client a file."""
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while True:
            try:
                sent = self.sock.sendmsg([data], rights)
                break
            except BlockingIOError:
                await self._ready(self._loop.add_writer, self._loop.remove_writer)
        if sent < len(data):
            await self.sendall(data[sent:])

    @contextlib.contextmanager
    def hangup_watch(self) -> Iterator[asyncio.Future[None]]:
        """A future done once the client has closed its end (EOF or reset), for requests that
        wait long without reading (``wait``): a client gone need not keep its slot till the
        timeout. Bytes of a pipelined next request end the watch; they are read after."""
        gone: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()

        def check() -> None:
            try:
                data = self.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            self._loop.remove_reader(fd)
            if not data and not gone.done():
                gone.set_result(None)

        self._loop.add_reader(fd, check)
        try:
            yield gone
        finally:
            # At once, not from a done-callback: the next recv adds its own reader on this fd.
            self._loop.remove_reader(fd)
            gone.cancel()

    async def sendall(self, data: bytes) -> None:
        await asyncio.wait_for(self._loop.sock_sendall(self.sock, data), self.idle_timeout_s)

    def socket_pump(self) -> SocketPump:
        """The thread-side mover of this connection's shard bytes (see dataplane.SocketPump)."""
        if self._pump is None:
            self._pump = SocketPump(self.sock.fileno())
        return self._pump

    def take_fd(self) -> int | None:
        return self.fds.popleft() if self.fds else None

    def close_fds(self) -> int:
        """Close every fd no frame claimed; returns how many."""
        closed = 0
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.popleft())
            closed += 1
        return closed

    def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
        self.close_fds()
        self.sock.close()
