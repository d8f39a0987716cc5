"""Shards read from the destination for a client (``fetch`` with source ``destination``, a
DrainReader's path for a shard this node holds no copy of), on an event loop of their own.

Reading an S3 object is parsing HTTP answers, and that runs on the event loop that reads
them. On the daemon's loop, which serves every client and decides every drain, a loading job
whose ranks fetch their shards at once cost that loop about 0.5 CPU s per GB (the `restore`
benchmark's fetch row). So reads for clients go through a backend of their own, built on
first use on a thread of its own (``ckptdrain-fetch``) with its own event loop and
connections; the daemon's loop sends it the request and awaits the answer. A POSIX
destination copies in that backend's threads, as the daemon's own does.

One owner for the client's fd on each side. The read writes into a duplicate of it, which
the fetcher owns from the call on and closes (off any loop: a close can flush to a slow
mount) once the read on the other loop has ended, writes included; the connection keeps its
own and closes it when it likes. A thread still writing can then never write into a reused
fd number, someone else's file. A cancelled caller (the daemon is stopping) or one whose
client hung up waits for the read to end, up to ``CANCEL_GRACE_S``: a read ends within a turn
or two of its loop once cancelled, unless a write into the client's file is stuck in the
kernel (a frozen or hung filesystem), which must not hold the connection, or the daemon's
stop, for as long as the kernel likes.

The reads are tasks of the reading loop, not of a TaskGroup of the caller's: a TaskGroup
cannot span two loops. What owns them is the loop's intake (:class:`_Intake`): every read it
took in is run and ended before the loop closes, and each one's end is what answers its
caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.dataplane import name_os_thread
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import outlast

log = logging.getLogger("ckptdrain.fetcher")

T = TypeVar("T")

# How long closing waits for the reading loop: its backend's clean-up, then its tasks (the
# thread is joined for longer than the two together). Past it the thread is left to the
# process's exit (it is a daemon thread).
CLOSE_TIMEOUT_S = 10.0
# How long a cancelled fetch waits for its read to end (see above).
CANCEL_GRACE_S = 5.0
# Fetchers kept for uids with no connection now, the most recently used: a reader fetches
# each shard on a connection of its own, so a uid's fetcher closed with its last connection
# was built again (an S3 client, its connections) for nearly every fetch of a lone reader.
MAX_IDLE_FETCHERS = 4


class _Intake:
    """The reading loop and what it takes in. A read is queued on the loop only while the
    intake is open, under its lock; the loop's thread shuts it before its last turns, so
    every read queued is run and ended before the loop closes, and none is dropped unrun
    with its caller waiting for good."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writers: ThreadPoolExecutor) -> None:
        self.loop = loop
        self.writers = writers
        self._lock = threading.Lock()
        self._open = True

    def submit(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._open:
                self.loop.call_soon_threadsafe(callback)
            return self._open

    def shut(self) -> None:
        with self._lock:
            self._open = False


class Fetcher:
    """Copies of destination objects into clients' files, off the daemon's event loop."""

    def __init__(self, open_reader: Callable[[], Backend], *,
                 close_fd: Callable[[int, int], None]) -> None:
        """``open_reader``: a new backend for the daemon's destination (called once, on the
        reading loop; it is synchronous and does no I/O); ``close_fd``: how a duplicate of a
        client's fd is closed (without blocking the caller), charged to the client's uid."""
        self._open_reader = open_reader
        self._close_fd = close_fd
        self._intake: _Intake | None = None
        self._thread: threading.Thread | None = None
        self._reader: Backend | None = None
        self._starting = asyncio.Lock()
        self._closed = False
        # Outcomes callers await, until each is settled: what closing settles if the reading
        # loop could not answer them (its thread stuck past the join).
        self._waiting: set[asyncio.Future[Any]] = set()

    @property
    def busy(self) -> bool:
        """Whether a read (or the backend's start) is still running on the reading loop, or
        a caller waits for one: a read whose caller gave up after CANCEL_GRACE_S counts
        until it ends (a write stuck in a client's file)."""
        return bool(self._waiting) or self._starting.locked()

    @property
    def thread(self) -> threading.Thread | None:
        """The reading loop's thread, once started."""
        return self._thread

    async def copy_into(self, key: str, into: int, owner: int, *, algo: str = checksums.ALGO,
                        expected_size: int | None = None,
                        gone: asyncio.Future[None] | None = None) -> tuple[int, str]:
        """``Backend.copy_into`` of ``key`` into ``into``, a duplicate of a client's fd that
        this fetcher owns from the call on and closes (charged to ``owner``, the client's
        uid) once the read has ended, however it ends. ``gone``: done once the client has hung up; the read is then stopped and
        ConnectionError raised (no reply is owed to a client that left)."""
        try:
            intake, reader = await self._started()
        except BaseException:
            self._close_fd(into, owner)
            raise
        return await self._there(
            intake, lambda: reader.copy_into(key, into, algo=algo, expected_size=expected_size),
            grace_s=CANCEL_GRACE_S, after=lambda: self._close_fd(into, owner), gone=gone)

    async def _started(self) -> tuple[_Intake, Backend]:
        async with self._starting:
            if self._closed:
                raise _stopping()
            if self._intake is None:
                try:
                    loop = asyncio.new_event_loop()
                except OSError as exc:  # out of file descriptors
                    raise _cannot_start(exc) from None
                # Its own pool for the writes into clients' files, shut without waiting at
                # close: the stdlib's shutdown_default_executor joins its threads, so a
                # write stuck in the kernel would hold the loop's thread, past any timeout.
                writers = ThreadPoolExecutor(thread_name_prefix="ckptdrain-fetch-w")
                loop.set_default_executor(writers)
                intake = _Intake(loop, writers)
                thread = threading.Thread(target=_serve, args=(intake,), name="ckptdrain-fetch",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # out of threads
                    loop.close()
                    writers.shutdown(wait=False)
                    raise _cannot_start(exc) from None
                self._intake, self._thread = intake, thread
            if self._reader is None:
                # Built on its own loop: its locks, semaphores and connections belong there.
                self._reader = await self._there(self._intake, self._open)
            return self._intake, self._reader

    async def _open(self) -> Backend:
        return self._open_reader()

    async def _there(self, intake: _Intake, work: Callable[[], Coroutine[Any, Any, T]], *,
                     grace_s: float | None = None, after: Callable[[], None] | None = None,
                     gone: asyncio.Future[None] | None = None) -> T:
        """Run ``work()`` as a task on the reading loop and await its outcome here; ``after()``
        runs once that task has ended, however it ends (or at once, if it is never taken in).
        Cancelled, or once ``gone`` is done first, cancel it there and wait, through any
        further cancels, until it has ended (or ``grace_s`` has passed): the task's own end is
        what says so. A concurrent future's would not (cancelled, it is done at once while the
        work it stood for runs on), and neither would the coroutine's own ``finally`` (a task
        cancelled before its first step never runs its body)."""
        here = asyncio.get_running_loop()
        outcome: asyncio.Future[T] = here.create_future()
        self._waiting.add(outcome)
        outcome.add_done_callback(self._waiting.discard)
        tasks: list[asyncio.Task[T]] = []  # touched on the reading loop only
        asked = False  # whether this side stopped the work

        def report(task: asyncio.Task[T]) -> None:  # on this loop, once the task is done
            error = None if task.cancelled() else task.exception()  # retrieved, either way
            if outcome.done():
                return
            if asked:  # however it ended, a caller that stopped it takes no result of it
                outcome.cancel()
            elif task.cancelled():  # ended by the reading loop's stop, not by this side
                outcome.set_exception(_stopping())
            elif error is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(task.result())

        def ended(task: asyncio.Task[T]) -> None:
            if after is not None:
                after()
            with contextlib.suppress(RuntimeError):  # the daemon's loop is closed: nobody waits
                here.call_soon_threadsafe(report, task)

        def start() -> None:
            task = intake.loop.create_task(work())
            task.add_done_callback(ended)
            tasks.append(task)

        def cancel() -> None:  # queued after start(): the loop runs its callbacks in order
            for task in tasks:
                task.cancel()

        async def call_off() -> None:
            nonlocal asked
            asked = True
            intake.submit(cancel)  # shut: the loop is ending, and ends the task itself
            await outlast(outcome, grace_s)
            if outcome.done() and not outcome.cancelled():
                outcome.exception()  # retrieved: the caller does not take it

        if not intake.submit(start):
            outcome.cancel()
            if after is not None:
                after()
            raise _stopping()
        try:
            if gone is None:
                return await asyncio.shield(outcome)
            either: list[asyncio.Future[Any]] = [outcome, gone]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if outcome.done():
                return outcome.result()
        except asyncio.CancelledError:
            await call_off()
            raise
        await call_off()
        raise ConnectionError("the client hung up during its fetch")

    async def aclose(self) -> None:
        """Close the reading backend and stop its loop (after every fetch has ended: the
        daemon closes this once its connections are gone)."""
        async with self._starting:
            self._closed = True
            intake, thread, reader = self._intake, self._thread, self._reader
            self._intake = self._thread = self._reader = None  # closed once
        if intake is None or thread is None:
            return
        try:
            if reader is not None:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    # A short grace once the timeout has cancelled it: the loop's stop ends it.
                    await self._there(intake, reader.aclose, grace_s=1.0)
        except Exception as exc:  # closing goes on: the loop must stop
            log_event(log, logging.WARNING, "fetch_close_failed", error=str(exc) or repr(exc))
        intake.submit(functools.partial(_finish_soon, intake))
        # The thread ends when its loop has stopped and closed (at most a close timeout for
        # its tasks, then a second for what was still queued): joined in a thread, so a
        # stuck write into a client's file cannot hold the daemon's loop here.
        join_s = 3 * CLOSE_TIMEOUT_S
        await asyncio.to_thread(thread.join, join_s)
        if thread.is_alive():
            log_event(log, logging.WARNING, "fetch_thread_stuck", timeout_s=join_s,
                      action="left to the process's exit")
        # A caller the loop could not answer (its thread stuck past the join) is answered
        # now rather than never; the duplicate it wrote into stays with the stuck thread.
        for outcome in list(self._waiting):
            if not outcome.done():
                outcome.set_exception(_stopping())
                outcome.exception()  # retrieved: a caller gone already is not an error


class Fetchers:
    """A :class:`Fetcher` per uid, started on its first fetch: a read writes into the
    client's file, which may sit on a mount that hangs for good (sshfs or any FUSE mount its
    user serves hangs at will), and a write stuck there holds its reading loop's thread or a
    thread of its backend. Through one fetcher for all, a user's fetches into files on a
    frozen filesystem held every thread of its backend, and every other user's fetch from
    the destination (a DrainReader's read of a shard with no local copy here) timed out
    behind them (found attacking). At most one per uid connected now or with a read still
    running, and :data:`MAX_IDLE_FETCHERS` more (:meth:`release`)."""

    def __init__(self, open_reader: Callable[[], Backend], *,
                 close_fd: Callable[[int, int], None]) -> None:
        self._open_reader = open_reader
        self._close_fd = close_fd
        self._of: dict[int, Fetcher] = {}
        self._calls: dict[int, int] = {}  # copy_into calls in progress, by uid
        # Uids whose last connection has ended, the longest gone first (dicts keep order).
        self._gone: dict[int, None] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    async def copy_into(self, key: str, into: int, owner: int, *, algo: str = checksums.ALGO,
                        expected_size: int | None = None,
                        gone: asyncio.Future[None] | None = None) -> tuple[int, str]:
        """:meth:`Fetcher.copy_into`, by ``owner``'s own fetcher."""
        self._gone.pop(owner, None)
        fetcher = self._of.get(owner)
        if fetcher is None:
            if self._closed:
                self._close_fd(into, owner)
                raise _stopping()
            fetcher = self._of[owner] = Fetcher(self._open_reader, close_fd=self._close_fd)
        self._calls[owner] = self._calls.get(owner, 0) + 1
        try:
            return await fetcher.copy_into(key, into, owner, algo=algo,
                                           expected_size=expected_size, gone=gone)
        finally:
            left = self._calls.pop(owner) - 1
            if left:
                self._calls[owner] = left

    def release(self, owner: int) -> None:
        """``owner``'s last connection has ended: past :data:`MAX_IDLE_FETCHERS` such uids,
        the fetchers of those gone longest are closed (each in a task of its own), but not
        one whose read still runs (stuck writing into its file: kept, so that its uid's
        next reads share its threads rather than add more). Kept for good, each uid that
        ever read from the destination held a thread, an event loop's fds and a backend (an
        S3 client and its connections) to the daemon's end (found attacking the per-uid
        fetchers: 3 threads and 3 fds more per uid, file://)."""
        self._gone.pop(owner, None)  # (re)placed last: gone the most recently
        if owner in self._of:
            self._gone[owner] = None
        for uid in list(self._gone)[:max(0, len(self._gone) - MAX_IDLE_FETCHERS)]:
            fetcher = self._of[uid]
            if self._calls.get(uid) or fetcher.busy:
                continue  # looked at again at the next release
            del self._of[uid], self._gone[uid]
            task = asyncio.get_running_loop().create_task(fetcher.aclose(),
                                                          name="ckptdrain-fetch-close")
            self._closing.add(task)
            task.add_done_callback(_closed_one)
            task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Close every uid's fetcher, at once: each may wait for a stuck thread."""
        self._closed = True
        await asyncio.gather(*(f.aclose() for f in self._of.values()), *self._closing)


def _closed_one(task: asyncio.Task[None]) -> None:
    # Fetcher.aclose logs what it could not close; anything else is logged here, never
    # left as "Task exception was never retrieved".
    if not task.cancelled() and task.exception() is not None:
        log_event(log, logging.WARNING, "fetch_close_failed",
                  error=repr(task.exception()))


def _stopping() -> BackendError:
    return BackendError("the daemon is stopping and its reads from the destination have "
                        "ended; retry once it is back", transient=True)


def _cannot_start(exc: BaseException) -> BackendError:
    return BackendError(f"the daemon could not start its thread for reads from the "
                        f"destination ({exc}); it is short of threads or file descriptors: "
                        "retry shortly", transient=True)


def _serve(intake: _Intake) -> None:
    loop = intake.loop
    name_os_thread()
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # Reads queued as the loop stopped: one more turn runs those taken in before the
        # intake shut (their tasks made), then every task left is ended here, so that each
        # caller (waiting on its task's end) hears of it rather than waiting for good.
        intake.shut()
        loop.run_until_complete(asyncio.sleep(0))
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            # A task made in the last turn ends at once; one stuck on a write has had
            # _finish's timeout already.
            loop.run_until_complete(asyncio.wait(left, timeout=1.0))
    finally:
        intake.shut()
        loop.close()


def _finish_soon(intake: _Intake) -> None:
    """On the reading loop: :func:`_finish` as a task of its own (created here, so that a
    loop closed meanwhile leaves no coroutine behind that never ran)."""
    task = intake.loop.create_task(_finish(intake))
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)


# The closing tasks, referenced until they end (the loop itself holds tasks weakly).
_finishing: set[asyncio.Task[None]] = set()


async def _finish(intake: _Intake) -> None:
    """On the reading loop: end what is left on it and its async generators (a read's
    stream broken off), shut its writers' pool without waiting (a write stuck in the kernel
    keeps its thread, left to the process's exit), then stop it."""
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me]
    for task in left:
        task.cancel()
    try:
        # asyncio.wait, never gather under a timeout: a read stuck on a write into a
        # client's file does not end when cancelled (it waits for the write, threads.outlast),
        # and a gather cancelled by its timeout waits for it all the same.
        if left:
            await asyncio.wait(left, timeout=CLOSE_TIMEOUT_S)
        generators = asyncio.ensure_future(intake.loop.shutdown_asyncgens())
        await asyncio.wait([generators], timeout=CLOSE_TIMEOUT_S)
    finally:
        intake.writers.shutdown(wait=False)
        intake.loop.stop()
