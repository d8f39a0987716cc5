"""Byte pumps: one shard's bytes from a client into its staging file, in a pump thread.

Two sources, one loop (:meth:`_Pump.pump`): the connection's socket (a ``data`` frame), or a
pipe the client passed with a ``data_pipe`` frame, into which it ``vmsplice``\\ s its buffer so
that the only copy of the bytes is the kernel's into the staged file's pages. Either way the
source is read without blocking and the thread waits with poll() in short slices, so it
notices the client's idle deadline, its rate floor and a cancellation promptly; a client
that holds a pipe open and writes nothing is cut off exactly like a silent socket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import threading
import time
from collections.abc import Callable

from ckptdrain.daemon.dataplane import Cancelled, ClientIdle, RateFloor, write_all
from ckptdrain.daemon.filecopy import start_writeback

PIPE_BYTES = 1 << 20
WRITEBACK_KICK_BYTES = 32 << 20
# How often a pump blocked on a silent client looks at its idle deadline and at cancellation.
POLL_SLICE_S = 0.5
# splice flags: the client's pipe is read without blocking whatever its file flags say (the
# client shares them and may clear O_NONBLOCK); pages move where the kernel can.
_NONBLOCK = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
# What splice answers where a file or socket takes no part in it.
_REFUSED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class PipeEnded(ClientIdle):
    """The client's pipe reached its end before the shard's size (the writer closed it)."""


class PipeOverrun(ClientIdle):
    """The client's pipe held bytes past the shard's size."""


class _Pump:
    """The shared loop: move until ``nbytes`` are in, within the idle and rate limits."""

    def __init__(self, src_fd: int) -> None:
        self.src_fd = src_fd
        self._pipe: tuple[int, int] | None = None
        self._buf: bytearray | None = None
        self.splice_ok = True
        # The connection may close while a cancelled pump is still in its thread: our fds
        # are then closed by the thread on its way out, never under it.
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False
        # When the pump's thread last came back from a system call (see stalled).
        self._beat = time.monotonic()

    def running(self) -> bool:
        """Whether a thread is inside :meth:`pump` now."""
        return self._busy

    def arm(self) -> None:
        """The pump is handed to its pool now: its watchdog counts from here."""
        self._beat = time.monotonic()

    def stalled(self, limit_s: float) -> bool:
        """Whether the armed pump has not beaten for ``limit_s``: it waited that long for a
        thread of its pool, or has been inside one system call that long (between calls it
        beats at least every POLL_SLICE_S)."""
        return time.monotonic() - self._beat > limit_s

    def never_started(self, close_fd: Callable[[int], None]) -> None:
        """The pump could not be handed to a thread: what it owns is closed with ``close_fd``."""

    def pump(self, out_fd: int, nbytes: int, idle_timeout_s: float,
             cancel: threading.Event, floor: RateFloor | None = None) -> int:
        with self._lock:
            if self._closed:
                raise Cancelled
            self._beat = time.monotonic()
            self._busy = True
        try:
            return self._pump(out_fd, nbytes, idle_timeout_s, cancel, floor)
        finally:
            try:
                self._end_transfer()
            finally:
                with self._lock:
                    self._busy = False
                    if self._closed:
                        self._close_fds()

    def _end_transfer(self) -> None:
        """Our pipe and buffer serve one transfer. Kept for the connection's life, every
        connection that had sent one shard held 1 MiB of pipe: the daemon's user may have
        64 MiB of them (pipe-user-pages-soft), past which the kernel hands out small pipes,
        so one user's idle connections slowed every other client's hand-offs. And a pipe
        that outlives its transfer could carry into the next one bytes that a failed splice
        into the file left in it."""
        pipe, self._pipe, self._buf = self._pipe, None, None
        for fd in pipe or ():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _pump(self, out_fd: int, nbytes: int, idle_timeout_s: float,
              cancel: threading.Event, floor: RateFloor | None) -> int:
        poller = select.poll()
        poller.register(self.src_fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        done = kicked = 0
        idle_since = time.monotonic()
        while done < nbytes:
            if cancel.is_set():
                raise Cancelled
            now = self._beat = time.monotonic()
            if floor is not None and now > floor.deadline():
                raise floor.too_slow(now)
            try:
                n = self._move(out_fd, nbytes - done)
            except BlockingIOError:
                if now - idle_since > idle_timeout_s:
                    raise ClientIdle(f"client idle for {idle_timeout_s:g} s mid-shard") from None
                wait = min(POLL_SLICE_S, idle_timeout_s)
                if floor is not None:
                    wait = min(wait, max(0.0, floor.deadline() - now))
                poller.poll(int(wait * 1000) + 1)
                continue
            if n == 0:
                self._ended(done, nbytes)
            done += n
            idle_since = time.monotonic()
            if floor is not None:
                floor.got += n
                # The source is read without blocking, so the move's time is our own disk's:
                # the client is not charged for it (a slow staging disk is not a slow client).
                floor.started += idle_since - now
            if done - kicked >= WRITEBACK_KICK_BYTES:
                # Start writing back what has arrived, so the fsync before the acknowledgement
                # waits for the tail only, not the whole shard.
                start_writeback(out_fd, kicked, done - kicked)
                kicked = done
        self._after(poller)
        return done

    def _ended(self, done: int, nbytes: int) -> None:
        raise ConnectionError("client left mid-shard")

    def _after(self, poller: select.poll) -> None:
        """All ``nbytes`` are in."""

    def _move(self, out_fd: int, want: int) -> int:
        raise NotImplementedError

    def _pipes(self) -> tuple[int, int]:
        if self._pipe is None:
            r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._pipe = (r, w)
            with contextlib.suppress(OSError):  # the default 64 KiB works too, only slower
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        return self._pipe

    def _through_buffer(self, read_fd: int, out_fd: int, want: int) -> int:
        """Where splice into the staging file is refused (some filesystems)."""
        if self._buf is None:
            self._buf = bytearray(PIPE_BYTES)
        view = memoryview(self._buf)[: min(want, PIPE_BYTES)]
        try:
            n = os.readv(read_fd, [view])
        except ConnectionResetError:
            return 0
        write_all(out_fd, view[:n])
        return n

    def _empty_pipe(self, read_fd: int, out_fd: int, left: int) -> None:
        """Write the ``left`` bytes our pipe holds through the buffer (the file refuses
        splice). The pipe holds exactly those: this never waits."""
        while left:
            got = self._through_buffer(read_fd, out_fd, left)
            if got == 0:
                raise OSError(errno.EIO, "the pump's own pipe ended early")
            left -= got

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self._busy:
                self._close_fds()

    def _close_fds(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        if self.src_fd >= 0:
            os.close(self.src_fd)
            self.src_fd = -1


class SocketPump(_Pump):
    """A ``data`` frame's bytes: splice socket -> pipe -> file keeps them in the kernel; where
    splice is refused it falls back to recv into a reused buffer and write. The socket stays
    non-blocking (the event loop owns it between requests)."""

    def __init__(self, sock_fd: int) -> None:
        # Our own reference to the socket: a cancelled pump may outlive the connection's
        # close by a poll slice, and must never find its fd number reused by another client.
        super().__init__(os.dup(sock_fd))

    def _move(self, out_fd: int, want: int) -> int:
        if not self.splice_ok:
            return self._through_buffer(self.src_fd, out_fd, want)
        r, w = self._pipes()
        try:
            n = os.splice(self.src_fd, w, min(want, PIPE_BYTES), flags=_NONBLOCK)
        except ConnectionResetError:
            return 0
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            self.splice_ok = False
            return self._move(out_fd, want)
        left = n
        while left:
            # The pipe holds exactly what was just spliced in: this never waits.
            try:
                left -= os.splice(r, out_fd, left, flags=os.SPLICE_F_MOVE)
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
                # The file takes no splice (an O_APPEND file, some filesystems): what is in
                # the pipe goes through the buffer, and the moves after it skip the pipe.
                self.splice_ok = False
                self._empty_pipe(r, out_fd, left)
                left = 0
        return n


class PipePump(_Pump):
    """A ``data_pipe`` frame's bytes: splice from the client's pipe straight into the file.

    One shard, one pump: it owns ``pipe_fd`` and closes it in its own thread as the pump
    returns (:meth:`pump`), never on the event loop. The pipe is an object its client shares:
    every read and the last close of it take the pipe's lock, which the client can hold
    (a blocking splice of its own into the pipe) for as long as it likes, and the kernel
    waits for that lock uninterruptibly. So only this thread, which a watchdog gives up on
    (DataPlane.pump), ever touches it. Where splice into the file is refused, the bytes
    go pipe -> our pipe (splice between pipes always works, without blocking) -> buffer ->
    file, so a client that clears O_NONBLOCK on its pipe never blocks this thread.

    Exactly ``size`` bytes are read. The end of the pipe is not awaited after them (a forked
    child of the client may hold its write end for long); bytes already past the size when
    the last one is read are refused, and any written later are never read (the writer gets
    EPIPE once the pump closes its end)."""

    def _move(self, out_fd: int, want: int) -> int:
        if self.splice_ok:
            try:
                return os.splice(self.src_fd, out_fd, min(want, PIPE_BYTES), flags=_NONBLOCK)
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
                self.splice_ok = False
        r, w = self._pipes()
        n = os.splice(self.src_fd, w, min(want, PIPE_BYTES), flags=_NONBLOCK)
        self._empty_pipe(r, out_fd, n)
        return n

    def pump(self, out_fd: int, nbytes: int, idle_timeout_s: float,
             cancel: threading.Event, floor: RateFloor | None = None) -> int:
        try:
            return super().pump(out_fd, nbytes, idle_timeout_s, cancel, floor)
        finally:
            self.close()  # in this thread: see the class's docstring

    def never_started(self, close_fd: Callable[[int], None]) -> None:
        with self._lock:
            fd, self.src_fd, self._closed = self.src_fd, -1, True
        if fd >= 0:
            close_fd(fd)

    def _ended(self, done: int, nbytes: int) -> None:
        raise PipeEnded(f"the pipe ended after {done} of the shard's {nbytes} bytes; write "
                        "all of them before closing it")

    def _after(self, poller: select.poll) -> None:
        if any(events & select.POLLIN for _fd, events in poller.poll(0)):
            raise PipeOverrun("the pipe held more bytes than the shard's size; write exactly "
                              "the size the put declared")
