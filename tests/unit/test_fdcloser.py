"""FdCloser: closes of the fds clients pass, off the loop, charged to their uid; a close that
blocks (a pipe whose lock its client holds, a lingering socket) ties up one thread, and one
uid no more than its share of them."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.daemon import fdcloser
from ckptdrain.daemon.fdcloser import FdCloser
from tests.conftest import wait_for
from tests.functional.test_pipe_handoff import read_ends_held

_CLOSE_SYSCALL = {"x86_64": 3, "aarch64": 57}[platform.machine()]


def close_threads() -> int:
    return sum(t.name == "ckptdrain-io-close" for t in threading.enumerate())


def closing_threads() -> int:
    """Closing threads inside close(2) now: stuck there, waiting for a pipe's lock."""
    stuck = 0
    for thread in threading.enumerate():
        if thread.name == "ckptdrain-io-close" and thread.native_id is not None:
            with contextlib.suppress(OSError):
                call = Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().split()
                stuck += bool(call) and call[0] == str(_CLOSE_SYSCALL)
    return stuck


def test_one_uids_locked_pipes_never_keep_another_uids_closes_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking: the pipe-close threads were one pool for every uid, first come first
    # served. One user's pipes whose locks it held (passed over many connections) took every
    # thread, and other users' pipes waited behind them, charged to those users till they
    # were refused as pipes_held themselves. Now one uid has at most its share of threads.
    monkeypatch.setattr(fdcloser, "MAX_CLOSE_THREADS", 4)
    monkeypatch.setattr(fdcloser, "MAX_CLOSE_THREADS_PER_UID", 2)
    closer = FdCloser()
    threads_before = close_threads()
    with read_ends_held(6) as ends:  # more than every thread
        while ends:  # the closer's is the last close of each: it waits for the lock
            closer.close(ends.pop(), owner="attacker")
        wait_for(lambda: closing_threads() == 2, timeout_s=10)
        r, w = os.pipe()
        try:
            closer.close(r, owner="innocent")
            wait_for(lambda: closer.closes_of("innocent") == 0, timeout_s=10)
            assert closer.closes_of("attacker") == 6
            assert closer.fds_of("attacker") == 6
            assert closing_threads() == 2  # the attacker's two, still stuck; no more of its
        finally:
            os.close(w)
    # The lock let go: the attacker's closes end, one after another, in its two threads.
    wait_for(lambda: closer.fds_of("attacker") == 0, timeout_s=10)
    wait_for(lambda: close_threads() == threads_before, timeout_s=10)  # idle ones end too


def test_fds_received_count_against_their_uid_until_handed_on() -> None:
    closer = FdCloser()
    closer.received(1000, 3)
    assert closer.fds_of(1000) == 3 and closer.closes_of(1000) == 0
    closer.handed_on(1000, 1)  # taken by a hand-off: no longer this account's
    r, w = os.pipe()
    closer.handed_on(1000, 2)  # ...and two given to close
    for fd in (r, w):
        closer.close(fd, owner=1000)
    wait_for(lambda: closer.fds_of(1000) == 0, timeout_s=10)  # both closed


@contextlib.contextmanager
def lingering_socket() -> Iterator[int]:
    """A TCP socket whose close waits (SO_LINGER, 30 s) for unsent bytes its peer never
    reads; the peer is closed on leaving, and the close ends then."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    try:
        sender.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                sender.send(b"x" * 65536)
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 30))
        yield sender.detach()
    finally:
        peer.close()


def test_one_uids_lingering_sockets_never_keep_another_uids_closes_waiting() -> None:
    # Found attacking: a socket with nothing queued in it closed in the pool of two threads
    # every user shared. Two TCP sockets lingering on unsent data their peer never read held
    # both threads, and every other user's connections closed behind them, charged to those
    # users till they were refused as pipes_held. One uid's closes now take at most its share
    # of the closing threads, and the others' find one.
    closer = FdCloser()
    with lingering_socket() as first, lingering_socket() as second:
        closer.close(first, owner="attacker")
        closer.close(second, owner="attacker")
        wait_for(lambda: closing_threads() >= 2, timeout_s=10)
        r, w = os.pipe()
        closer.close(r, owner="innocent")
        closer.close(w, owner="innocent")
        wait_for(lambda: closer.closes_of("innocent") == 0, timeout_s=10)
        assert closer.closes_of("attacker") == 2  # still lingering
    wait_for(lambda: closer.closes_of("attacker") == 0, timeout_s=10)


def test_with_no_thread_to_be_had_a_close_waits_and_never_runs_in_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Found reviewing: closes are handed over on the event loop, and where no thread could be
    # started the close ran in the caller, there the loop: a pipe whose lock its client held
    # stopped the daemon. It waits its turn now, and the next thread takes it.
    closer = FdCloser()
    with read_ends_held(1) as ends:
        locked = ends.pop()
        real_start = threading.Thread.start

        def no_thread(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", no_thread)
        caller = threading.Thread(target=closer.close, args=(locked, "owner"), daemon=True)
        real_start(caller)
        caller.join(5)
        assert not caller.is_alive(), "the close ran in the caller"
        monkeypatch.undo()
        assert closer.closes_of("owner") == 1
        r, w = os.pipe()
        closer.close(r, owner="owner")  # a thread now: it closes this one, then the locked one
        closer.close(w, owner="owner")
    wait_for(lambda: closer.closes_of("owner") == 0, timeout_s=10)  # the lock let go: all closed
