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
the fetcher closes (off any loop: a close can flush to a slow mount) once the read on the
other loop has ended, writes included; the caller keeps its own and closes it when it likes.
A thread still writing can then never write into a reused fd number, someone else's file. A
cancelled caller (the client hung up, the daemon is stopping) waits for the read to end, up
to ``CANCEL_GRACE_S``: a read ends within a turn or two of its loop once cancelled, unless a
write into the client's file is stuck in the kernel (a frozen or hung filesystem), which
must not hold the connection, or the daemon's stop, for as long as the kernel likes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.dataplane import name_os_thread
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import outlast

log = logging.getLogger("ckptdrain.fetcher")

T = TypeVar("T")

# How long closing waits for the reading loop: its backend's clean-up, then its tasks and
# threads. Past it the thread is left to the process's exit (it is a daemon thread).
CLOSE_TIMEOUT_S = 10.0
# How long a cancelled fetch waits for its read to end (see above).
CANCEL_GRACE_S = 5.0


class Fetcher:
    """Copies of destination objects into clients' files, off the daemon's event loop."""

    def __init__(self, open_reader: Callable[[], Backend], *,
                 close_fd: Callable[[int], None]) -> None:
        """``open_reader``: a new backend for the daemon's destination (called once, on the
        reading loop); ``close_fd``: how a duplicate of a client's fd is closed (without
        blocking the caller)."""
        self._open_reader = open_reader
        self._close_fd = close_fd
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._reader: Backend | None = None
        self._starting = asyncio.Lock()
        self._closed = False
        # Outcomes callers await, until each is settled: what closing settles if the reading
        # loop ended without reporting them (a read that reached it as it stopped).
        self._waiting: set[asyncio.Future[Any]] = set()

    @property
    def thread(self) -> threading.Thread | None:
        """The reading loop's thread, once started."""
        return self._thread

    async def copy_into(self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
                        expected_size: int | None = None) -> tuple[int, str]:
        """``Backend.copy_into`` of ``key`` into the client's ``out_fd``, through a duplicate
        of it that this fetcher closes once the read has ended (``out_fd`` stays the
        caller's)."""
        loop, reader = await self._started()
        into = os.dup(out_fd)
        return await self._there(
            loop, lambda: reader.copy_into(key, into, algo=algo, expected_size=expected_size),
            grace_s=CANCEL_GRACE_S, after=lambda: self._close_fd(into))

    async def _started(self) -> tuple[asyncio.AbstractEventLoop, Backend]:
        async with self._starting:
            if self._closed:
                raise _stopping()
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_serve, args=(loop,), name="ckptdrain-fetch",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            if self._reader is None:
                # Built on its own loop: its locks, semaphores and connections belong there.
                self._reader = await self._there(self._loop, self._open)
            return self._loop, self._reader

    async def _open(self) -> Backend:
        return self._open_reader()

    async def _there(self, loop: asyncio.AbstractEventLoop,
                     work: Callable[[], Coroutine[Any, Any, T]], *,
                     grace_s: float | None = None,
                     after: Callable[[], None] | None = None) -> T:
        """Run ``work()`` as a task on ``loop`` (the reading loop) and await its outcome here;
        ``after()`` runs once that task has ended, however it ends (or at once, if it never
        starts). Cancelled, cancel it there and wait, through any further cancels, until it
        has ended (or ``grace_s`` has passed): the task's own end is what says so. A
        concurrent future's would not (cancelled, it is done at once while the work it stood
        for runs on), and neither would the coroutine's own ``finally`` (a task cancelled
        before its first step never runs its body)."""
        here = asyncio.get_running_loop()
        outcome: asyncio.Future[T] = here.create_future()
        self._waiting.add(outcome)
        outcome.add_done_callback(self._waiting.discard)
        tasks: list[asyncio.Task[T]] = []  # touched on ``loop`` only
        asked = False  # whether this caller cancelled the work

        def report(task: asyncio.Task[T]) -> None:  # on this loop, once the task is done
            error = None if task.cancelled() else task.exception()  # retrieved, either way
            if outcome.done():
                return
            if asked:  # however it ended, the cancelled caller takes no result of it
                outcome.cancel()
            elif task.cancelled():  # ended by the reading loop's stop, not by the caller
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
            task = loop.create_task(work())
            task.add_done_callback(ended)
            tasks.append(task)

        def cancel() -> None:  # queued after start(): the loop runs its callbacks in order
            for task in tasks:
                task.cancel()

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # its loop has closed
            outcome.cancel()
            if after is not None:
                after()
            raise _stopping() from None
        try:
            return await asyncio.shield(outcome)
        except asyncio.CancelledError:
            asked = True
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(cancel)
            await outlast(outcome, grace_s)
            if outcome.done() and not outcome.cancelled():
                outcome.exception()  # retrieved: the cancellation is what the caller sees
            raise

    async def aclose(self) -> None:
        """Close the reading backend and stop its loop (after every fetch has ended: the
        daemon closes this once its connections are gone)."""
        async with self._starting:
            self._closed = True
            loop, thread, reader = self._loop, self._thread, self._reader
            self._loop = self._thread = self._reader = None  # closed once
        if loop is None or thread is None:
            return
        try:
            if reader is not None:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._there(loop, reader.aclose, grace_s=CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing goes on: the loop must stop
            log_event(log, logging.WARNING, "fetch_close_failed", error=str(exc) or repr(exc))
        with contextlib.suppress(RuntimeError):  # its loop has closed already
            loop.call_soon_threadsafe(_finish_soon, loop)
        # The thread ends when its loop has stopped and closed: joined in a thread, so a
        # stuck write into a client's file cannot hold the daemon's loop here.
        await asyncio.to_thread(thread.join, 2 * CLOSE_TIMEOUT_S)
        if thread.is_alive():
            log_event(log, logging.WARNING, "fetch_thread_stuck", timeout_s=2 * CLOSE_TIMEOUT_S,
                      action="left to the process's exit")
            return
        # The loop is gone, and nothing it ran can still write: a caller it never answered
        # (a read that reached it as it closed) is answered now rather than never.
        for outcome in list(self._waiting):
            if not outcome.done():
                outcome.set_exception(_stopping())
                outcome.exception()  # retrieved: a caller gone already is not an error


def _stopping() -> BackendError:
    return BackendError("the daemon is stopping and its reads from the destination have "
                        "ended; retry once it is back", transient=True)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    name_os_thread()
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # A read that arrived as the loop stopped: ended here, so that its caller (waiting
        # on the task's end) hears of it rather than waiting for good.
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=CLOSE_TIMEOUT_S))
    finally:
        loop.close()


def _finish_soon(loop: asyncio.AbstractEventLoop) -> None:
    """On the reading loop: :func:`_finish` as a task of its own (created here, so that a
    loop closed meanwhile leaves no coroutine behind that never ran)."""
    task = loop.create_task(_finish(loop))
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)


# The closing tasks, referenced until they end (the loop itself holds tasks weakly).
_finishing: set[asyncio.Task[None]] = set()


async def _finish(loop: asyncio.AbstractEventLoop) -> None:
    """On the reading loop: end what is left on it, its default executor's threads (the
    writes into clients' files) included, then stop it."""
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me]
    for task in left:
        task.cancel()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await asyncio.gather(*left, return_exceptions=True)
            await loop.shutdown_default_executor()
    except TimeoutError:
        pass
    finally:
        loop.stop()
