"""The daemon's reads for its clients run on a loop of their own (daemon/fetcher.py), and the
rules for the client's fd hold across the two loops: the read writes into a duplicate that
the fetcher closes once the read has ended, whoever stopped it, and a caller is always
answered (by its read's end, or once that loop is gone).

The backend here is a fake that reads "on its loop" as S3 does and writes in a thread: what a
cancelled read leaves running is what these tests need to hold still, which a real server
cannot do on cue. tests/integration/test_s3_fetch.py runs a daemon against SeaweedFS."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator

import pytest

from ckptdrain.daemon import checksums
from ckptdrain.daemon import fetcher as fetcher_module
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend
from ckptdrain.daemon.fetcher import Fetcher
from ckptdrain.daemon.threads import settled
from tests.unit.test_threads import _cancel_twice_while_the_thread_runs


class ThreadedReads(MemoryBackend):
    """Reads on its event loop, as S3 does; writes into the client's fd with ``copy`` in a
    thread of that loop. Records the thread each read ran on, and the reads cancelled."""

    def __init__(self, copy: Callable[[int], int] = lambda fd: 0) -> None:
        super().__init__("node-a")
        self.copy = copy
        self.read_on: list[str] = []
        self.cancelled: list[str] = []
        self.closed = 0

    async def copy_into(self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
                        progress: Callable[[int], None] | None = None,
                        owned: bool = False,
                        expected_size: int | None = None) -> tuple[int, str]:
        self.read_on.append(threading.current_thread().name)
        if key == "on-the-loop":  # holds the reading loop itself while copy runs
            return self.copy(out_fd), f"{algo}:0"
        if key == "waits":  # a read waiting on the network, as long as it is let
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append(key)
                raise
        loop = asyncio.get_running_loop()
        size = await settled(loop.run_in_executor(None, self.copy, out_fd))
        return size, f"{algo}:0"

    async def aclose(self) -> None:
        self.closed += 1


@pytest.fixture
def client_fd() -> Iterator[int]:
    """A client's file, as a fetch passes it (the connection's own fd)."""
    fd = os.memfd_create("client-file")
    yield fd
    os.close(fd)


UID = 4242


class Closes:
    """The fetcher's ``close_fd``: closes each fd and records it, in order, and whom it was
    charged to."""

    def __init__(self) -> None:
        self.closed: list[int] = []
        self.owners: list[int] = []

    def __call__(self, fd: int, owner: int) -> None:
        os.close(fd)
        self.closed.append(fd)
        self.owners.append(owner)


def fetcher_with(reader: ThreadedReads, closes: Closes | None = None) -> Fetcher:
    opened: list[ThreadedReads] = []

    def open_reader() -> ThreadedReads:
        opened.append(reader)
        assert len(opened) == 1, "the reading backend is opened once"
        return reader

    return Fetcher(open_reader, close_fd=closes or Closes())


@pytest.mark.asyncio
async def test_reads_run_on_the_fetch_thread_and_their_errors_come_back_as_raised(
        client_fd: int) -> None:
    def copy(fd: int) -> int:
        if fd < 0:
            raise BackendError("shard-0 does not exist; it was deleted", kind="not_found")
        return 7

    reader = ThreadedReads(copy)
    closes = Closes()
    fetcher = fetcher_with(reader, closes)
    try:
        into = [os.dup(client_fd), os.dup(client_fd)]
        assert await fetcher.copy_into("k", into[0], UID) == (7, "crc64nvme:0")
        reader.copy = lambda fd: copy(-1)
        with pytest.raises(BackendError, match="does not exist") as raised:
            await fetcher.copy_into("k", into[1], UID)
        assert raised.value.kind == "not_found"
        assert reader.read_on == ["ckptdrain-fetch", "ckptdrain-fetch"]
        assert closes.closed == into  # each read's own fd, closed once it ended
        assert closes.owners == [UID, UID]  # charged to the client's uid
    finally:
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_a_caller_cancelled_twice_waits_for_its_read_to_end(client_fd: int) -> None:
    """A concurrent future cancelled is done at once while the work it stood for runs on. A
    cancelled caller waits for the work itself (within the grace), through a second cancel
    too: a read that ends as asked leaves nothing running behind its connection."""
    started, go = threading.Event(), threading.Event()
    ended: list[str] = []

    def copy(into: int) -> int:
        started.set()
        go.wait(30)
        ended.append("copied")
        return 0

    fetcher = fetcher_with(ThreadedReads(copy))
    try:
        task = asyncio.create_task(fetcher.copy_into("k", os.dup(client_fd), UID))
        still_waiting = await _cancel_twice_while_the_thread_runs(started, task)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert still_waiting
        assert ended == ["copied"]
    finally:
        go.set()
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_a_client_that_hangs_up_stops_its_read_and_gets_no_answer(
        client_fd: int) -> None:
    reader = ThreadedReads()
    closes = Closes()
    fetcher = fetcher_with(reader, closes)
    try:
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        into = os.dup(client_fd)
        task = asyncio.create_task(fetcher.copy_into("waits", into, UID, gone=gone))
        async with asyncio.timeout(10):
            while not reader.read_on:
                await asyncio.sleep(0.01)
        gone.set_result(None)
        async with asyncio.timeout(10):  # at once, not after the grace: the read stops
            with pytest.raises(ConnectionError, match="hung up"):
                await task
        assert reader.cancelled == ["waits"]
        assert closes.closed == [into]
    finally:
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_a_write_stuck_in_the_kernel_holds_a_cancelled_caller_only_for_the_grace(
        client_fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found attacking the fetch loop: a fetch into a file on a frozen filesystem held the
    daemon's stop for as long as the filesystem stayed frozen. The write goes to a duplicate
    the fetcher closes when the write returns, so the caller may go after a grace and close
    its own fd: no thread can write into a reused fd number."""
    monkeypatch.setattr(fetcher_module, "CANCEL_GRACE_S", 0.2)
    started, thawed = threading.Event(), threading.Event()
    wrote_into: list[int] = []

    def stuck(into: int) -> int:  # a pwrite into a frozen filesystem
        wrote_into.append(into)
        started.set()
        thawed.wait(30)
        os.fstat(into)  # still open: nobody closed it under this thread
        return 0

    closes = Closes()
    fetcher = fetcher_with(ThreadedReads(stuck), closes)
    try:
        task = asyncio.create_task(fetcher.copy_into("k", os.dup(client_fd), UID))
        await asyncio.to_thread(started.wait, 30)
        task.cancel()
        async with asyncio.timeout(10):  # returns after the grace, the write still stuck
            with pytest.raises(asyncio.CancelledError):
                await task
        assert closes.closed == []  # the duplicate stays open while its write is stuck
        assert wrote_into and wrote_into[0] != client_fd
        thawed.set()
        async with asyncio.timeout(10):
            while not closes.closed:
                await asyncio.sleep(0.01)
        assert closes.closed == wrote_into
    finally:
        thawed.set()
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_closing_is_not_held_by_a_write_stuck_in_the_kernel(
        client_fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found re-testing with a frozen filesystem: the daemon's stop still waited for the
    fetch thread's full join, and the thread outlived it. Closing cancelled the reads in a
    gather under a timeout, and a gather cancelled by its timeout waits for a read stuck on a
    write all the same. The loop must stop and its thread end with the write still stuck."""
    monkeypatch.setattr(fetcher_module, "CANCEL_GRACE_S", 0.1)
    monkeypatch.setattr(fetcher_module, "CLOSE_TIMEOUT_S", 2.0)
    started, thawed = threading.Event(), threading.Event()
    wrote_into: list[int] = []

    def stuck(into: int) -> int:  # a pwrite into a frozen filesystem
        wrote_into.append(into)
        started.set()
        thawed.wait(60)
        return 0

    fetcher = fetcher_with(ThreadedReads(stuck))
    try:
        task = asyncio.create_task(fetcher.copy_into("k", os.dup(client_fd), UID))
        await asyncio.to_thread(started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        thread = fetcher.thread
        assert thread is not None
        async with asyncio.timeout(30):
            await fetcher.aclose()  # joins the thread for 3 close timeouts at most
        assert not thread.is_alive()
        assert not thawed.is_set()  # the write is still stuck
    finally:
        thawed.set()
        for fd in wrote_into:  # the duplicate stays with a write stuck past the close
            os.close(fd)


@pytest.mark.asyncio
async def test_a_fetch_cancelled_before_its_read_began_returns_at_once(
        client_fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the reading loop was busy, the read is cancelled before its first
    step: its coroutine never runs, so only the task's end can tell the caller, and it does
    so at once (not after the grace), its duplicate closed."""
    monkeypatch.setattr(fetcher_module, "CANCEL_GRACE_S", 60.0)
    held, go = threading.Event(), threading.Event()

    def hold_the_loop(fd: int) -> int:
        held.set()
        go.wait(30)
        return 0

    closes = Closes()
    fetcher = fetcher_with(ThreadedReads(hold_the_loop), closes)
    try:
        holding = asyncio.create_task(fetcher.copy_into("on-the-loop", os.dup(client_fd), UID))
        await asyncio.to_thread(held.wait, 30)
        into = os.dup(client_fd)
        queued = asyncio.create_task(fetcher.copy_into("queued", into, UID))
        await asyncio.sleep(0)  # the request is on its way to the busy loop
        queued.cancel()
        go.set()
        async with asyncio.timeout(10):
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert await holding == (0, "crc64nvme:0")
        assert into in closes.closed
    finally:
        go.set()
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_a_read_that_reaches_the_loop_as_it_stops_gets_a_transient_error(
        client_fd: int) -> None:
    """Its task is created in the loop's last turn and never steps: the loop's end cancels
    it, which is not the caller's cancel, so the caller hears "stopping", neither a
    cancellation it never asked for nor nothing at all."""
    fetcher = fetcher_with(ThreadedReads(lambda fd: 1))
    inside, gate = threading.Event(), threading.Event()
    try:
        await fetcher.copy_into("k", os.dup(client_fd), UID)
        intake = fetcher._intake
        assert intake is not None
        loop = intake.loop

        def hold_then_stop() -> None:  # the read's start is queued meanwhile, then the stop
            inside.set()
            gate.wait(30)
            loop.call_soon(loop.stop)

        loop.call_soon_threadsafe(hold_then_stop)
        await asyncio.to_thread(inside.wait, 30)
        read = asyncio.create_task(fetcher.copy_into("k", os.dup(client_fd), UID))
        await asyncio.sleep(0)  # the read is taken in: its start queued behind the held turn
        gate.set()
        async with asyncio.timeout(30):
            with pytest.raises(BackendError, match="stopping") as raised:
                await read
        assert raised.value.transient
    finally:
        gate.set()
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_closing_stops_the_thread_and_a_later_fetch_gets_a_transient_error(
        client_fd: int) -> None:
    reader = ThreadedReads(lambda fd: 1)
    closes = Closes()
    fetcher = fetcher_with(reader, closes)
    await fetcher.copy_into("k", os.dup(client_fd), UID)
    thread = fetcher.thread
    assert thread is not None and thread.is_alive()
    await fetcher.aclose()
    assert not thread.is_alive()
    assert reader.closed == 1
    late = os.dup(client_fd)
    with pytest.raises(BackendError, match="stopping") as raised:
        await fetcher.copy_into("k", late, UID)
    assert raised.value.transient
    assert closes.closed[-1] == late  # refused, and its duplicate closed all the same
    await fetcher.aclose()  # twice is harmless
    assert reader.closed == 1
