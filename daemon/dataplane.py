"""The data plane: every blocking byte move of a hand-off, in a bounded pool of threads.

The event loop parses, decides, journals and replies; it never copies a shard's bytes, fsyncs,
unlinks or stats the disk. Those calls run here, in ``limits.io_threads`` threads, so hand-off
throughput grows with the node's cores and one client's slow disk or hung mount never stalls
another client's request.

Every call has a timeout (``limits.io_timeout_s``). A call that outlives it fails its
hand-off with :class:`StuckIO`; the thread is counted in :attr:`DataPlane.stuck` (shown in
``status``) until the call returns, and the file descriptors it uses are closed then by the
clean-up the caller handed over, never while the thread may still use them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ckptdrain.daemon.errors import DaemonError, StuckIO
from ckptdrain.daemon.fdcloser import FdCloser
from ckptdrain.daemon.iolane import IoLane, Job

T = TypeVar("T")

COPY_CHUNK_BYTES = 64 << 20
# How often a pump's watchdog looks at it.
WATCH_SLICE_S = 1.0


class Cancelled(DaemonError):
    """The pump was told to stop (its hand-off was cancelled)."""


class SourceEnded(DaemonError, OSError):
    """A client's file held fewer bytes than its size said when copied: truncated during the
    hand-off, or a file whose size stat does not tell (/sys reports 4096 for a few bytes)."""


class SourceUnreadable(DaemonError, OSError):
    """A client's file could not be read at all (a secret-memory file, a device that refuses
    reads): the client's doing, not the daemon's (it was an internal error)."""


class ClientIdle(DaemonError):
    """The client sent nothing for longer than its idle timeout mid-shard."""


class ClientTooSlow(ClientIdle):
    """The client's bytes came slower than ``limits.client_min_bytes_per_s`` on average."""


@dataclass(slots=True)
class RateFloor:
    """One transfer (a frame, a shard's bytes) that must average at least ``rate`` bytes/s
    once ``grace_s`` is over: whatever pace a client keeps, a request it starts ends within
    ``grace_s + size / rate``, so a trickle cannot hold a slot or a reservation for long."""

    rate: int
    grace_s: float
    started: float = field(default_factory=time.monotonic)
    got: int = 0

    def deadline(self) -> float:
        """When the next byte is due at the latest."""
        return self.started + self.grace_s + self.got / self.rate

    def too_slow(self, now: float) -> ClientTooSlow:
        return ClientTooSlow(f"client sent {self.got} bytes in {now - self.started:.1f} s, "
                             f"slower than limits.client_min_bytes_per_s ({self.rate} B/s)")


def io_threads(configured: int) -> int:
    return configured or max(4, min(64, os.cpu_count() or 4))


_PR_SET_NAME = 15
_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: threads keep the process's name
    _prctl = None


def name_os_thread() -> None:
    """Give a pool thread its Python name in the kernel too (``/proc/<pid>/task/<tid>/comm``,
    15 bytes: ``ckptdrain-io_3``, ``ckptdrain-pump_``), so ``top -H`` and the benchmarks can
    tell the event loop (the main thread) from the data plane's threads."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(threading.current_thread().name.encode()[:15]),
               0, 0, 0)


class DataPlane:
    def __init__(self, threads: int, timeout_s: float, *, pumps: int) -> None:
        self.threads = threads
        self.timeout_s = timeout_s
        self._lane = IoLane(threads, "ckptdrain-io", timeout_s, initializer=name_os_thread)
        # Socket pumps wait on their clients, so they get threads of their own (at most one
        # per connection, created as needed): a slow client never takes an fsync's thread.
        # Pipe pumps apart: a client can wedge one (it holds its pipe's lock), and a wedged
        # thread must never keep a socket hand-off waiting for a free one.
        self.pump_threads = 0
        self._pumps, self._pipe_pumps = self._pump_pools(pumps)
        # Pools a reload replaced by larger ones: their pumps finish there (close() ends them).
        self._old_pools: list[concurrent.futures.ThreadPoolExecutor] = []
        # Closing a client's fd can block: never on the loop, nor in a hand-off's thread.
        self.closer = FdCloser()
        # Steps on an fd a client passed (client_call), by the client's uid: a lane each.
        self._client_lanes: dict[object, IoLane] = {}
        self.stuck = 0
        self.busy = 0
        # Stuck pumps by who started them (a uid): such a client is offered no more pipes.
        self.stuck_owners: collections.Counter[object] = collections.Counter()

    def _pump_pools(self, pumps: int) -> tuple[concurrent.futures.ThreadPoolExecutor,
                                               concurrent.futures.ThreadPoolExecutor]:
        self.pump_threads = pumps
        return (concurrent.futures.ThreadPoolExecutor(pumps, thread_name_prefix="ckptdrain-pump",
                                                      initializer=name_os_thread),
                concurrent.futures.ThreadPoolExecutor(pumps, thread_name_prefix="ckptdrain-pipe",
                                                      initializer=name_os_thread))

    def grow_pumps(self, pumps: int) -> None:
        """At least ``pumps`` threads for each kind of pump from now on (a reload raising
        limits.max_clients): one per connection, as at start. Found attacking the reload: the
        pools kept the size of the max_clients the daemon started with, so a reload raising
        it admitted connections whose hand-offs then waited for a pump thread and were given
        up on as stalled (a `timeout` error). Never shrunk: threads are made as needed."""
        if pumps <= self.pump_threads:
            return
        self._old_pools += (self._pumps, self._pipe_pumps)
        for pool in (self._pumps, self._pipe_pumps):
            pool.shutdown(wait=False)  # what it runs or holds queued still runs there
        self._pumps, self._pipe_pumps = self._pump_pools(pumps)

    async def client_call(self, owner: object, fn: Callable[..., T], *args: object,
                          cleanup: Callable[[], None] | None = None,
                          cancel: threading.Event | None = None,
                          abandoned: Callable[[T], None] | None = None) -> T:
        """:meth:`call` for a step on an fd a client passed, in a lane of ``owner``'s (the
        client's uid) own, as many threads as the shared one: the client's file may sit on a
        mount that hangs for good (one it serves itself: sshfs, any FUSE), and a call stuck
        there holds its thread until then. In the shared lane, six fetches into files on a
        frozen filesystem held all its threads, and every other user's hand-offs waited
        behind them until io_timeout_s failed them (found attacking). A uid's stuck calls
        now wait only for its own threads."""
        lane = self._client_lanes.get(owner)
        if lane is None:
            lane = IoLane(self.threads, "ckptdrain-fd", self.timeout_s,
                          initializer=name_os_thread)
            self._client_lanes[owner] = lane
        return await self._call(lane, fn, args, cleanup, cancel, abandoned)

    def release(self, owner: object) -> None:
        """``owner``'s last connection has ended: its lane's threads end too, unless a call
        of its own still runs there (stuck on its file: kept, so that its next connection's
        calls still wait for its own threads, never for more of them). Kept for good, each
        uid that ever passed an fd held as many threads as it once ran at once, up to
        limits.io_threads, to the daemon's end (found attacking the per-uid lanes)."""
        lane = self._client_lanes.get(owner)
        if lane is not None and lane.idle:
            del self._client_lanes[owner]
            lane.close()

    async def call(self, fn: Callable[..., T], *args: object,
                   cleanup: Callable[[], None] | None = None,
                   cancel: threading.Event | None = None,
                   abandoned: Callable[[T], None] | None = None) -> T:
        """Run ``fn(*args)`` in the pool, within ``io_timeout_s``. Never a step on a client's
        fd: that is :meth:`client_call`'s.

        Ownership rule: when ``cleanup`` is given and the call raises, for whatever reason,
        ``cleanup`` has run or will run once the thread returns: the caller must not release
        what it handed over. Without ``cleanup``, or when the call returns, the caller owns
        its resources as before. ``cancel`` is set when the call is given up on, for work
        that can stop part-way (a long copy stops at its next chunk). ``abandoned`` releases
        what such a call returns once its thread does (an fd it opened after the caller
        stopped waiting: nobody else holds it)."""
        return await self._call(self._lane, fn, args, cleanup, cancel, abandoned)

    async def _call(self, lane: IoLane, fn: Callable[..., T], args: tuple[object, ...],
                    cleanup: Callable[[], None] | None, cancel: threading.Event | None,
                    abandoned: Callable[[T], None] | None) -> T:
        try:
            job = lane.submit(fn, args)
        except BaseException:
            # Nothing was queued (a closed data plane, a thread that could not start): what
            # was handed over is released now, as the rule above says.
            if cleanup is not None:
                cleanup()
            raise
        self.busy += 1
        try:
            result = await job.waiter
        except BaseException as exc:
            if cancel is not None:
                cancel.set()
            if job.finished:
                self._left(job.result, job.error, cleanup, abandoned)
            else:
                self._outlived(job, isinstance(exc, TimeoutError), cleanup, abandoned)
            if isinstance(exc, TimeoutError):
                raise _stuck(fn, self.timeout_s) from None
            raise
        self.busy -= 1
        return result

    def _left(self, result: T | None, error: BaseException | None,
              cleanup: Callable[[], None] | None, abandoned: Callable[[T], None] | None) -> None:
        """A call that is done, whose caller did not take what it made: that goes to
        ``abandoned`` (nobody else holds it), and ``cleanup`` runs."""
        self.busy -= 1
        if error is None and abandoned is not None:
            abandoned(result)  # type: ignore[arg-type]  # a call that returned made it
        if cleanup is not None:
            cleanup()

    def _outlived(self, job: Job[T], stuck: bool, cleanup: Callable[[], None] | None,
                  abandoned: Callable[[T], None] | None) -> None:
        """A call its caller stopped waiting for: counted in ``stuck`` (timed out) until its
        thread returns; then what it made is ``abandoned``, and ``cleanup`` runs."""
        self.stuck += stuck

        def late(result: T | None, error: BaseException | None) -> None:
            self.stuck -= stuck
            self._left(result, error, cleanup, abandoned)

        job.late = late

    async def pump(self, fn: Callable[..., T], *args: object, cancel: threading.Event,
                   stalled: Callable[[], bool], pipe: bool = False, owner: object = None,
                   running: Callable[[], bool] | None = None) -> T:
        """Run a byte pump: no overall timeout (it enforces the client's idle timeout and
        rate floor itself); on cancellation ``cancel`` tells it to stop within
        pumps.POLL_SLICE_S. A watchdog looks at ``stalled`` every WATCH_SLICE_S: a pump that
        has not come back from one system call for that long (a pipe whose lock its client
        holds, a staging disk that stopped) is given up on like a stuck call: PumpStalled,
        counted in ``stuck`` until its thread returns, and in ``stuck_owners[owner]`` when
        ``owner`` is given and the pump was ``running`` (one still queued for a thread is not
        its client's doing). The pump owns every fd it uses (its own dups), so giving up on it
        never closes one under it. ``pipe``: a client's pipe, in the pool of their own."""
        return await self._run(self._pipe_pumps if pipe else self._pumps, fn, args, None,
                               cancel, None, stalled, owner, running)

    async def _run(self, pool: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., T],
                   args: tuple[object, ...], limit: float | None, cancel: threading.Event | None,
                   cleanup: Callable[[], None] | None,
                   stalled: Callable[[], bool] | None = None, owner: object = None,
                   running: Callable[[], bool] | None = None,
                   abandoned: Callable[[T], None] | None = None) -> T:
        loop = asyncio.get_running_loop()
        self.busy += 1
        future = loop.run_in_executor(pool, fn, *args)
        try:
            async with asyncio.timeout(limit):
                result = await (asyncio.shield(future) if stalled is None
                                else _watched(future, stalled))
        except BaseException as exc:
            if cancel is not None:
                cancel.set()
            if future.done():
                self._left(*_outcome(future), cleanup, abandoned)
            else:
                # Still running: a timeout means stuck (shown in status); a cancellation only
                # waits for the pump to see its cancel flag.
                stuck = isinstance(exc, TimeoutError | StuckIO)
                self.stuck += stuck
                blamed = (stuck and owner is not None and running is not None and running())
                if blamed:
                    self.stuck_owners[owner] += 1

                def finished(done: asyncio.Future[T]) -> None:
                    self.stuck -= stuck
                    if blamed:
                        self.stuck_owners[owner] -= 1
                        if self.stuck_owners[owner] <= 0:
                            del self.stuck_owners[owner]
                    self._left(*_outcome(done), cleanup, abandoned)

                future.add_done_callback(finished)
            if isinstance(exc, TimeoutError):
                raise _stuck(fn, limit or 0) from None
            raise
        self.busy -= 1
        return result

    def close_client_fd(self, fd: int, owner: object) -> None:
        """Close an fd a client passed, in a thread, charged to ``owner`` (its uid; None only
        where no client is known): FdCloser.close."""
        self.closer.close(fd, owner)

    def close(self) -> None:
        # Stuck threads cannot be joined: leave them to the process's exit.
        self._lane.close()
        for lane in self._client_lanes.values():
            lane.close()
        for pool in (*self._old_pools, self._pumps, self._pipe_pumps):
            pool.shutdown(wait=False, cancel_futures=True)


def _outcome(future: asyncio.Future[T]) -> tuple[T | None, BaseException | None]:
    """A done future's (result, error); a cancelled one made nothing."""
    if future.cancelled():
        return None, asyncio.CancelledError()
    error = future.exception()
    return (future.result() if error is None else None), error


def _stuck(fn: Callable[..., object], limit_s: float) -> StuckIO:
    return StuckIO(f"a blocking call ({getattr(fn, '__name__', fn)}) took longer than "
                   f"{limit_s:g} s (limits.io_timeout_s)")


class PumpStalled(StuckIO):
    """A pump did not beat within its watchdog's limit (queued, or inside one system call)."""


async def _watched(future: asyncio.Future[T], stalled: Callable[[], bool]) -> T:
    while True:
        # asyncio.wait leaves the future running when it times out or is cancelled.
        done, _ = await asyncio.wait({future}, timeout=WATCH_SLICE_S)
        if done:
            return future.result()
        if stalled():
            raise PumpStalled("the hand-off's bytes stopped moving (its pump waited for a "
                              "thread, or sat inside one system call: a pipe whose client "
                              "holds its lock, a staging disk that stopped answering)")


# -- blocking steps, run in the pool ---------------------------------------------------------
def readable(fd: int) -> bool:
    """Whether ``fd`` was opened for reading (a client's; blocking: it may be on a hung mount)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    # An O_PATH descriptor reports O_RDONLY as its access mode, yet cannot be read.
    return not flags & os.O_PATH and flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)




def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


_WRITE_FULL = (errno.ENOSPC, errno.EDQUOT)
# What the read-then-write fallback moves at a time, into a page-aligned buffer (the alignment
# and the size an O_DIRECT file's reads need).
_BOUNCE_BYTES = 1 << 20


def _read_then_write(src: int, dst: int, offset: int, want: int) -> int:
    """Up to ``want`` bytes of ``src`` at ``offset`` written at ``dst``'s file position, as the
    kernel copies write (a later chunk one of them copies lands after these: found attacking,
    with ``pwrite`` it overwrote them); how many (0 at the end of ``src``). A read that fails
    is the source's fault (:class:`SourceUnreadable`); a write that fails is the staging
    disk's (OSError)."""
    with mmap.mmap(-1, _BOUNCE_BYTES) as buf, memoryview(buf) as view:
        done = 0
        while done < want:
            try:
                # Always the whole buffer: an O_DIRECT read's length must be aligned too. Past
                # ``want`` what came is not used (the file may hold more than its size said).
                got = min(os.preadv(src, [view], offset + done), want - done)
            except OSError as exc:
                raise SourceUnreadable(exc.errno, f"the file cannot be read ({exc.strerror})") \
                    from None
            if got <= 0:
                break
            written = 0
            while written < got:
                written += os.write(dst, view[written:got])
            done += got
        return done


def kernel_copy(src: int, dst: int, size: int, cancel: threading.Event | None = None) -> None:
    """Copy with copy_file_range (in-kernel, no user-space bounce), sendfile as fallback.
    Stops at the next chunk once ``cancel`` is set (the hand-off was given up on)."""
    offset = 0
    while offset < size:
        if cancel is not None and cancel.is_set():
            raise Cancelled
        want = min(COPY_CHUNK_BYTES, size - offset)
        try:
            n = os.copy_file_range(src, dst, want, offset)
        except OSError as exc:
            if exc.errno in _WRITE_FULL:
                raise
            try:
                n = os.sendfile(dst, src, offset, want)
            except OSError as again:
                if again.errno in _WRITE_FULL:
                    raise
                # Both kernel copies refuse some files a read takes (one opened with O_DIRECT,
                # whose reads must be aligned), and fail alike whichever side is at fault:
                # a plain read tells the client's file from the staging disk.
                n = _read_then_write(src, dst, offset, want)
        if n == 0:
            raise SourceEnded(errno.EIO, f"the file ended at byte {offset} of the {size} its "
                              "size said")
        offset += n
