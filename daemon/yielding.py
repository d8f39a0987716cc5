"""The drain's yield to hand-offs (``drain.yield_to_handoffs_s``): while a rank waits on a
shard going to local storage, the drain starts no new copied range or part, so the hand-off
gets the disk and the cores.

Only a hand-off that moves counts. Once its bytes are due from the client, it holds the drain
back only while they arrive at MIN_BYTES_PER_S or faster on average (after a short grace for
the first ones). Found attacking the daemon as a second user: every hand-off in flight counted,
so a client that opened a ``put`` and sent nothing (cut off after ``client_rate_grace_s``, then
again and again), or trickled its bytes, held every job's drain on the node to one 16 MiB range
per wait: a 256 MiB shard took 32 s to drain instead of 0.13 s. Such a hand-off needs neither
the disk nor the cores. A hand-off between its bytes (staging the file, fsyncing, journalling)
always counts: that is the daemon's own disk work.

And the drain yields at most half the time: after a wait that ran its whole
``yield_to_handoffs_s``, it yields to nothing for as long. A hand-off that keeps moving at
the floor's rate, from one connection (found attacking the fix: 5 MiB/s in 64 KiB chunks held
a 256 MiB shard's drain for 32 s instead of 0.35 s), or a long burst of real hand-offs, can
then at most halve the drain's pace; a rank's usual hand-off ends well within one wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ckptdrain.daemon.dataplane import RateFloor

# A client's bytes worth yielding to arrive this fast at least: a rank writes its shard at
# hundreds of MB/s, and even one of 64 ranks sharing a slow staging disk far above this; a
# client this slow barely touches the disk.
MIN_BYTES_PER_S = 4 << 20
# ... whatever the rate, for this long after they become due (the first ones are on the way).
GRACE_S = 0.5
# How often a waiting drain looks again at how the hand-offs move.
POLL_S = 0.1


class Transfer(Protocol):
    """What is watched of a hand-off: its connection's transfer from the client, if any."""

    @property
    def transfer(self) -> RateFloor | None: ...


class HandoffYield:
    def __init__(self) -> None:
        self._active: list[Transfer | None] = []
        self._clear = asyncio.Event()
        self._clear.set()
        self.yielded = 0  # drain ranges that waited for hand-offs (status, tests)
        self._free_until = 0.0  # no yield before this (monotonic): the drain's half

    @contextlib.contextmanager
    def handoff(self, watched: Transfer | None = None) -> Iterator[None]:
        """Around a hand-off a rank waits on; ``watched`` tells how fast its client sends."""
        self._active.append(watched)
        self._clear.clear()
        try:
            yield
        finally:
            self._active.remove(watched)
            if not self._active:
                self._clear.set()

    def moving(self, now: float) -> bool:
        """Whether some hand-off in flight is one the drain yields to now."""
        for watched in self._active:
            floor = None if watched is None else watched.transfer
            if floor is None:
                return True  # not waiting on its client: the daemon's own work
            elapsed = now - floor.started
            if elapsed < GRACE_S or floor.got >= MIN_BYTES_PER_S * elapsed:
                return True
        return False

    async def wait(self, limit_s: float) -> None:
        """Up to ``limit_s`` while a hand-off worth yielding to is in flight."""
        now = time.monotonic()
        if limit_s <= 0 or now < self._free_until or not self._active or not self.moving(now):
            return
        self.yielded += 1
        started, deadline = now, now + limit_s
        while self._active and now < deadline and self.moving(now):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(POLL_S, deadline - now)):
                    await self._clear.wait()
            now = time.monotonic()
        if now >= deadline:
            self._free_until = now + (now - started)
