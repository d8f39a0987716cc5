"""The daemon's reads for its clients run on a loop of their own (daemon/fetcher.py), and the
rule for the client's fd holds across the two loops: a cancelled caller returns only once the
read, and the thread writing the fd, have ended.

The backend here is a fake that reads "on its loop" as S3 does and writes in a thread: what a
cancelled read leaves running is what these tests need to hold still, which a real server
cannot do on cue. tests/integration/test_s3_fetch.py runs a daemon against SeaweedFS."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import pytest

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend
from ckptdrain.daemon.fetcher import Fetcher
from ckptdrain.daemon.threads import settled
from tests.unit.test_threads import _cancel_twice_while_the_thread_runs


class ThreadedReads(MemoryBackend):
    """Reads on its event loop, as S3 does; writes into the client's fd with ``copy`` in a
    thread of that loop. Records the thread each read ran on."""

    reads_on_loop = True

    def __init__(self, copy: Callable[[int], int] = lambda fd: 0) -> None:
        super().__init__("node-a")
        self.copy = copy
        self.read_on: list[str] = []
        self.closed = 0

    async def copy_into(self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
                        progress: Callable[[int], None] | None = None,
                        owned: bool = False,
                        expected_size: int | None = None) -> tuple[int, str]:
        self.read_on.append(threading.current_thread().name)
        if key == "on-the-loop":  # holds the reading loop itself while copy runs
            return self.copy(out_fd), f"{algo}:0"
        loop = asyncio.get_running_loop()
        size = await settled(loop.run_in_executor(None, self.copy, out_fd))
        return size, f"{algo}:0"

    async def aclose(self) -> None:
        self.closed += 1


def fetcher_with(reader: ThreadedReads) -> tuple[Fetcher, ThreadedReads]:
    daemons = ThreadedReads()
    opened: list[ThreadedReads] = []

    def open_reader() -> ThreadedReads:
        opened.append(reader)
        assert len(opened) == 1, "the reading backend is opened once"
        return reader

    return Fetcher(daemons, open_reader), daemons


@pytest.mark.asyncio
async def test_reads_run_on_the_fetch_thread_and_their_errors_come_back_as_raised() -> None:
    def copy(fd: int) -> int:
        if fd < 0:
            raise BackendError("shard-0 does not exist; it was deleted", kind="not_found")
        return 7

    reader = ThreadedReads(copy)
    fetcher, daemons = fetcher_with(reader)
    try:
        assert await fetcher.copy_into("k", 5) == (7, "crc64nvme:0")
        with pytest.raises(BackendError, match="does not exist") as raised:
            await fetcher.copy_into("k", -1)
        assert raised.value.kind == "not_found"
        assert reader.read_on == ["ckptdrain-fetch", "ckptdrain-fetch"]
        assert daemons.read_on == []  # the daemon's own backend read nothing
    finally:
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_a_caller_cancelled_twice_returns_only_once_the_read_has_ended() -> None:
    """A concurrent future cancelled is done at once while the work it stood for runs on:
    the caller (who closes the client's fd next) must wait for the work itself."""
    started, go = threading.Event(), threading.Event()
    seen: list[str] = []
    fd = os.memfd_create("client-file")

    def copy(into: int) -> int:
        started.set()
        go.wait(30)
        try:
            os.fstat(into)
            seen.append("open")
        except OSError as exc:
            seen.append(f"closed under the thread ({exc})")
        return 0

    fetcher, _ = fetcher_with(ThreadedReads(copy))

    async def caller() -> None:
        try:
            await fetcher.copy_into("k", fd)
        finally:
            os.close(fd)  # what the connection does once the fetch returns

    try:
        task = asyncio.create_task(caller())
        still_waiting = await _cancel_twice_while_the_thread_runs(started, task)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert still_waiting
        assert seen == ["open"]
    finally:
        go.set()
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_a_fetch_cancelled_before_its_read_began_returns() -> None:
    """Cancelled while the reading loop was busy, the read is cancelled before its first
    step: its coroutine never runs, so only the task's end can tell the caller."""
    held, go = threading.Event(), threading.Event()

    def hold_the_loop(fd: int) -> int:
        held.set()
        go.wait(30)
        return 0

    fetcher, _ = fetcher_with(ThreadedReads(hold_the_loop))
    try:
        holding = asyncio.create_task(fetcher.copy_into("on-the-loop", 3))
        await asyncio.to_thread(held.wait, 30)
        queued = asyncio.create_task(fetcher.copy_into("queued", 4))
        await asyncio.sleep(0)  # the request is on its way to the busy loop
        queued.cancel()
        go.set()
        async with asyncio.timeout(30):
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert await holding == (0, "crc64nvme:0")
    finally:
        go.set()
        await fetcher.aclose()


@pytest.mark.asyncio
async def test_closing_stops_the_thread_and_a_later_fetch_gets_a_transient_error() -> None:
    reader = ThreadedReads(lambda fd: 1)
    fetcher, _ = fetcher_with(reader)
    await fetcher.copy_into("k", 3)
    thread = fetcher.thread
    assert thread is not None and thread.is_alive()
    await fetcher.aclose()
    assert not thread.is_alive()
    assert reader.closed == 1
    with pytest.raises(BackendError, match="stopping") as raised:
        await fetcher.copy_into("k", 3)
    assert raised.value.transient
    await fetcher.aclose()  # twice is harmless
    assert reader.closed == 1


@pytest.mark.asyncio
async def test_a_destination_read_in_threads_is_read_in_place() -> None:
    class Posixlike(ThreadedReads):
        reads_on_loop = False

    daemons = Posixlike(lambda fd: 2)

    def never() -> ThreadedReads:
        raise AssertionError("no second backend for a destination that reads in threads")

    fetcher = Fetcher(daemons, never)
    assert await fetcher.copy_into("k", 3) == (2, "crc64nvme:0")
    assert daemons.read_on == [threading.current_thread().name]
    assert fetcher.thread is None
    await fetcher.aclose()
