"""A client connection's socket, read with ``recvmsg_into`` into reused buffers.

``recvmsg`` (not ``StreamReader``) because ``put_fd`` hands the daemon an open file
descriptor with SCM_RIGHTS, and because reading straight into a reused buffer is several times
faster than ``readexactly`` for shard bytes.

Received fds queue here with the stream range of the read they came with. Linux ends a read
after the segment that carries fds, and a client attaches an fd to its frame's first byte, so
an fd belongs to the first frame that starts within its read: :meth:`Channel.claim` hands it to
that frame (or closes it, when that frame takes none) and an fd is never carried over to a
later frame. Any left over are closed with the connection.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from ckptdrain.client import wire
from ckptdrain.client.wire import ProtocolError
from ckptdrain.daemon.dataplane import RateFloor
from ckptdrain.daemon.errors import DaemonError, RequestError
from ckptdrain.daemon.fdcloser import MAX_FDS_HELD_PER_UID, FdCloser, closed_if_nothing_queued
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.pumps import SocketPump

T = TypeVar("T")

log = logging.getLogger("ckptdrain.connection")

MAX_FDS_PER_MESSAGE = 4
# Fds waiting for a frame to claim them. A client that passes fds on frames that take none,
# or pipelines many, is cut off here instead of growing the daemon's fd table.
MAX_QUEUED_FDS = 8
# Room for as many fds as one sendmsg can carry (the kernel's SCM_MAX_FD): fds past the room
# were dropped by the kernel inside recvmsg, on the event loop, and the last close of a pipe
# among them waited there for a lock its client held (found attacking: one frame of 5 fds,
# the fifth such a pipe, hung the daemon). Received, every one is closed off the loop.
_SCM_MAX_FD = 253
_ANC_BYTES = socket.CMSG_SPACE(_SCM_MAX_FD * array.array("i").itemsize)


# What one read takes at most: a shard sent inline (put_bytes) in one read, several frames too.
RECV_BUFFER_BYTES = 1 << 20
_per_thread = threading.local()


def _shared_buffer() -> memoryview:
    """This thread's receive buffer: the event loop's, for all of its connections."""
    view: memoryview | None = getattr(_per_thread, "view", None)
    if view is None:
        view = _per_thread.view = memoryview(bytearray(RECV_BUFFER_BYTES))
    return view


class IdleTimeout(DaemonError):
    """The client sent nothing for longer than the idle timeout. ``between_requests``: no
    byte of a request had come since the last reply (no frame begun, no bytes due)."""

    hint = "raise limits.client_idle_timeout_s or limits.open_rank_idle_timeout_s"

    def __init__(self, message: str, *, between_requests: bool = False) -> None:
        super().__init__(message)
        self.between_requests = between_requests

    @property
    def details(self) -> dict[str, str]:
        """The last word's ``details``: whether a request sent as the daemon hung up went
        unread (wire.CLOSED_IDLE), so that a client may send it again (a pooled connection's
        request can race this drop). Clients used to tell by the message's words, which are
        for people and may change."""
        closed = (wire.CLOSED_TOO_SLOW if isinstance(self, TooSlow)
                  else wire.CLOSED_IDLE if self.between_requests else wire.CLOSED_STALLED)
        return {wire.CLOSED: closed}


class DescriptorsShort(DaemonError):
    """The daemon could not receive a client's fd for want of descriptors (EMFILE, ENFILE):
    its shortage, not the client's doing; the connection ends with a retryable refusal."""


class TooSlow(IdleTimeout):
    """A frame or a shard's bytes came slower than limits.client_min_bytes_per_s."""

    hint = "send each request and its bytes without pausing, or lower limits.client_min_bytes_per_s"


class Channel:
    def __init__(self, sock: socket.socket, *, idle_timeout_s: float, min_bytes_per_s: int,
                 rate_grace_s: float, closer: FdCloser, owner: object,
                 held_off: Callable[[], Awaitable[None]]) -> None:
        sock.setblocking(False)
        # Every fd the client passes is charged to ``owner`` (its uid) from the read that
        # brings it, and closed off the loop (a close can block: a lingering socket, a FUSE
        # file, a pipe whose lock the client holds). While the uid has MAX_FDS_HELD_PER_UID in
        # the daemon's hands, ``held_off`` is waited for before each read: it returns once
        # they are fewer, or raises.
        self._closer = closer
        self._owner = owner
        self._held_off = held_off
        self.sock = sock
        self.idle_timeout_s = idle_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self.rate_grace_s = rate_grace_s
        # The transfer under way (a frame begun, a shard's bytes due), paced by a rate floor;
        # None between requests, where only the idle timeout applies.
        self.transfer: RateFloor | None = None
        # (fd, start, end): the stream offsets of the read the fd came with.
        self.fds: collections.deque[tuple[int, int, int]] = collections.deque()
        # The fds that came with the message being served (claim); its handler takes the one
        # it needs, and the rest are closed when the next message is claimed.
        self.frame_fds: list[int] = []
        self._pump: SocketPump | None = None
        self._loop = asyncio.get_running_loop()

    def begin_transfer(self) -> RateFloor:
        if self.transfer is None:
            self.transfer = RateFloor(self.min_bytes_per_s, self.rate_grace_s)
        return self.transfer

    def end_transfer(self) -> None:
        self.transfer = None

    async def receive(self, feed: Callable[[memoryview], None], at: int = 0) -> int:
        """Read at least one byte (0 at EOF) and hand what was read to ``feed``, which must copy
        it (wire.Connection.receive_data does), collecting any passed fds; ``at`` is the
        stream offset of the first byte read (wire.Connection.received_bytes).

        The bytes land in one buffer shared by every connection of this thread's loop, so a
        connection costs no receive buffer of its own (one each, 1 MiB, was resident for as
        long as the connection stayed open once a large read had filled it). That is safe
        because the read and ``feed`` run here with no ``await`` between them: no other
        connection's read can overwrite the bytes before they are copied out."""
        view = _shared_buffer()
        while True:
            if self._closer.fds_of(self._owner) >= MAX_FDS_HELD_PER_UID:
                # Checked before the read, not after: the fds a read brings are in the fd
                # table already, and every connection of the uid may be mid-read at once.
                await self._held_off()
            floor = self.transfer
            if floor is not None and (now := time.monotonic()) > floor.deadline():
                raise TooSlow(str(floor.too_slow(now)))
            try:
                n, anc, flags, _ = self.sock.recvmsg_into([view], _ANC_BYTES)
            except BlockingIOError:
                await self._readable()
                continue
            except ConnectionResetError:
                feed(view[:0])
                return 0
            if floor is not None:
                floor.got += n
            got = 0
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                    got += len(fds)
                    self.fds.extend((fd, at, at + n) for fd in fds)
                    self._closer.received(self._owner, len(fds))
            if flags & socket.MSG_CTRUNC:
                # Room was left for every fd one message can carry: the kernel could not give
                # this process the fds (EMFILE, ENFILE), the daemon's shortage. It was told to
                # the client as its own misuse, and charged to its uid (found attacking).
                self.close_fds()
                raise DescriptorsShort("a file descriptor the client passed could not be "
                                       "received")
            if got > MAX_FDS_PER_MESSAGE:
                # More fds than we accept in one message: closed (off the loop). Refuse.
                self.close_fds()
                raise ProtocolError(wire.BAD_REQUEST, "the client passed more than "
                                    f"{MAX_FDS_PER_MESSAGE} file descriptors in one message; "
                                    "pass exactly one, with the put_fd/put_memfd/fetch frame")
            if len(self.fds) > MAX_QUEUED_FDS:
                self.close_fds()
                raise ProtocolError(wire.BAD_REQUEST, f"the client passed more than "
                                    f"{MAX_QUEUED_FDS} file descriptors no request took; pass "
                                    "one fd with each put_fd/put_memfd/fetch frame only")
            feed(view[:n])
            return n

    async def _readable(self) -> None:
        await self._ready(self._loop.add_reader, self._loop.remove_reader)

    async def _ready(self, add: Callable[..., None], remove: Callable[[int], object]) -> None:
        # A bare timer, not asyncio.timeout: this runs for nearly every read of every
        # connection, and the context (a Timeout, the task lookup, its cancel bookkeeping)
        # was a measurable part of the loop's time per small shard.
        fut: asyncio.Future[bool] = self._loop.create_future()
        fd = self.sock.fileno()
        floor = self.transfer
        due = floor.deadline() - time.monotonic() if floor is not None else self.idle_timeout_s
        add(fd, _settle, fut, True)
        timer = self._loop.call_later(max(0.0, min(due, self.idle_timeout_s)), _settle, fut,
                                      False)
        try:
            ready = await fut
        finally:
            timer.cancel()
            remove(fd)
        if not ready:
            if floor is not None and due < self.idle_timeout_s:
                raise TooSlow(str(floor.too_slow(time.monotonic())))
            # No transfer under way: the reply went out and nothing of a request came since.
            raise IdleTimeout(f"client idle for {self.idle_timeout_s:g} s",
                              between_requests=floor is None)

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
        wait long without reading (``wait``, a fetch from the destination): a client gone need
        not keep its slot till the timeout, nor its read going. Bytes of a pipelined next
        request end the watch; they are read after."""
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

    async def unless_hung_up(self, waiting: Awaitable[T], what: str) -> T:
        """``waiting`` (a wait for room), cut short once the client closes its end: a job
        killed while its hand-offs waited for room left them queued, first in line, till
        ``block_timeout_s``; now they go with it (found attacking: killed waiters held a
        restarted job's hand-offs back). Raises ConnectionError then, as any hang-up does.

        ``waiting`` runs in this task, not one of its own: when there is room it completes
        without a turn of the loop, as it did before the watch (a task of its own let other
        begins run between a begin's checks and its slot, and they then refused it by the
        wrong rule; found in CI). A hang-up cancels this task, and the cancellation is taken
        back once it has reached ``waiting``. The watch itself starts only if ``waiting`` lets
        the loop turn: a hand-off that finds room costs no system call for it."""
        task = asyncio.current_task()
        assert task is not None
        cut = False
        watching = True

        def on_gone(gone: asyncio.Future[None]) -> None:
            nonlocal cut
            # Run from the loop, maybe after the wait ended: only while it is still on.
            if watching and not gone.cancelled():
                cut = True
                task.cancel()

        with contextlib.ExitStack() as watch:

            def start() -> None:
                if watching:
                    watch.enter_context(self.hangup_watch()).add_done_callback(on_gone)

            started = self._loop.call_soon(start)
            try:
                result = await waiting
            except asyncio.CancelledError:
                if cut and task.uncancel() == 0:
                    raise ConnectionError(f"the client hung up while {what}") from None
                raise
            finally:
                watching = False
                started.cancel()
        if cut:  # the wait ended anyway: the cancellation is not this task's to keep
            task.uncancel()
        return result

    async def sendall(self, data: bytes) -> None:
        # Most replies fit the socket's buffer: sent at once, with no timeout context.
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            async with asyncio.timeout(self.idle_timeout_s):
                await self._loop.sock_sendall(self.sock, memoryview(data)[sent:])

    def socket_pump(self) -> SocketPump:
        """The thread-side mover of this connection's shard bytes (see pumps.SocketPump)."""
        if self._pump is None:
            self._pump = SocketPump(self.sock.fileno())
        return self._pump

    def claim(self, frame_start: int) -> None:
        """Make the fds that came with the frame starting at stream offset ``frame_start``
        the current frame's. Fds of earlier reads that no frame started in are closed: never
        handed to a later frame."""
        self.drop_frame_fds()
        while self.fds and self.fds[0][2] <= frame_start:
            self._drop(self.fds.popleft()[0])
        while self.fds and self.fds[0][1] <= frame_start < self.fds[0][2]:
            self.frame_fds.append(self.fds.popleft()[0])

    def drop_frame_fds(self) -> None:
        fds, self.frame_fds = self.frame_fds, []
        for fd in fds:
            self._drop(fd)
        if fds:
            log_event(log, logging.DEBUG, "unclaimed_fds_closed", fds=len(fds))

    def take_frame_fd(self, kind: str) -> int:
        """The one fd the current ``kind`` frame came with (the caller owns it now); a typed
        refusal when it came with none or several."""
        fds, self.frame_fds = self.frame_fds, []
        if len(fds) == 1:
            self._closer.handed_on(self._owner, 1)
            return fds[0]
        for fd in fds:
            self._drop(fd)
        if not fds:
            raise RequestError(wire.BAD_REQUEST, f"{kind} arrived without a file descriptor; "
                               "attach exactly one (SCM_RIGHTS) to the frame's first byte")
        raise RequestError(wire.BAD_REQUEST, f"{kind} arrived with {len(fds)} file descriptors; "
                           "attach exactly one")

    def close_fds(self) -> int:
        """Close every fd no frame claimed; returns how many."""
        closed = 0
        while self.fds:
            self._drop(self.fds.popleft()[0])
            closed += 1
        return closed

    def close_fd(self, fd: int) -> None:
        """Close, off the loop, an fd this client passed (and a handler took), or its socket."""
        self._closer.close(fd, self._owner)

    def _drop(self, fd: int) -> None:
        """Close a passed fd no handler took."""
        self._closer.handed_on(self._owner, 1)
        self.close_fd(fd)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
        self.drop_frame_fds()
        self.close_fds()
        # Closed like a passed fd, off the loop, unless nothing queued in it carries an fd:
        # its last close drops the fds queued in it unread, and one of a pipe whose lock its
        # client holds blocked the event loop in that close (found attacking: a connection
        # hung up on with its next frame, and a pipe, unread).
        if self.sock.fileno() >= 0 and not closed_if_nothing_queued(self.sock):
            self.close_fd(self.sock.detach())



def is_memfd(fd: int) -> bool:
    """A memfd (or another shmem file) answers F_GET_SEALS; other files say EINVAL. A fcntl
    that touches no storage: safe on the loop whatever the fd is."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


def writable(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


def _settle(fut: asyncio.Future[bool], ready: bool) -> None:
    """A readiness wait's end: the fd is ready (True), or its time is up (False)."""
    if not fut.done():
        fut.set_result(ready)
