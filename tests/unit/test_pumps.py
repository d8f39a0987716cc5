"""The pipe pump (a ``data_pipe`` frame's bytes): exactly the shard's size from the client's
pipe into the staged file, with or without splice into the file, and a client that writes
too little, too much or nothing is told so without ever blocking the pump's thread."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from ckptdrain.client.pipes import PipeHandOff
from ckptdrain.daemon.dataplane import (
    Cancelled,
    ClientIdle,
    ClientTooSlow,
    DataPlane,
    PumpStalled,
    RateFloor,
)
from ckptdrain.daemon.pumps import PipeEnded, PipeOverrun, PipePump, SocketPump
from tests.conftest import wait_for

MiB = 1 << 20


def writer(w: int, data: bytes, close: bool = True) -> threading.Thread:
    def run() -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
        if close:
            os.close(w)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("splice_into_file", [True, False])
def test_exactly_the_size_lands_in_the_file(tmp_path: Path, splice_into_file: bool) -> None:
    data = os.urandom(5 * MiB + 123)
    r, w = os.pipe()  # blocking, as a careless client leaves it: the pump must not care
    pump = PipePump(r)
    pump.splice_ok = splice_into_file
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)
    t = writer(w, data)
    try:
        assert pump.pump(out, len(data), 10.0, threading.Event()) == len(data)
    finally:
        t.join()
        os.close(out)
        pump.close()
    assert (tmp_path / "staged").read_bytes() == data
    assert pump.src_fd == -1  # closed with the pump


def test_a_socket_pump_into_a_file_that_takes_no_splice_goes_through_its_buffer(
        tmp_path: Path) -> None:
    """Found reviewing 472b190: the socket pump fell back to its buffer only where the
    socket refused splice, not where the file did (an O_APPEND file refuses it with EINVAL):
    every `data` frame to such a staging file failed as an internal error. Now what is in the
    pump's pipe goes through the buffer, and so does the rest."""
    data = os.urandom(3 * MiB + 17)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    pump = SocketPump(ours.fileno())
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def send() -> None:
        with contextlib.suppress(OSError):  # the pump failed and its socket closed
            theirs.sendall(data)

    t = threading.Thread(target=send)
    t.start()
    try:
        assert pump.pump(out, len(data), 10.0, threading.Event()) == len(data)
        assert not pump.splice_ok  # learnt once: the moves after the first skip the pipe
    finally:
        pump.close()
        ours.close()  # a sender still blocked gets EPIPE, so a failure here never hangs
        t.join()
        os.close(out)
        theirs.close()
    assert (tmp_path / "staged").read_bytes() == data


def test_a_pipe_that_ends_early_is_a_size_error(tmp_path: Path) -> None:
    r, w = os.pipe()
    pump = PipePump(r)
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)
    t = writer(w, b"x" * 1000)
    try:
        with pytest.raises(PipeEnded, match="after 1000 of the shard's 4096 bytes"):
            pump.pump(out, 4096, 10.0, threading.Event())
    finally:
        t.join()
        os.close(out)
        pump.close()


def test_bytes_past_the_size_are_refused(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.write(w, b"y" * 5000)
    pump = PipePump(r)
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(PipeOverrun, match="more bytes than the shard's size"):
            pump.pump(out, 4096, 10.0, threading.Event())
    finally:
        os.close(w)
        os.close(out)
        pump.close()


def test_a_pipe_held_open_and_silent_is_cut_off_not_waited_on(tmp_path: Path) -> None:
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)
    writers = []
    try:
        for limit in ("idle", "rate"):
            r, w = os.pipe()  # blocking: a plain read of it would wait for ever
            writers.append(w)
            os.write(w, b"z" * 100)
            pump = PipePump(r)
            if limit == "idle":
                with pytest.raises(ClientIdle, match=r"idle for 0\.3 s"):
                    pump.pump(out, 4096, 0.3, threading.Event())
            else:
                floor = RateFloor(rate=1000, grace_s=0.2)
                with pytest.raises(ClientTooSlow, match="client_min_bytes_per_s"):
                    pump.pump(out, 4096, 30.0, threading.Event(), floor)
            assert pump.src_fd == -1  # one shard, one pump: its pipe closed as it returned
    finally:
        for w in writers:
            os.close(w)
        os.close(out)


def test_a_cancelled_pump_stops_and_its_pipe_closes_when_it_is_out(tmp_path: Path) -> None:
    r, w = os.pipe()
    pump = PipePump(r)
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)
    cancel = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pump.pump(out, 4096, 30.0, cancel)
        except BaseException as exc:  # recorded for the assertion below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: pump._busy, timeout_s=10)  # in its thread, waiting on the silent pipe
    pump.close()  # the connection went: the thread still owns the pipe until it is out
    assert pump.src_fd == r
    cancel.set()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], Cancelled)
    assert pump.src_fd == -1
    os.close(w)
    os.close(out)


def test_the_client_side_vmsplices_a_read_only_buffer_from_any_offset(tmp_path: Path) -> None:
    """bytes are read-only (no ctypes from_buffer): the address comes from the buffer
    protocol, and a slice starts where the slice does."""
    data = os.urandom(3 * MiB)
    view = memoryview(data)[4097:]
    pipe = PipeHandOff.start(view)
    assert pipe is not None and pipe.sent > 0
    pump = PipePump(os.dup(pipe.read_fd))
    pipe.handed_over()
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)
    quiet, other = socket.socketpair()  # the daemon's reply would come here: none does
    t = threading.Thread(target=pipe.finish, args=(time.monotonic() + 30, quiet.fileno()))
    t.start()
    try:
        pump.pump(out, view.nbytes, 10.0, threading.Event())
    finally:
        t.join()
        pipe.close()
        os.close(out)
        pump.close()
        quiet.close()
        other.close()
    assert (tmp_path / "staged").read_bytes() == data[4097:]
    assert pipe.sent == view.nbytes


def test_a_pump_that_waits_too_long_for_a_thread_is_given_up_on(tmp_path: Path) -> None:
    """Found by the second attack: the watchdog only looked at running pumps, so one queued
    behind wedged threads waited with nothing to end it. It counts from when it was armed."""
    plane = DataPlane(1, 30.0, pumps=1)
    hold = threading.Event()
    r, w = os.pipe()
    os.write(w, b"q" * 100)
    os.close(w)
    pump = PipePump(r)
    out = os.open(tmp_path / "staged", os.O_WRONLY | os.O_CREAT)

    async def scenario() -> None:
        wedged = asyncio.ensure_future(plane.pump(hold.wait, 60, cancel=threading.Event(),
                                                  stalled=lambda: False, pipe=True))
        await asyncio.sleep(0)  # the one pipe thread is taken
        cancel = threading.Event()
        pump.arm()
        with pytest.raises(PumpStalled, match="waited for a thread"):
            await plane.pump(pump.pump, out, 100, 10.0, cancel, cancel=cancel,
                             stalled=lambda: pump.stalled(0.5), pipe=True, owner="uid",
                             running=pump.running)
        # Counted as stuck, but its client is not to blame: it never ran (found by review).
        assert plane.stuck == 1 and plane.stuck_owners == {}
        hold.set()
        await wedged
        # The queued pump runs at last, sees it was given up on, and closes its pipe.
        while plane.stuck:
            await asyncio.sleep(0.05)
        assert plane.stuck_owners == {} and pump.src_fd == -1

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        hold.set()
        plane.close()
        os.close(out)
    assert (tmp_path / "staged").read_bytes() == b""
