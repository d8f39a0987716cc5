"""A token bucket for pacing the drain (``[drain] max_bandwidth_bytes_per_s``). Pure.

The bucket may go into debt: a caller reserves what it is about to send and is told how long
to wait first, so a shard larger than the burst is still paced at the configured rate instead
of waiting for a bucket that can never hold it.
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
