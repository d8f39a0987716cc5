"""CoalescedRuns: one run per key at a time, and a request during a run is never lost.

The finding: retention after a commit was skipped when a run for the job was under way ("it
will see this commit"), but that run had already listed the job, so after a job's last commit
an old generation stayed at the destination for good."""

from __future__ import annotations

import asyncio

import pytest

from ckptdrain.daemon.locks import CoalescedRuns


@pytest.mark.asyncio
async def test_requests_during_a_run_make_exactly_one_more_run_after_it() -> None:
    runs = CoalescedRuns()
    started: list[int] = []
    gate = asyncio.Event()

    async def work() -> None:
        started.append(len(started))
        if len(started) == 1:
            await gate.wait()  # the first run has "listed" and is still at work

    first = asyncio.create_task(runs.run("job", work))
    while not started:
        await asyncio.sleep(0)
    # Three commits while it runs: none starts a run at once, and none is lost.
    for _ in range(3):
        await asyncio.wait_for(runs.run("job", work), 5)
    assert started == [0] and len(runs) == 1
    gate.set()
    await asyncio.wait_for(first, 5)
    assert started == [0, 1]  # one more run, which began after every request
    assert len(runs) == 0
    # A request once nothing runs is a run of its own.
    await asyncio.wait_for(runs.run("job", work), 5)
    assert started == [0, 1, 2]


@pytest.mark.asyncio
async def test_keys_run_apart_and_a_failing_run_leaves_no_key_behind() -> None:
    runs = CoalescedRuns()
    gate = asyncio.Event()
    done: list[str] = []

    async def slow() -> None:
        await gate.wait()
        done.append("a")

    async def other() -> None:
        done.append("b")

    held = asyncio.create_task(runs.run("a", slow))
    await asyncio.sleep(0)
    await asyncio.wait_for(runs.run("b", other), 5)  # another key is not held up
    assert done == ["b"]
    gate.set()
    await asyncio.wait_for(held, 5)

    async def boom() -> None:
        raise RuntimeError("a bug in the work")

    with pytest.raises(RuntimeError):
        await runs.run("a", boom)
    assert len(runs) == 0
    await asyncio.wait_for(runs.run("a", other), 5)
    assert done == ["b", "a", "b"]


@pytest.mark.asyncio
async def test_runs_of_a_key_start_at_least_the_interval_apart() -> None:
    """A key that asks every few milliseconds gets one run per interval: requests during the
    wait are served by that one run. The clock and the sleep are the test's."""
    now = [100.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds
        await asyncio.sleep(0)

    runs = CoalescedRuns(1.0, clock=lambda: now[0], sleep=sleep)
    started: list[float] = []

    async def work() -> None:
        started.append(now[0])
        now[0] += 0.25  # the run takes a quarter of the interval

    await runs.run("job", work)  # the first run: at once
    now[0] += 0.1
    second = asyncio.create_task(runs.run("job", work))  # 0.35 s after the first began
    await asyncio.sleep(0)
    for _ in range(5):
        await runs.run("job", work)  # while the second waits: served by it
    await asyncio.wait_for(second, 5)
    assert started == [100.0, 101.0] and slept == [pytest.approx(0.65)]
    await runs.run("other", work)  # another key does not wait for this one's interval
    assert started[-1] == 101.25 and len(slept) == 1
    now[0] += 5.0
    await runs.run("job", work)  # long after: at once
    assert len(slept) == 1 and len(started) == 4
