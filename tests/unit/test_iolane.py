"""The data plane's lane of threads (daemon/iolane.py): every call runs in one of at most
``threads`` threads, its result or exception reaches its caller, a call that outlives the
limit fails its caller and hands what it made to ``late`` once it returns, results that
finish together wake the loop once, and a closed lane drops what it had not started."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from ckptdrain.daemon.iolane import IoLane, LaneTimeout


def _wait_until(check: object, what: str, timeout_s: float = 10.0) -> None:
    """Block (the loop too: that is the point where it is used) until ``check()``."""
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


@contextlib.contextmanager
def _opened(threads: int, limit_s: float, *gates: threading.Event) -> Iterator[IoLane]:
    """A lane for one test; on the way out its ``gates`` are opened (no thread is left
    waiting on one) and the lane is closed."""
    lane = IoLane(threads, "test-lane", limit_s)
    try:
        yield lane
    finally:
        for gate in gates:
            gate.set()
        lane.close()


@pytest.mark.asyncio
async def test_calls_run_in_at_most_the_lanes_threads_and_return_their_own_results() -> None:
    seen: set[str] = set()
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            seen.add(threading.current_thread().name)
        time.sleep(0.001)
        return i * i

    with _opened(3, 10.0) as lane:
        jobs = [lane.submit(work, (i,)) for i in range(60)]
        results = await asyncio.gather(*(job.waiter for job in jobs))
    assert results == [i * i for i in range(60)]
    assert seen and len(seen) <= 3
    assert all(name.startswith("test-lane_") for name in seen)
    assert threading.current_thread().name not in seen  # never the loop's thread


@pytest.mark.asyncio
async def test_an_exception_reaches_its_caller_and_the_thread_goes_on() -> None:

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with _opened(1, 10.0) as lane:
        with pytest.raises(OSError, match="No space left"):
            await lane.submit(fail, ()).waiter
        assert await lane.submit(len, ("four",)).waiter == 4


@pytest.mark.asyncio
async def test_results_that_finish_together_wake_the_loop_once() -> None:
    # The point of the lane: a busy loop settles every call that returned meanwhile in one
    # wake-up, where the executor posted one callback (and one write to the loop's wake-up
    # fd) per result.
    go = threading.Event()
    with _opened(8, 10.0, go) as lane:
        jobs = [lane.submit(go.wait, (10.0,)) for _ in range(8)]
        await asyncio.sleep(0)
        before = lane.wakeups
        go.set()
        # The loop is held here until every thread has returned and posted its result.
        _wait_until(lambda: len(lane._done) == 8, "the 8 results")
        assert all(await asyncio.gather(*(job.waiter for job in jobs)))
        assert lane.wakeups - before == 1


@pytest.mark.asyncio
async def test_a_call_past_the_limit_fails_its_caller_and_hands_its_result_to_late() -> None:
    gate = threading.Event()
    handed: list[tuple[object, object]] = []
    with _opened(2, 0.05, gate) as lane:
        job = lane.submit(lambda: gate.wait(10.0) and "made late", ())
        with pytest.raises(LaneTimeout):
            await job.waiter
        assert not job.finished
        job.late = lambda result, error: handed.append((result, error))
        gate.set()
        while not handed:
            await asyncio.sleep(0.01)
        assert handed == [("made late", None)] and job.finished


@pytest.mark.asyncio
async def test_a_closed_lane_cancels_what_it_had_not_started_and_takes_no_more() -> None:
    lane = IoLane(1, "test-lane", 10.0)
    gate = threading.Event()
    try:
        running = lane.submit(gate.wait, (10.0,))
        queued = lane.submit(len, ("never",))
        _wait_until(lambda: lane._queue.qsize() == 1, "the first call to start")
        lane.close()
        assert queued.waiter.cancelled() and queued.finished
        with pytest.raises(RuntimeError, match="closed"):
            lane.submit(len, ("refused",))
        gate.set()
        assert await running.waiter is True  # a running call still ends normally
    finally:
        gate.set()


@pytest.mark.asyncio
async def test_a_late_callback_that_raises_keeps_no_other_result_from_its_caller() -> None:
    # Found attacking the lane: results are settled in batches, and a ``late`` that raised
    # (a cleanup whose close failed) ended the batch, every result after it left unsettled:
    # its caller failed as stuck though its call had returned.
    first_gate, second_gate = threading.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    def fail(result: object, error: object) -> None:
        raise OSError(5, "Input/output error")

    try:
        with _opened(2, 0.05, first_gate, second_gate) as lane:
            first = lane.submit(first_gate.wait, (10.0,))
            with pytest.raises(LaneTimeout):
                await first.waiter
            first.late = fail
            lane.limit_s = 10.0
            second = lane.submit(second_gate.wait, (10.0,))
            await asyncio.sleep(0)
            first_gate.set()
            _wait_until(lambda: len(lane._done) == 1, "the first result")
            second_gate.set()
            # The loop is held here until both are posted: they settle in one batch, in order.
            _wait_until(lambda: len(lane._done) == 2, "the second result")
            assert await asyncio.wait_for(second.waiter, 5.0) is True
            assert [type(c["exception"]) for c in reported] == [OSError]
    finally:
        loop.set_exception_handler(None)


@pytest.mark.asyncio
async def test_a_call_that_raises_stopiteration_fails_its_caller() -> None:
    # Found attacking the lane: a future refuses a StopIteration, so its settle raised
    # TypeError, its timer already cancelled: the caller waited forever (and the results
    # settled after it in the batch were stranded).
    with _opened(1, 10.0) as lane:
        job = lane.submit(next, (iter(()),))
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(job.waiter, 5.0)
        assert await lane.submit(len, ("four",)).waiter == 4
