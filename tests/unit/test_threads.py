"""A cancelled caller outlasts the thread it handed work to, however often it is cancelled.

Found attacking the S3 upload workers: a caller cancelled twice (a drain's own timeout, then
the shutdown) left ``await asyncio.wait([future])`` at the second cancel, and its ``finally``
closed a memfd that the thread was still copying into. The same wait stood in nine places;
they all go through ``daemon/threads.py`` now, and the last test here fails on a new one."""

from __future__ import annotations

import ast
import asyncio
import os
import threading
from pathlib import Path

import pytest

from ckptdrain.daemon.backends.s3bodies import in_thread
from ckptdrain.daemon.threads import outlast, settled

DAEMON = Path(__file__).resolve().parents[2] / "daemon"


async def _cancel_twice_while_the_thread_runs(start: threading.Event,
                                              task: asyncio.Task[object]) -> bool:
    """Cancel ``task`` twice once its thread has started; whether it was still waiting after
    both (it must be: the thread has not been let go)."""
    while not start.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.3)
    return not done


@pytest.mark.asyncio
async def test_a_caller_cancelled_twice_returns_only_after_its_thread_and_its_fd_stays_open(
        ) -> None:
    started, go = threading.Event(), threading.Event()
    seen: list[str] = []
    fd = os.memfd_create("copied")

    def copy(into: int) -> None:
        started.set()
        go.wait(30)
        try:
            os.fstat(into)
            seen.append("open")
        except OSError as exc:
            seen.append(f"closed under the thread ({exc})")

    async def caller() -> None:
        try:
            await in_thread(copy, fd)
        finally:
            os.close(fd)  # what every caller does once in_thread returns

    task = asyncio.create_task(caller())
    still_waiting = await _cancel_twice_while_the_thread_runs(started, task)
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert still_waiting
    assert seen == ["open"]


@pytest.mark.asyncio
async def test_settled_tells_the_thread_to_stop_and_gives_up_after_its_grace() -> None:
    loop = asyncio.get_running_loop()
    stop, started, release = threading.Event(), threading.Event(), threading.Event()

    def polls() -> str:
        started.set()
        while not stop.wait(0.01):
            pass
        return "stopped"

    try:
        task = asyncio.create_task(settled(loop.run_in_executor(None, polls), stop=stop))
        # One turn of the loop: the task is inside settled() (a task cancelled before its
        # first step never runs its handler, and nothing would tell the thread to stop).
        await asyncio.sleep(0)
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stop.is_set()

        def stuck() -> None:
            release.wait(30)

        future = loop.run_in_executor(None, stuck)
        await outlast(future, timeout_s=0.05)  # returns with the thread still in its call
        assert not future.done()
        release.set()
        await future
    finally:
        stop.set()  # a failed assertion must not leave a thread behind for the loop to join
        release.set()


@pytest.mark.asyncio
async def test_outlast_keeps_waiting_through_cancellations() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()

    async def giving_up() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await outlast(gate)
            raise
        return "not cancelled"

    task = asyncio.create_task(giving_up())
    await asyncio.sleep(0)
    for _ in range(3):
        task.cancel()
        await asyncio.sleep(0)
    assert not task.done()
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task


def test_no_cancellation_handler_in_the_daemon_waits_with_asyncio_wait() -> None:
    """``await asyncio.wait(...)`` inside ``except CancelledError`` ends at a second cancel:
    the handler must use threads.outlast (or settled) instead."""
    found = []
    for path in sorted(DAEMON.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for handler in ast.walk(tree):
            if not isinstance(handler, ast.ExceptHandler) or handler.type is None:
                continue
            if "CancelledError" not in ast.unparse(handler.type):
                continue
            for node in ast.walk(handler):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "asyncio.wait":
                    found.append(f"{path.relative_to(DAEMON)}:{node.lineno}")
    assert found == []
