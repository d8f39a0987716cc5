"""Shards read from the destination for a client (``fetch`` with source ``destination``, a
DrainReader's path for a shard this node holds no copy of), on an event loop of their own.

Reading an S3 object is parsing HTTP answers, and that runs on the event loop that reads
them. On the daemon's loop, which serves every client and decides every drain, a loading job
whose ranks fetch their shards at once cost that loop about 0.5 CPU s per GB (the `restore`
benchmark's fetch row). So a backend that reads on its loop (``Backend.reads_on_loop``) gets
a twin for reads, built on first use on a thread of its own (``ckptdrain-fetch``) with its
own event loop and connections; the daemon's loop sends it the request and awaits the answer.
A destination that reads in threads anyway (POSIX) is read in place.

One owner, one rule for the client's fd: a cancelled caller returns only once the read on
the other loop has ended, writes included (the caller closes the fd next, and a thread still
writing to a reused fd number would write into someone else's file).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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


class Fetcher:
    """Copies of destination objects into clients' files, off the daemon's event loop."""

    def __init__(self, backend: Backend, open_reader: Callable[[], Backend]) -> None:
        """``backend``: the daemon's; ``open_reader``: a new backend for the same destination
        (called once, on the reading loop, when ``backend.reads_on_loop``)."""
        self._backend = backend
        self._open_reader = open_reader
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._reader: Backend | None = None
        self._starting = asyncio.Lock()
        self._closed = False

    @property
    def thread(self) -> threading.Thread | None:
        """The reading loop's thread, once started."""
        return self._thread

    async def copy_into(self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
                        expected_size: int | None = None) -> tuple[int, str]:
        """``Backend.copy_into`` of ``key`` into the client's ``out_fd``; returns only once no
        thread writes to ``out_fd`` any more, cancelled or not."""
        if not self._backend.reads_on_loop:
            return await self._backend.copy_into(key, out_fd, algo=algo,
                                                 expected_size=expected_size)
        loop, reader = await self._started()
        return await _on(loop, lambda: reader.copy_into(key, out_fd, algo=algo,
                                                        expected_size=expected_size))

    async def _started(self) -> tuple[asyncio.AbstractEventLoop, Backend]:
        async with self._starting:
            if self._closed:
                raise BackendError("the daemon is stopping and reads from the destination "
                                   "have ended; retry once it is back", transient=True)
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_serve, args=(loop,), name="ckptdrain-fetch",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            if self._reader is None:
                # Built on its own loop: its locks, semaphores and connections belong there.
                self._reader = await _on(self._loop, self._open)
            return self._loop, self._reader

    async def _open(self) -> Backend:
        return self._open_reader()

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
                    await _on(loop, reader.aclose, grace_s=CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing goes on: the loop must stop
            log_event(log, logging.WARNING, "fetch_close_failed", error=str(exc) or repr(exc))
        asyncio.run_coroutine_threadsafe(_finish(loop), loop)
        # The thread ends when its loop has stopped and closed: joined in a thread, so a
        # stuck write into a client's file cannot hold the daemon's loop here.
        await asyncio.to_thread(thread.join, 2 * CLOSE_TIMEOUT_S)
        if thread.is_alive():
            log_event(log, logging.WARNING, "fetch_thread_stuck", timeout_s=2 * CLOSE_TIMEOUT_S,
                      action="left to the process's exit")


async def _on(loop: asyncio.AbstractEventLoop, work: Callable[[], Coroutine[Any, Any, T]],
              *, grace_s: float | None = None) -> T:
    """Run ``work()`` as a task on ``loop`` (the reading loop) and await its outcome here.
    Cancelled, cancel it there and wait, through any further cancels, until it has ended (or
    ``grace_s`` has passed): the task's own end is what says so. A concurrent future's would
    not (cancelled, it is done at once while the work it stood for runs on), and neither
    would the coroutine's own ``finally`` (a task cancelled before its first step never
    runs its body)."""
    here = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = here.create_future()
    tasks: list[asyncio.Task[T]] = []  # touched on ``loop`` only

    def report(task: asyncio.Task[T]) -> None:  # on this loop, once the task is done
        if outcome.done():
            return
        if task.cancelled():
            outcome.cancel()
        elif task.exception() is not None:
            outcome.set_exception(task.exception())  # type: ignore[arg-type]
        else:
            outcome.set_result(task.result())

    def ended(task: asyncio.Task[T]) -> None:
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
        raise BackendError("reads from the destination have ended (the daemon is stopping); "
                           "retry once it is back", transient=True) from None
    try:
        return await asyncio.shield(outcome)
    except asyncio.CancelledError:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(cancel)
        await outlast(outcome, grace_s)
        if outcome.done() and not outcome.cancelled():
            outcome.exception()  # retrieved: the cancellation is what the caller sees
        raise


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    name_os_thread()
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


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
