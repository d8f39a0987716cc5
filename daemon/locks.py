"""Work keyed by a generation or a job, one at a time per key: each map holds a key only while
its work is held or running, so it stays bounded by the work in progress, not by every key
ever seen. And a lock that knows which task holds it (:class:`HeldBy`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, Literal


class HeldBy(asyncio.Lock):
    """An asyncio lock that says whether the running task holds it: for work that must hold
    it and is reached both from inside and from outside it (a generation's commit point:
    Endings.end), where taking it again from inside would wait on itself for good."""

    _holder: asyncio.Task[Any] | None = None

    async def acquire(self) -> Literal[True]:
        await super().acquire()
        self._holder = asyncio.current_task()
        return True

    def release(self) -> None:
        self._holder = None
        super().release()

    def held_here(self) -> bool:
        return self._holder is not None and self._holder is asyncio.current_task()

    def here(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """The lock to take, or nothing when the running task holds it already."""
        return contextlib.nullcontext() if self.held_here() else self


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class CoalescedRuns:
    """One run of a piece of work per key at a time, none lost, and at most one per
    ``min_interval_s``: a request while a run is under way, or within ``min_interval_s`` of
    the last run's start, asks for one more run, which starts once both are over (however
    many requests came meanwhile).

    Skipping the request instead (the run under way "will see it") loses the newest one when
    the run had already read what the request was about: retention's run that listed the job
    before a commit, after the job's last commit, left an old generation for good. The
    interval bounds what a key that asks often costs: a job committing every few
    milliseconds gets retention once per interval, not once per commit.
    """

    def __init__(self, min_interval_s: float = 0.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._interval = min_interval_s
        self._clock = clock
        self._sleep = sleep
        self._again: dict[Hashable, bool] = {}
        # When each key's last run started, while that is within the interval.
        self._started: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._again)

    async def run(self, key: Hashable, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` for ``key`` now (or once the interval since its last run is over), or
        after the run under way (then return at once). An exception from ``work`` ends this
        call, and with it any run asked for meanwhile."""
        if key in self._again:
            self._again[key] = True
            return
        self._again[key] = False
        try:
            while True:
                wait = self._started.get(key, -self._interval) + self._interval - self._clock()
                if wait > 0:
                    await self._sleep(wait)
                self._again[key] = False  # requests until now are served by this run
                self._started[key] = self._clock()
                await work()
                if not self._again[key]:
                    return
        finally:
            del self._again[key]
            now = self._clock()
            for old in [k for k, at in self._started.items() if now - at >= self._interval]:
                del self._started[old]
