"""FdCloser: closes of the fds clients pass, off the loop, charged to their uid; a pipe whose
lock its client holds ties up one thread, and one uid no more than its share of them."""

from __future__ import annotations

import os
import threading

import pytest

from ckptdrain.daemon import fdcloser
from ckptdrain.daemon.fdcloser import FdCloser
from tests.conftest import wait_for
from tests.functional.test_pipe_handoff import read_ends_held


def close_threads() -> int:
    return sum(t.name == "ckptdrain-io-close-pipe" for t in threading.enumerate())


def test_one_uids_locked_pipes_never_keep_another_uids_closes_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking: the pipe-close threads were one pool for every uid, first come first
    # served. One user's pipes whose locks it held (passed over many connections) took every
    # thread, and other users' pipes waited behind them, charged to those users till they
    # were refused as pipes_held themselves. Now one uid has at most its share of threads.
    monkeypatch.setattr(fdcloser, "MAX_PIPE_CLOSERS", 4)
    monkeypatch.setattr(fdcloser, "MAX_PIPE_CLOSE_THREADS_PER_UID", 2)
    closer = FdCloser(lambda: None)
    threads_before = close_threads()
    try:
        with read_ends_held(6) as ends:  # more than every thread
            while ends:  # the closer's is the last close of each: it waits for the lock
                closer.close(ends.pop(), owner="attacker")
            closer.received("attacker", 6)  # (counted the way a channel counts them)
            closer.handed_on("attacker", 6)
            wait_for(lambda: close_threads() - threads_before == 2, timeout_s=10)
            r, w = os.pipe()
            try:
                closer.close(r, owner="innocent")
                wait_for(lambda: closer.closes_of("innocent") == 0, timeout_s=10)
                assert closer.closes_of("attacker") == 6
                assert closer.fds_of("attacker") == 6
                assert close_threads() - threads_before == 2  # the attacker's two, still stuck
            finally:
                os.close(w)
        # The lock let go: the attacker's closes end, one after another, in its two threads.
        wait_for(lambda: closer.fds_of("attacker") == 0, timeout_s=10)
        wait_for(lambda: close_threads() == threads_before, timeout_s=10)
    finally:
        closer.shutdown()


def test_fds_received_count_against_their_uid_until_handed_on() -> None:
    closer = FdCloser(lambda: None)
    try:
        closer.received(1000, 3)
        assert closer.fds_of(1000) == 3 and closer.closes_of(1000) == 0
        closer.handed_on(1000, 1)  # taken by a hand-off: no longer this account's
        r, w = os.pipe()
        closer.handed_on(1000, 2)  # ...and two given to close
        for fd in (r, w):
            closer.close(fd, owner=1000)
        wait_for(lambda: closer.fds_of(1000) == 0, timeout_s=10)  # both closed
    finally:
        closer.shutdown()
