"""Steps the wall clock of a daemon a test starts with this directory on ``PYTHONPATH``.

``time.time`` and ``time.time_ns`` run the seconds in ``$CKPTDRAIN_TEST_CLOCK_FILE`` off the
real clock, read again as the test rewrites the file, so a test steps a running daemon's clock
as NTP would. The monotonic clock is left alone, as a real step leaves it.
"""

import os
import time

_PATH = os.environ.get("CKPTDRAIN_TEST_CLOCK_FILE")

if _PATH:
    _real_time, _real_time_ns, _monotonic = time.time, time.time_ns, time.monotonic
    _offset = {"s": 0.0, "read_at": float("-inf")}

    def _shift() -> float:
        now = _monotonic()
        if now - _offset["read_at"] > 0.05:  # read at most 20 times a second
            _offset["read_at"] = now
            try:
                with open(_PATH) as f:
                    _offset["s"] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                pass
        return _offset["s"]

    def _time() -> float:
        return _real_time() + _shift()

    def _time_ns() -> int:
        return _real_time_ns() + int(_shift() * 1e9)

    time.time, time.time_ns = _time, _time_ns
