"""Requests sent to an S3 worker whose socket is full: many senders wait for room at once,
against scripted workers (the test is the worker, on the real SOCK_SEQPACKET socket, and
decides when it reads).

Found attacking the workers with 400 reads at once (clients' ``latest``) while a worker
started: the event loop keeps one writer callback per fd, so of the senders waiting for room
only the last was woken; the others' sends timed out after 10 s and the healthy worker was
replaced as "a request could not be sent ()", failing 122 of the reads. And a worker lost
while a sender waited for room had its socket closed under that writer callback: uvloop, which
the daemon runs, aborted the process (SIGABRT, no traceback, no stop).
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from typing import Any

import pytest

from ckptdrain.daemon.backends import s3pool
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3pool import WORKER_LOST
from tests.unit.test_s3_pool_give_up import _answer, _receive, _Scripted

# More requests than a SOCK_SEQPACKET socket's send buffer holds (about 280 of these).
MANY = 600


def _params(i: int) -> dict[str, str]:
    return {"Bucket": "bucket", "Key": f"prefix/job/{i:04d}/" + "k" * 400}


async def _filled(pool: _Scripted, operation: str) -> list[asyncio.Future[Any]]:
    """MANY requests of ``operation`` to the pool's one worker, returned once each was sent or
    waits for room: a request is pending before its send's first try, with no await between."""
    await pool.start()
    calls = [asyncio.ensure_future(pool.call(f"request {i}", operation, _params(i)))
             for i in range(MANY)]
    worker = pool.started[0]
    async with asyncio.timeout(30):
        while len(worker.pending) < MANY:
            await asyncio.sleep(0.005)
    return calls


@pytest.mark.asyncio
async def test_every_request_waiting_for_room_is_sent_once_the_worker_reads() -> None:
    pool = _Scripted()
    try:
        calls = await _filled(pool, "head_object")
        end = pool.ends[0]
        seen: set[int] = set()
        # The worker reads every request, each answered as it comes; before, the requests
        # not woken never came (they timed out and went to a replacement).
        while len(seen) < MANY:
            request = await _receive(end)
            seen.add(request["id"])
            _answer(end, {"id": request["id"], "answer": {"ContentLength": 1}})
        answers = await asyncio.gather(*calls)
        assert all(a["ContentLength"] == 1 for a in answers)
        assert len(pool.started) == 1, "a healthy worker was replaced"
    finally:
        await pool.aclose()
        for end in pool.ends:
            end.close()


async def lost_while_senders_wait() -> str:
    """Writes waiting for room when their worker is found lost: what each call got."""
    pool = _Scripted()
    try:
        calls = await _filled(pool, "delete_object")
        pool.started[0].lost("found stopped")
        results = await asyncio.gather(*calls, return_exceptions=True)
        del calls
        gc.collect()  # an answer failed by the loss and never read is reported here
    finally:
        await pool.aclose()
        for end in pool.ends:
            end.close()
    lost = sum(isinstance(r, S3Failure) and r.code == WORKER_LOST and r.transient
               for r in results)
    return f"{lost} of {len(results)} lost"


def test_a_worker_lost_while_senders_wait_for_room_fails_them_under_uvloop() -> None:
    # In a process of its own, under uvloop as the daemon: before, the process aborted.
    run = subprocess.run(
        [sys.executable, "-c", "import uvloop\n"
         "from tests.unit.test_s3_pool_sends import lost_while_senders_wait\n"
         "print(uvloop.run(lost_while_senders_wait()))"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip() == f"{MANY} of {MANY} lost", run.stdout
    assert "never retrieved" not in run.stderr, run.stderr[-2000:]


@pytest.mark.asyncio
async def test_a_worker_still_starting_is_not_replaced_for_the_requests_queued_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found attacking the send bound: a worker reads no request until it has started (its
    imports, botocore's model: START_GRACE_S allows a loaded node 60 s), and a SOCK_SEQPACKET
    socket holds few requests unread (net.unix.max_dgram_qlen, 10 by default). The eleventh
    request queued meanwhile waited for room for SEND_TIMEOUT_S (10 s) and then had the
    starting worker killed as unreachable, its requests failed, and the next start (as
    slow) went the same way, counted as a start that failed. Here the bound is shortened
    and the worker starts slower than it; it must be waited for."""
    monkeypatch.setattr(s3pool, "SEND_TIMEOUT_S", 0.2)
    pool = _Scripted()
    try:
        calls = await _filled(pool, "head_object")
        await asyncio.sleep(1.0)  # the worker still starting: nothing read
        end = pool.ends[0]
        for _ in range(MANY):
            request = await _receive(end)
            _answer(end, {"id": request["id"], "answer": {"ContentLength": 1}})
        answers = await asyncio.gather(*calls)
        assert all(a["ContentLength"] == 1 for a in answers)
        assert len(pool.started) == 1, "a worker still starting was replaced"
    finally:
        await pool.aclose()
        for end in pool.ends:
            end.close()
