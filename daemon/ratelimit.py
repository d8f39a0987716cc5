"""Rates the daemon holds something to. Pure.

:class:`TokenBucket` paces the drain (``[drain] max_bandwidth_bytes_per_s``). The bucket may
go into debt: a caller reserves what it is about to send and is told how long to wait first,
so a shard larger than the burst is still paced at the configured rate instead of waiting for
a bucket that can never hold it.

:class:`ErrorAllowance` holds each uid's clients to ``[limits] client_errors_per_s``
malformed or refused frames a second, after a burst.
"""

from __future__ import annotations

BURST_S = 0.1


class TokenBucket:
    def __init__(self, rate_bytes_per_s: float, burst_bytes: float | None = None) -> None:
        if rate_bytes_per_s < 0:
            raise ValueError("rate must be >= 0 (0 = unlimited)")
        self.rate = float(rate_bytes_per_s)
        # A tenth of a second's worth by default: a short burst, and a measured rate that
        # stays close to the cap even over a few seconds of draining.
        self.burst = float(burst_bytes if burst_bytes is not None else rate_bytes_per_s * BURST_S)
        self._tokens = self.burst
        self._at: float | None = None

    @property
    def unlimited(self) -> bool:
        return self.rate == 0

    def set_rate(self, rate_bytes_per_s: float, now: float) -> None:
        self._refill(now)
        self.rate = float(rate_bytes_per_s)
        self.burst = self.rate * BURST_S
        self._tokens = min(self._tokens, self.burst)

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now if self._at is None else max(self._at, now)

    def reserve(self, amount: float, now: float) -> float:
        """Take ``amount`` tokens; returns the seconds to wait before using them (0 if none)."""
        if self.unlimited:
            return 0.0
        self._refill(now)
        self._tokens -= amount
        if self._tokens >= 0:
            return 0.0
        return -self._tokens / self.rate


class ErrorAllowance:
    """How many errors each uid's clients may cause: ``burst`` at once, then ``rate`` a second.

    A uid over it has each of its connections wait before the daemon reads the next frame
    (the first of a new connection, or the one after an error reply). Without it a process
    that sends bad frames as fast as the daemon answers them (each one ends its connection,
    and it reconnects) takes as much of the event loop as the loop can give, and every other
    client's hand-off waits behind it. Only the offending uid waits.

    Per uid in debt: the errors it owes and when that was counted; the debt drains at the rate
    in force when it is looked at, so a reload that raises the rate shortens the waits at once.
    A uid leaves the table when a connection of its finds the debt paid, and the table is
    pruned of paid uids before it grows past :attr:`PRUNE_AT`.
    """

    PRUNE_AT = 4096

    def __init__(self) -> None:
        self._owed: dict[int, tuple[float, float]] = {}  # uid -> (errors owed, counted at)

    def _owed_now(self, uid: int, now: float, rate: float) -> float:
        owed, at = self._owed.get(uid, (0.0, now))
        return max(0.0, owed - max(0.0, now - at) * rate)

    def record(self, uid: int, now: float, rate: float, cost: float = 1.0) -> None:
        """An error of ``uid``'s, ``cost`` errors' worth; ``rate`` 0 counts nothing (the
        allowance is off)."""
        if rate <= 0:
            return
        if uid not in self._owed and len(self._owed) >= self.PRUNE_AT:
            self._owed = {u: (owed, at) for u, (owed, at) in self._owed.items()
                          if self._owed_now(u, now, rate) > 0}
        self._owed[uid] = (self._owed_now(uid, now, rate) + cost, now)

    def delay(self, uid: int, now: float, rate: float, burst: int) -> float:
        """Seconds ``uid``'s next frame waits before it is read: 0 within the allowance."""
        if uid not in self._owed:
            return 0.0
        owed = self._owed_now(uid, now, rate) if rate > 0 else 0.0
        if owed <= 0:
            del self._owed[uid]
            return 0.0
        return max(0.0, (owed - burst) / rate)

    def __len__(self) -> int:
        return len(self._owed)
