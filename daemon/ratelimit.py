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

    Per uid in debt: the errors it owes and when that was counted. The debt drains at the rate
    in force; a new rate (a reload) first settles every debt at the old one up to that moment,
    so a raised rate shortens the waits at once and a lowered one brings back no debt already
    paid; a rate of 0 (off) forgives every debt. A debt is at most :attr:`DEBT_MAX_S` of the
    rate past the burst: a flood's cost ends that long after the flood does. A uid leaves the
    table when a connection of its finds the debt paid, and the table is pruned of paid uids
    before it grows past :attr:`PRUNE_AT`.
    """

    PRUNE_AT = 4096
    # Found reviewing: uncapped, 10,000 connects refused at the uid's cap (half a second of
    # looping) held that uid's every connection, its training jobs' too, for 8 minutes.
    DEBT_MAX_S = 60.0

    def __init__(self) -> None:
        self._owed: dict[int, tuple[float, float]] = {}  # uid -> (errors owed, counted at)
        self._rate = 0.0  # the rate the debts drain at

    def _owed_now(self, uid: int, now: float) -> float:
        owed, at = self._owed.get(uid, (0.0, now))
        return max(0.0, owed - max(0.0, now - at) * self._rate)

    def _at_rate(self, rate: float, now: float) -> None:
        """Debts drain at ``rate`` from ``now`` on (found reviewing: drained at a lowered rate
        over the whole time since it was counted, a debt paid an hour before came back)."""
        if rate == self._rate:
            return
        if rate <= 0:
            self._owed = {}
        else:
            self._prune(now)
        self._rate = rate

    def _prune(self, now: float) -> None:
        """Settle every debt at the rate in force up to ``now``; drop the paid ones."""
        owed = ((uid, self._owed_now(uid, now)) for uid in list(self._owed))
        self._owed = {uid: (left, now) for uid, left in owed if left > 0}

    def record(self, uid: int, now: float, rate: float, burst: float, cost: float = 1.0) -> None:
        """An error of ``uid``'s, ``cost`` errors' worth; ``rate`` 0 counts nothing (the
        allowance is off)."""
        self._at_rate(rate, now)
        if rate <= 0:
            return
        if uid not in self._owed and len(self._owed) >= self.PRUNE_AT:
            self._prune(now)
        self._owed[uid] = (min(self._owed_now(uid, now) + cost, burst + rate * self.DEBT_MAX_S),
                           now)

    def delay(self, uid: int, now: float, rate: float, burst: float) -> float:
        """Seconds ``uid``'s next frame waits before it is read: 0 within the allowance."""
        self._at_rate(rate, now)
        if uid not in self._owed:
            return 0.0
        owed = self._owed_now(uid, now)
        if owed <= 0:
            del self._owed[uid]
            return 0.0
        return max(0.0, (owed - burst) / rate)

    def __len__(self) -> int:
        return len(self._owed)
