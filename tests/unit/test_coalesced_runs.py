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
