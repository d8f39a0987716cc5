"""A call the caller gave a timeout returns within it (plus the documented grace for its reply)
against a daemon that answers nothing, whether its connection is new or pooled."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ckptdrain.client import Timeout
from tests.conftest import DaemonProcess


def _grace_s(timeout_s: float) -> float:
    # docs/client-api.md: a wait, begin or put's reply is waited for this long past timeout_s.
    return min(30.0, max(2.0, timeout_s / 10))


@contextmanager
def _stopped(d: DaemonProcess) -> Iterator[None]:
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        d.proc.send_signal(signal.SIGCONT)


def _times_out_within(call: Callable[[], object], bound_s: float) -> float:
    started = time.monotonic()
    with pytest.raises(Timeout):
        call()
    elapsed = time.monotonic() - started
    assert elapsed < bound_s, f"raised after {elapsed:.1f} s, bound {bound_s:.1f} s"
    return elapsed


def test_calls_against_a_stopped_daemon_end_within_their_timeout_and_grace(
    make_daemon: Any
) -> None:
    # Found attacking: with the daemon SIGSTOPped, wait(timeout_s=3) raised after 10 s: the
    # new connection's hello waited the fixed 10 s connect timeout, not what the caller gave.
    d: DaemonProcess = make_daemon()
    fresh = d.client(timeout_s=60)  # connect_timeout_s stays at its 10 s default
    pooled = d.client(timeout_s=60)
    pooled.status()  # leaves one idle connection in the pool
    short = d.client(timeout_s=2)
    with _stopped(d):
        _times_out_within(lambda: fresh.wait("job", 1, timeout_s=3), 3 + _grace_s(3) + 1)
        _times_out_within(lambda: pooled.wait("job", 1, timeout_s=3), 3 + _grace_s(3) + 1)
        # A client's own timeout_s bounds a new connection's hello and the begin together.
        _times_out_within(lambda: short.generation("job", 2).__enter__(),
                          2 + _grace_s(2) + 1)
        _times_out_within(short.status, 2 + 1)

