"""Ownership primitives: a Reservation is released exactly once; the supervisor owns work that
outlives a request, behind a failure boundary, and a stop waits only for critical work."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptdrain.daemon.budget import AccountingError, Budget
from ckptdrain.daemon.dataplane import DataPlane
from ckptdrain.daemon.errors import DaemonError, StuckIO
from ckptdrain.daemon.supervisor import Supervisor


def test_a_reservation_released_twice_raises() -> None:
    budget = Budget("max_staged_bytes", 100)
    held = budget.reserve_now(60)
    assert held is not None and budget.used == 60
    held.release()
    assert budget.used == 0
    with pytest.raises(AccountingError, match="released twice"):
        held.release()
    assert budget.used == 0


def test_releasing_more_than_is_held_raises_instead_of_clamping() -> None:
    budget = Budget("max_queued_shards", 10)
    budget.reserve_now(1)
    with pytest.raises(AccountingError):
        budget.release(2)
    assert budget.used == 1
    assert issubclass(AccountingError, DaemonError)


def test_recovered_room_may_exceed_the_limit_and_blocks_new_room() -> None:
    budget = Budget("max_staged_bytes", 100)
    found = budget.adopt(150)  # what recovery found on disk, whatever the limit says now
    assert budget.used == 150 and budget.reserve_now(1) is None
    found.release()
    assert budget.reserve_now(100) is not None


@pytest.mark.asyncio
async def test_the_supervisor_survives_a_failing_job(caplog: pytest.LogCaptureFixture) -> None:
    sup = Supervisor()
    done = asyncio.Event()

    async def boom() -> None:
        raise RuntimeError("a bug in one job")

    async def fine() -> None:
        done.set()

    runner = asyncio.create_task(sup.run())
    with caplog.at_level(logging.ERROR, logger="ckptdrain.supervisor"):
        sup.spawn(boom, what="boom")
        sup.spawn(fine, what="fine")
        await asyncio.wait_for(done.wait(), 5)
        while sup.failures == 0:
            await asyncio.sleep(0)
    assert sup.failures == 1
    assert any("boom" in r.getMessage() and r.exc_info for r in caplog.records)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


@pytest.mark.asyncio
async def test_a_stop_waits_for_critical_work_only() -> None:
    sup = Supervisor()
    release = asyncio.Event()
    finished: list[str] = []

    async def persist() -> None:
        await release.wait()
        finished.append("persist")

    async def retention() -> None:
        await asyncio.Event().wait()  # would wait forever

    runner = asyncio.create_task(sup.run())
    sup.spawn(persist, what="persist", critical=True)
    sup.spawn(retention, what="retention")
    await asyncio.sleep(0)
    stopping = asyncio.create_task(sup.finish(5.0))
    await asyncio.sleep(0)
    sup.spawn(persist, what="too late", critical=True)  # dropped: no new work once stopping
    release.set()
    assert await stopping == 0
    assert finished == ["persist"]
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


@pytest.mark.asyncio
async def test_a_call_past_its_timeout_is_stuck_until_it_returns_and_then_cleaned_up() -> None:
    plane = DataPlane(2, 0.05, pumps=2)
    gate = threading.Event()
    cleaned: list[bool] = []
    try:
        with pytest.raises(StuckIO, match="io_timeout_s"):
            await plane.call(gate.wait, 10.0, cleanup=lambda: cleaned.append(True))
        assert plane.stuck == 1 and not cleaned  # nobody releases what the thread still uses
        gate.set()
        while plane.stuck:
            await asyncio.sleep(0.01)
        assert cleaned == [True] and plane.busy == 0
    finally:
        gate.set()
        plane.close()


def _closing_recorder() -> tuple[list[int], Callable[[int], None]]:
    """An ``abandoned`` callback that closes each fd it is given, and the list of them."""
    released: list[int] = []

    def release(fd: int) -> None:
        released.append(fd)
        os.close(fd)

    return released, release


@pytest.mark.asyncio
async def test_what_a_call_given_up_on_makes_later_is_released(tmp_path: Path) -> None:
    # Found reading the give-up path: a staged temp file's open that outlived io_timeout_s
    # still opened the file once its thread got going, and nobody closed that fd.
    plane = DataPlane(2, 0.05, pumps=2)
    gate = threading.Event()
    released, release = _closing_recorder()

    def slow_open() -> int:
        assert gate.wait(10.0)
        return os.open(tmp_path / "late.tmp", os.O_WRONLY | os.O_CREAT, 0o600)

    try:
        with pytest.raises(StuckIO):
            await plane.call(slow_open, abandoned=release)
        gate.set()
        while plane.stuck:
            await asyncio.sleep(0.01)
        assert len(released) == 1
        with pytest.raises(OSError):
            os.fstat(released[0])  # closed
        # A call that returns in time hands its result to the caller, not to ``abandoned``.
        fd = await plane.call(os.open, str(tmp_path / "kept.tmp"), os.O_WRONLY | os.O_CREAT,
                              0o600, abandoned=release)
        os.close(fd)
        assert len(released) == 1
    finally:
        gate.set()
        plane.close()


@pytest.mark.asyncio
async def test_what_a_call_returns_as_its_caller_is_cancelled_is_released(tmp_path: Path) -> None:
    # Found reviewing the above: a caller cancelled after the thread had returned (its
    # result posted, the caller not yet resumed) took the path that only ran ``cleanup``.
    plane = DataPlane(2, 10.0, pumps=2)
    returning = threading.Event()
    released, release = _closing_recorder()

    def quick_open() -> int:
        fd = os.open(tmp_path / "quick.tmp", os.O_WRONLY | os.O_CREAT, 0o600)
        returning.set()
        return fd

    try:
        caller = asyncio.ensure_future(plane.call(quick_open, abandoned=release))
        await asyncio.sleep(0)  # submitted
        # Held off the loop until the thread has returned and posted its result, so the
        # caller is cancelled with the call already done.
        assert returning.wait(10)
        time.sleep(0.2)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert len(released) == 1
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_call_a_close_drops_unstarted_is_cleaned_up_and_abandons_nothing() -> None:
    # Found attacking the lane of threads: a queued call dropped by close() went down the
    # path of a call that had returned, so ``abandoned`` was handed None for a result that
    # was never made (a hand-off's ``late[0]`` raised TypeError there, and its cleanup was
    # skipped); and one whose caller had already timed out was never cleaned up at all,
    # staying in ``busy`` and ``stuck``.
    plane = DataPlane(1, 10.0, pumps=1)
    gate = threading.Event()
    started = threading.Event()
    abandoned: list[object] = []
    cleaned: list[str] = []
    try:
        running = asyncio.ensure_future(plane.call(lambda: started.set() or gate.wait(10.0)))
        waiting = asyncio.ensure_future(plane.call(
            os.getpid, abandoned=abandoned.append, cleanup=lambda: cleaned.append("waiting")))
        await asyncio.sleep(0)
        assert started.wait(10)
        plane.timeout_s = plane._lane.limit_s = 0.05
        with pytest.raises(StuckIO):
            await plane.call(os.getpid, abandoned=abandoned.append,
                             cleanup=lambda: cleaned.append("left"))
        assert plane.stuck == 1 and plane.busy == 3
        plane.close()  # both queued calls are dropped: neither ever runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert abandoned == [] and sorted(cleaned) == ["left", "waiting"]
        gate.set()
        assert await running is True
        assert plane.stuck == 0 and plane.busy == 0
    finally:
        gate.set()
        plane.close()


@pytest.mark.asyncio
async def test_a_call_whose_thread_could_not_start_leaves_the_lane_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking the lane of threads: a thread whose start failed (the process's thread
    # limit, for a moment) was counted as started, so the lane never started another: with
    # one thread, every later call waited in the queue till io_timeout_s (StuckIO). The call
    # that failed also stayed in ``busy``, and its ``cleanup`` never ran.
    plane = DataPlane(1, 1.0, pumps=1)
    real_start = threading.Thread.start
    starts: list[str] = []
    cleaned: list[bool] = []

    def start_once_failing(thread: threading.Thread) -> None:
        starts.append(thread.name)
        if len(starts) == 1:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    try:
        with pytest.raises(RuntimeError, match="start new thread"):
            await plane.call(os.getpid, cleanup=lambda: cleaned.append(True))
        assert cleaned == [True] and plane.busy == 0
        assert await plane.call(len, "four") == 4
        assert plane.busy == 0 and plane.stuck == 0
    finally:
        plane.close()
