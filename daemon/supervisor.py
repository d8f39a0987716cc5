"""The owner of work that outlives the request that started it.

A sealed rank's commit, a memory hand-off being persisted, retention after a commit, an
upload being aborted: none of these may die with the connection that caused them, and none may
be created on a TaskGroup from outside that group's scope. They are queued here instead; the
supervisor's own TaskGroup (inside the daemon's) runs each behind a failure boundary, so one
failing job is logged with its traceback and the daemon carries on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

from ckptdrain.daemon.logs import log_event

log = logging.getLogger("ckptdrain.supervisor")

Job = Callable[[], Awaitable[object]]


class Supervisor:
    def __init__(self) -> None:
        self._pending: collections.deque[tuple[Job, str, bool]] = collections.deque()
        self._wake = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        # Work a clean stop must let finish (a held memfd being persisted); the rest (a
        # commit attempt, retention) is simply redone after a restart.
        self._critical: set[asyncio.Task[None]] = set()
        self._accepting = True
        self.failures = 0
        self.on_failure: Callable[[], None] | None = None  # counts it in the metrics

    @property
    def accepting(self) -> bool:
        """False once a stop began: :meth:`spawn` takes no more work."""
        return self._accepting

    @property
    def active(self) -> int:
        return len(self._running) + len(self._pending)

    def spawn(self, job: Job, *, what: str, critical: bool = False) -> None:
        """Queue ``job`` (a coroutine function, called only when it starts: nothing is left
        un-awaited if the daemon stops first)."""
        if not self._accepting:
            log_event(log, logging.WARNING, "work_dropped", what=what, reason="stopping")
            return
        self._pending.append((job, what, critical))
        self._wake.set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                while self._pending:
                    job, what, critical = self._pending.popleft()
                    task = tg.create_task(self._guarded(job, what), name=what)
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
                    if critical:
                        self._critical.add(task)
                        task.add_done_callback(self._critical.discard)
                self._wake.clear()
                await self._wake.wait()

    async def _guarded(self, job: Job, what: str) -> None:
        try:
            await job()
        except asyncio.CancelledError:
            raise
        except Exception:
            # The boundary: this piece of work is lost, logged once with its traceback; every
            # other job and client carries on.
            self.failures += 1
            log.exception("background work %s failed", what)
            if self.on_failure is not None:
                self.on_failure()

    async def finish(self, timeout_s: float) -> int:
        """Shutdown: take no new work, let critical work finish within ``timeout_s``; returns
        how many were still running (they are cancelled with the daemon's TaskGroup)."""
        self._accepting = False
        # Work queued before the stop still starts (a memfd already acknowledged must be
        # persisted); the run loop picks it up on this tick.
        self._pending = collections.deque(p for p in self._pending if p[2])
        self._wake.set()
        await asyncio.sleep(0)
        running = list(self._critical)
        if not running:
            return 0
        _, pending = await asyncio.wait(running, timeout=timeout_s)
        return len(pending)


# How long a stop may take, after every task was told to end, before what it still waits for is
# logged: a stop that hangs then says where (a task, and the line it waits on).
SLOW_STOP_S = 15.0


def report_slow_stop(after_s: float = SLOW_STOP_S) -> asyncio.TimerHandle:
    """Log the tasks still alive ``after_s`` from now, unless cancelled first (the stop ended)."""
    return asyncio.get_running_loop().call_later(after_s, _log_alive_tasks, after_s)


def _log_alive_tasks(after_s: float) -> None:
    current = asyncio.current_task()
    alive = []
    for task in asyncio.all_tasks():
        if task is current or task.done():
            continue
        frames = task.get_stack(limit=1)
        where = (f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames
                 else "not started")
        alive.append(f"{task.get_name()} at {where}")
    log_event(log, logging.WARNING, "stop_slow", after_s=after_s, tasks=len(alive),
              waiting="; ".join(sorted(alive))[:4000],
              action="the daemon is still stopping; if it does not end, report these tasks")
