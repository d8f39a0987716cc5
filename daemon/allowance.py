"""What a uid's misbehaving clients cost it: waits before its next frames are read.

Each error a uid's clients cause draws on its allowance (``limits.client_errors_per_s`` after
a burst of ``limits.client_error_burst``; :class:`~.ratelimit.ErrorAllowance` keeps the
count): a malformed frame, a refused frame, a request answered with an error a correct client
never gets (``bad_request``, ``invalid_name``, ``permission_denied``, ``unsupported_version``)
and a twentieth of one for ``not_found`` (a reader meets it for every shard with no local
copy: a restore of a thousand shards stays within the burst, a loop of them does not), a
connection that ends before its first request (unless it was held: it paid by waiting), a
connection refused at ``max_clients_per_uid``, and a ``status`` of a user other than an
operator (it costs the loop many times a hand-off's request, and nothing needs it often). Not
a hang-up in the middle of a conversation, nor in the middle of a frame: a killed job drops
all its connections at once. Each of these costs the event loop at least as much as a hand-off's
request; a uid that causes them faster than its allowance has its connections wait before the
daemon reads their next frame (the first of a new connection, the next after a charged
reply), so one user's flood takes the loop only at that rate, and every other uid is served as
before.

A wait is bounded: a connection still held after :data:`HOLD_MAX_S` gets a typed
``backpressure`` error (``limit = "client_errors_per_s"``, with ``retry_after_s``) and is
closed, well before the client library's own connect timeout would take it for a dead daemon.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.logs import OncePerCause
from ckptdrain.daemon.ratelimit import ErrorAllowance

if TYPE_CHECKING:
    from ckptdrain.daemon.config import LimitsConfig
    from ckptdrain.daemon.metrics import Metrics

log = logging.getLogger("ckptdrain.connection")

HOLD_MAX_S = 5.0
# A wait is looked at again this often: a reload that raises the limit lets it go.
RECHECK_S = 1.0


class TurnedAway(DaemonError):
    """Held back longer than :data:`HOLD_MAX_S`: answer ``backpressure`` and hang up."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(
            "backpressure: this user's clients caused errors (malformed or refused requests, "
            "connections that carried no request) faster than limits.client_errors_per_s "
            f"allows, so their connections wait; retry in {math.ceil(retry_after_s)} s, and find "
            "the process causing them (the daemon's log names its pid)")
        self.retry_after_s = retry_after_s


class ClientAllowance:
    def __init__(self, limits: Callable[[], LimitsConfig], metrics: Metrics,
                 log_bucket: OncePerCause) -> None:
        self._limits = limits
        self._metrics = metrics
        self._log = log_bucket
        self.owed = ErrorAllowance()

    def charge(self, uid: int, cost: float = 1.0) -> None:
        """An error of ``uid``'s clients (``cost`` errors' worth)."""
        limits = self._limits()
        self.owed.record(uid, time.monotonic(), limits.client_errors_per_s,
                         limits.client_error_burst, cost)

    def _delay(self, uid: int) -> float:
        limits = self._limits()
        return self.owed.delay(uid, time.monotonic(), limits.client_errors_per_s,
                               limits.client_error_burst)

    async def hold(self, uid: int, pid: int) -> bool:
        """Wait until ``uid`` is within its allowance (True if it had to);
        :class:`TurnedAway` past HOLD_MAX_S."""
        delay = self._delay(uid)
        if delay <= 0:
            return False
        self._metrics.client_held_back()
        self._log.log_event(log, logging.INFO, "client_held_back", cause=f"uid {uid}", uid=uid,
                            pid=pid, wait_s=round(delay, 3),
                            reason="over limits.client_errors_per_s")
        deadline = time.monotonic() + HOLD_MAX_S
        while delay > 0:
            # Waited out even when the debt is longer than the bound: refused at once, a
            # flood would be answered as fast as it reconnects again.
            left = deadline - time.monotonic()
            if left <= 0:
                self._metrics.backpressure("rejected", "client_errors_per_s")
                raise TurnedAway(delay)
            await asyncio.sleep(min(delay, left, RECHECK_S))
            delay = self._delay(uid)
        return True
