"""The client's connections to its daemon, other than a generation's own: a small pool of idle
ones shared by every call (and by several threads), a new one opened within the call's bound
when none is idle, and a request whose pooled connection the daemon had just dropped while idle
sent again on a new one.

The base of :class:`~ckptdrain.client.client.Client`, which holds the calls themselves.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ckptdrain.client import wire
from ckptdrain.client.channel import Channel, reply_grace_s
from ckptdrain.client.errors import DaemonUnavailable, RejectedInput, Timeout


class Lost(Exception):
    """A connection that went away during a request (``error``: its DaemonUnavailable)."""

    def __init__(self, error: DaemonUnavailable) -> None:
        super().__init__(error.message)
        self.error = error


# How the last word of a daemon older than ``details.closed`` began, to a connection it dropped
# for going quiet (daemon/connection.py). Such a daemon, still running on a node whose clients
# were upgraded first, answers a pooled request that races its drop with this text and nothing
# else to tell it by. A daemon that sends ``details.closed`` is judged by the field alone.
_OLD_IDLE_LAST_WORD = "the daemon closed this connection"


def _hung_up_before(exc: Timeout) -> bool:
    """Whether ``exc``, the answer to a request on a pooled connection, is the daemon's last
    word to that connection, dropped while idle before it read any of the request; never our
    own timer running out (the daemon may be hung, and the bound is spent), nor a drop
    mid-frame."""
    closed: object = exc.details.get(wire.CLOSED)
    if closed is not None:
        return closed == wire.CLOSED_IDLE
    return exc.message.startswith(_OLD_IDLE_LAST_WORD)


def close_channels(channels: list[Channel], lock: threading.RLock) -> None:
    with lock:
        idle = list(channels)
        channels.clear()
    for channel in idle:
        channel.close()


class ConnectionPool:
    """The client's pooled connections (its base; :class:`~ckptdrain.client.client.Client` sets
    these)."""

    socket_path: str
    timeout_s: float
    connect_timeout_s: float
    _lock: threading.RLock
    _idle: list[Channel]
    _closed: bool


    def _open_channel(self, kind: str, limit_s: float) -> Channel:
        """A new connection for a ``kind`` call bounded by ``limit_s``: its connect and hello
        wait at most connect_timeout_s and never past the call's own bound (found attacking a
        stopped daemon: wait(timeout_s=3) raised after the 10 s connect timeout)."""
        if self._closed:
            raise RejectedInput("this ckptdrain Client is closed; create a new one")
        bound_s = min(self.connect_timeout_s, limit_s + reply_grace_s(kind, limit_s))
        return Channel.open(self.socket_path, timeout_s=self.timeout_s, connect_timeout_s=bound_s)

    def _call(
        self, kind: str, fields: dict[str, Any], timeout_s: float | None = None,
        lost: bool = False,
    ) -> dict[str, Any]:
        """``kind`` on a pooled connection or a new one. ``lost``: a connection that goes
        away during the request (DaemonUnavailable once it was connected) raises ``Lost``."""
        started = time.monotonic()
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        channel: Channel | None = None
        with self._lock:
            while self._idle and channel is None:
                candidate = self._idle.pop()
                if candidate.is_reusable():
                    channel = candidate
                else:
                    candidate.close()
        if channel is not None:
            try:
                return self._request(channel, kind, fields, limit_s, started, lost)
            except Timeout as exc:
                if not _hung_up_before(exc):
                    raise
                with self._lock:  # back in the pool if its send went through: it is done
                    if channel in self._idle:
                        self._idle.remove(channel)
                channel.close()
            # The daemon dropped the idle connection after it was checked and before it read
            # the request, and answered it with its last word (client idle): nothing was done,
            # so the request goes again on a new connection, within the same bound. A poll
            # every client_idle_timeout_s (120 s) raised Timeout "the daemon closed this
            # connection" now and then, a wait() of a committed step included (found attacking).
        return self._request(self._open_channel(kind, limit_s), kind, fields, limit_s, started,
                             lost)

    def _request(self, channel: Channel, kind: str, fields: dict[str, Any], limit_s: float,
                 started: float, lost: bool = False) -> dict[str, Any]:
        """``kind`` on ``channel``, which goes back to the pool after, unless it broke."""
        try:
            return channel.request(kind, fields, timeout_s=limit_s, started=started)
        except DaemonUnavailable as exc:
            if lost:
                raise Lost(exc) from exc
            raise
        finally:
            with self._lock:
                pooled = channel.broken is None and not self._closed
                if pooled:
                    self._idle.append(channel)
            if not pooled:
                channel.close()
