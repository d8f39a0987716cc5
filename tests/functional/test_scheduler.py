"""Drain order: jobs take turns; within a job, the oldest generation first."""

from __future__ import annotations

import asyncio

import pytest

from ckptdrain.daemon.ledger import ShardRecord
from ckptdrain.daemon.scheduler import FairQueue
from ckptdrain.daemon.state import ShardState


def shard(job: str, step: int, sid: int) -> ShardRecord:
    return ShardRecord(id=sid, job=job, step=step, rank=0, path=f"s{sid}", size=1,
                       staged_name=f"n{sid}", state=ShardState.STAGED, handed_at=0.0, staged_at=0.0)


@pytest.mark.asyncio
async def test_jobs_take_turns_and_old_generations_go_first() -> None:
    q = FairQueue()
    sid = 0
    # job-a has a backlog of two generations; job-b arrives later with one.
    for created, step in ((2.0, 20), (1.0, 10)):
        for _ in range(3):
            sid += 1
            q.put("job-a", (created, sid, sid), shard("job-a", step, sid))
    for _ in range(2):
        sid += 1
        q.put("job-b", (5.0, sid, sid), shard("job-b", 7, sid))
    order = [await q.get() for _ in range(q.qsize())]
    assert [(s.job, s.step) for s in order] == [
        ("job-a", 10), ("job-b", 7), ("job-a", 10), ("job-b", 7),
        ("job-a", 10), ("job-a", 20), ("job-a", 20), ("job-a", 20),
    ]
    assert q.qsize() == 0


@pytest.mark.asyncio
async def test_a_waiting_worker_wakes_on_put() -> None:
    q = FairQueue()
    getter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    assert not getter.done()
    q.put("j", (1.0, 1, 1), shard("j", 1, 1))
    got = await asyncio.wait_for(getter, 5)
    assert got.id == 1
