"""The drain's pace and progress: the token bucket that meters bytes as they move
(``drain.max_bandwidth_bytes_per_s``, changed by a reload), the yield to hand-offs in flight
before each metered piece, and the bytes moved, counted as they reach the destination (the
drained-bytes metric, status' drain rate, a shard's progress).

The base of :class:`~ckptdrain.daemon.scheduler.Scheduler`, apart from what it drains and in
what order: a backend's copy sees only :class:`ShardFlow`, its two calls into this.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from ckptdrain.daemon.ratelimit import TokenBucket
from ckptdrain.daemon.yielding import HandoffYield

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.ledger import ShardRecord
    from ckptdrain.daemon.metrics import Metrics


class DrainPace:
    """How fast the drain may go, and how far it has gone (the scheduler's base)."""

    config: Config  # the scheduler's (a reload replaces it)

    def __init__(self, bytes_per_s: int, metrics: Metrics, destination: str) -> None:
        self.metrics = metrics
        self.destination = destination
        self._drained_bytes_window: list[tuple[float, int]] = []
        self._pacer_changed = asyncio.Event()
        self.pacer = TokenBucket(bytes_per_s)
        self.yielding = HandoffYield()  # hand-offs in flight, which pace() waits for

    def set_bandwidth(self, bytes_per_s: int) -> None:
        """A new drain rate (SIGHUP), from here on: what paced waiters still owe is paid at
        the new rate (:meth:`pace`), and a limited rate keeps the bucket's debt. Found
        attacking: every reload made a new bucket and let the waiters go, so a reload that
        lowered the rate, or changed nothing, let a paced drain through at full speed."""
        if bytes_per_s == self.pacer.rate:
            return
        if bytes_per_s and not self.pacer.unlimited:
            self.pacer.set_rate(bytes_per_s, time.monotonic())
        else:
            self.pacer = TokenBucket(bytes_per_s)
        self._pacer_changed.set()
        self._pacer_changed = asyncio.Event()

    def drain_rate_bytes_per_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        self._drained_bytes_window = [(t, n) for t, n in self._drained_bytes_window if now - t < window_s]
        if not self._drained_bytes_window:
            return 0.0
        total = sum(n for _, n in self._drained_bytes_window)
        span = max(1.0, now - self._drained_bytes_window[0][0])
        return total / span

    async def pace(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may be sent (``drain.max_bandwidth_bytes_per_s``); the
        backends call it as bytes move (per part, per copied range), so a large shard is paced
        as evenly as many small ones. While hand-offs that move are in flight it first waits
        for them to end, up to ``drain.yield_to_handoffs_s`` (yielding.py)."""
        await self.yielding.wait(self.config.drain.yield_to_handoffs_s)
        now = time.monotonic()
        delay = self.pacer.reserve(nbytes, now)
        until = now + delay
        while delay > 0:
            # A reload that changes the rate wakes the wait (set_bandwidth): what is left of
            # it is paid at the new rate (none when the drain is no longer limited).
            rate, changed = self.pacer.rate, self._pacer_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await changed.wait()
            now = time.monotonic()
            if self.pacer.unlimited or now >= until:
                return
            until = now + (until - now) * rate / self.pacer.rate
            delay = until - now

    def moved(self, shard: ShardRecord, nbytes: int) -> None:
        """``nbytes`` of ``shard`` reached the destination: drained bytes, the drain rate and
        the shard's progress move now, not when the whole shard is done."""
        shard.moved_bytes += nbytes
        shard.progress_mono = now = time.monotonic()
        self._drained_bytes_window.append((now, nbytes))
        self.metrics.drained(shard.job, nbytes, self.destination)

    def count_drained(self, job: str, nbytes: int) -> None:
        """``nbytes`` of ``job`` drained at once (a batch of small shards): counted once."""
        self._drained_bytes_window.append((time.monotonic(), nbytes))
        self.metrics.drained(job, nbytes, self.destination)


class ShardFlow:
    """The :class:`~ckptdrain.daemon.backends.base.Flow` of one shard's copy."""

    def __init__(self, scheduler: DrainPace, shard: ShardRecord) -> None:
        self._scheduler = scheduler
        self._shard = shard

    async def pace(self, nbytes: int) -> None:
        await self._scheduler.pace(nbytes)

    def moved(self, nbytes: int) -> None:
        self._scheduler.moved(self._shard, nbytes)
