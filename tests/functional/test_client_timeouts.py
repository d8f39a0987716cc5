"""A call the caller gave a timeout returns within it (plus the documented grace for its reply)
against a daemon that answers nothing, whether its connection is new or pooled."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import RejectedInput, Timeout
from tests.conftest import DaemonProcess, wait_for


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



def test_put_file_of_a_fifo_with_no_writer_is_refused_not_waited_on(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking the client: put_file(path) opened the path blocking, and a FIFO with
    # no writer held the call (and the job) past any timeout, 20 s and more with timeout_s=5.
    fifo = tmp_path / "shard.fifo"
    os.mkfifo(fifo)
    refused: list[BaseException] = []

    def put() -> None:
        try:
            with daemon.client(timeout_s=5).generation("fifo", 1) as gen:
                gen.put_file("w", fifo)
        except RejectedInput as exc:
            refused.append(exc)

    putter = threading.Thread(target=put, daemon=True)
    putter.start()
    putter.join(15)
    if putter.is_alive():  # let it go before failing: a writer's open ends its wait
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        putter.join(10)
        pytest.fail("put_file waited on a FIFO with no writer")
    assert refused and "must be a regular file or memfd" in str(refused[0]), refused


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class TrainingCodeFailed(Exception):
    pass


def test_an_exception_in_the_block_is_not_held_back_by_a_hung_daemon(
        daemon: DaemonProcess) -> None:
    # Found attacking: leaving `with client.generation(...)` by an exception of the training
    # code sends a best-effort abort, which waited the client's whole timeout_s (300 s by
    # default) for a SIGSTOPped daemon before the job's own exception came out.
    client = daemon.client(timeout_s=120)
    started = 0.0
    with _stopped_here(daemon), pytest.raises(TrainingCodeFailed), \
            client.generation("job", 1) as gen:
        gen.put("shard", b"bytes")
        daemon.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        wait_for(lambda: _state(daemon.pid) == "T")
        started = time.monotonic()
        raise TrainingCodeFailed("a NaN loss")
    assert time.monotonic() - started < 5 + 3
    # Resumed, the daemon sees the part's connection gone and aborts it.
    with daemon.client(timeout_s=30) as c:
        wait_for(lambda: c.status("job")["generations"][0]["state"] == "failed")


@contextmanager
def _stopped_here(d: DaemonProcess) -> Iterator[None]:
    """Whatever stops ``d`` inside the block, it runs again after it."""
    try:
        yield
    finally:
        assert d.proc is not None
        d.proc.send_signal(signal.SIGCONT)


def test_a_wait_of_no_time_asks_the_daemon(daemon: DaemonProcess) -> None:
    # Found attacking: wait(timeout_s=0), a poll, raised Timeout ("did not finish 'wait'
    # within 0 s; it may be overloaded or hung") before the request went, of a committed
    # step too, and dropped the pooled connection.
    with daemon.client(timeout_s=30) as c:
        with c.generation("poll", 1) as gen:
            gen.put("shard", b"bytes")
        assert c.wait("poll", 1, timeout_s=30)["committed"]
        [pooled] = c._idle
        assert c.wait("poll", 1, timeout_s=0)["committed"]
        with pytest.raises(Timeout, match="not committed"):  # the daemon's answer
            c.wait("poll", 2, timeout_s=0)
        assert c._idle == [pooled]  # answered: the connection stays in use
