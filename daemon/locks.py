"""Work keyed by a generation or a job, one at a time per key: each map holds a key only while
its work is held or running, so it stays bounded by the work in progress, not by every key
ever seen."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable


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
    """One run of a piece of work per key at a time, and none lost: a request while a run is
    under way asks for one more run after it (however many requests came meanwhile).

    Skipping the request instead (the run under way "will see it") loses the newest one when
    the run had already read what the request was about: retention's run that listed the job
    before a commit, after the job's last commit, left an old generation for good.
    """

    def __init__(self) -> None:
        self._again: dict[Hashable, bool] = {}

    def __len__(self) -> int:
        return len(self._again)

    async def run(self, key: Hashable, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` for ``key`` now, or after the run under way (then return at once).
        An exception from ``work`` ends this call, and with it any run asked for meanwhile."""
        if key in self._again:
            self._again[key] = True
            return
        self._again[key] = False
        try:
            while True:
                await work()
                if not self._again[key]:
                    return
                self._again[key] = False
        finally:
            del self._again[key]
