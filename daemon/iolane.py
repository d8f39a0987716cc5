"""A lane of threads that run the data plane's blocking calls for the event loop.

``concurrent.futures.ThreadPoolExecutor`` behind ``loop.run_in_executor`` costs the loop
thread about 18 microseconds a call on this kind of machine: a concurrent Future with its own
Condition, the chaining of two futures, a ``call_soon_threadsafe`` (a write to the loop's
wake-up fd) for every result, a shield and a timeout context around each await. A hand-off of
a small shard makes such a call for its bytes, so at thousands of shards a second that was a
large part of the loop's time. The lane keeps what the loop does per call to a loop future, a
timer and a put on a C queue; results come back in batches, with one wake-up for all the
results that finished while the loop was busy.

What stays the same as with the executor: a call runs to its end in its thread whatever
happens to its caller (a thread cannot be stopped), and whoever hands work over learns when
it ended, so a resource the call uses is released after it and never under it (``late``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ckptdrain.daemon.errors import DaemonError

T = TypeVar("T")


class LaneTimeout(DaemonError, TimeoutError):
    """The call did not return within the lane's limit (it may still be running)."""


class Job(Generic[T]):
    """One call: its caller awaits ``waiter``; the lane fills ``finished``, ``result`` and
    ``error`` on the loop once the thread returns, then resolves ``waiter`` if it is still
    awaited, or else calls ``late(result, error)`` if the caller left one."""

    __slots__ = ("args", "error", "finished", "fn", "late", "result", "timer", "waiter")

    def __init__(self, fn: Callable[..., T], args: tuple[object, ...],
                 waiter: asyncio.Future[T]) -> None:
        self.fn: Callable[..., T] | None = fn
        self.args: tuple[object, ...] = args
        self.waiter = waiter
        self.timer: asyncio.TimerHandle | None = None
        self.finished = False
        self.result: T | None = None
        self.error: BaseException | None = None
        self.late: Callable[[T | None, BaseException | None], None] | None = None


class IoLane:
    """Up to ``threads`` threads (started as work needs them, named ``<name>_<n>``) taking
    calls in the order they came; each call's ``waiter`` fails with :class:`LaneTimeout`
    after ``limit_s`` (None: never)."""

    def __init__(self, threads: int, name: str, limit_s: float | None,
                 initializer: Callable[[], None] | None = None) -> None:
        self.threads = threads
        self.name = name
        self.limit_s = limit_s
        self._initializer = initializer
        self._queue: queue.SimpleQueue[Job[Any] | None] = queue.SimpleQueue()
        self._started: list[threading.Thread] = []
        # Threads waiting for a call; changed under the lock (a thread's and the loop's).
        self._idle = 0
        self._lock = threading.Lock()
        # Calls that returned, for the loop to settle; a wake-up is scheduled only when
        # none was pending (``_armed``), so a busy loop settles many per wake-up.
        self._done: collections.deque[Job[Any]] = collections.deque()
        self._armed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.wakeups = 0  # times the loop was woken to settle calls (the tests read it)

    def submit(self, fn: Callable[..., T], args: tuple[object, ...]) -> Job[T]:
        """Queue ``fn(*args)`` (on the loop); await the returned job's ``waiter``."""
        if self._closed:
            raise RuntimeError("the data plane is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("an IoLane serves the one event loop that first used it")
        with self._lock:
            idle = self._idle
            if idle:
                self._idle = idle - 1  # this call is that thread's
        if not idle and len(self._started) < self.threads:
            self._start()  # first: when it fails, nothing is queued and no timer is left
        job: Job[T] = Job(fn, args, loop.create_future())
        if self.limit_s is not None:
            job.timer = loop.call_later(self.limit_s, _expire, job)
        self._queue.put(job)
        return job

    def _start(self) -> None:
        t = threading.Thread(target=self._work, name=f"{self.name}_{len(self._started)}",
                             daemon=True)
        # Counted once started only: a start that failed (the process's thread limit, for a
        # moment) is tried again by the next call, where counting it had left the lane a
        # thread short for good (with one thread, every later call queued till StuckIO).
        t.start()
        self._started.append(t)

    def _work(self) -> None:
        if self._initializer is not None:
            with contextlib.suppress(Exception):
                self._initializer()
        get, done, lock = self._queue.get, self._done, self._lock
        while True:
            job = get()
            if job is None:
                return
            fn, args = job.fn, job.args
            assert fn is not None
            try:
                job.result = fn(*args)
            except StopIteration as exc:
                job.error = _stop_iteration(fn, exc)
            except BaseException as exc:
                job.error = exc
            del fn, args
            done.append(job)
            with lock:
                self._idle += 1
                wake, self._armed = not self._armed, True
            if wake:
                loop = self._loop
                assert loop is not None
                try:
                    loop.call_soon_threadsafe(self._settle)
                except RuntimeError:  # the loop is closed: the daemon is exiting
                    return

    def _settle(self) -> None:
        """On the loop: every call that returned since the last wake-up."""
        with self._lock:
            self._armed = False
        self.wakeups += 1
        done = self._done
        while done:
            job = done.popleft()
            job.fn, job.args, job.finished = None, (), True
            if job.timer is not None:
                job.timer.cancel()
                job.timer = None
            waiter = job.waiter
            if not waiter.done():
                if job.error is None:
                    waiter.set_result(job.result)
                else:
                    waiter.set_exception(job.error)
            elif job.late is not None:
                _hand_late(job)

    @property
    def idle(self) -> bool:
        """Whether no call is queued or running here (every thread started waits for one):
        a call taken in claims an idle thread or starts one, and a thread counts itself idle
        again only once its call has returned."""
        with self._lock:
            return self._idle == len(self._started)

    def close(self) -> None:
        """No more calls; idle threads end, a running call ends its thread when it returns.
        Queued calls are dropped, their callers cancelled (as the executor's
        ``cancel_futures`` did); a dropped call whose caller had already left is handed to
        its ``late`` as one that failed (``error`` a CancelledError: it made nothing)."""
        self._closed = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.fn, job.args, job.finished = None, (), True
                job.error = asyncio.CancelledError()
                if job.timer is not None:
                    job.timer.cancel()
                    job.timer = None
                if not job.waiter.done():
                    job.waiter.cancel()
                elif job.late is not None:
                    _hand_late(job)
        for _ in self._started:
            self._queue.put(None)


def _stop_iteration(fn: Callable[..., Any], exc: StopIteration) -> RuntimeError:
    """What a call that raised StopIteration fails with: no future takes a StopIteration
    (``set_exception`` refuses it), so settling it failed and its caller waited forever."""
    error = RuntimeError(f"{getattr(fn, '__name__', fn)} raised StopIteration")
    error.__cause__ = exc
    return error


def _hand_late(job: Job[Any]) -> None:
    """Call ``job.late``; what it raises is reported as a failed loop callback is, and never
    keeps the other calls of its batch from being settled (found attacking: a cleanup that
    raised left every result after it unsettled, their callers failing as stuck)."""
    late, job.late = job.late, None
    assert late is not None
    try:
        late(job.result, job.error)
    except Exception as exc:
        job.waiter.get_loop().call_exception_handler({
            "message": "a data-plane call's late callback failed", "exception": exc})


def _expire(job: Job[Any]) -> None:
    job.timer = None
    if not job.waiter.done():
        job.waiter.set_exception(LaneTimeout())
