"""An S3 worker pool whose workers exit before they start (a broken installation, a memory
limit too low to start in), with real processes that do exactly that.

Found attacking the upload workers: such a worker was started again for every request and
every retry of every shard (83 starts in 30 s for one generation of a two-worker daemon), and
each request failed saying "its socket failed ([Errno 104] Connection reset by peer)", which
points at the network, not at a worker that cannot start.
"""

from __future__ import annotations

import logging
import shutil
import sys
from types import SimpleNamespace
from typing import cast

import pytest

from ckptdrain.daemon.backends import s3procs
from ckptdrain.daemon.backends.s3client import S3Client
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3pool import WORKER_LOST, WorkerSenders
from ckptdrain.daemon.backends.s3senders import Part
from ckptdrain.daemon.config import DestinationConfig

# An endpoint nothing listens on: no request here gets as far as a server.
CONFIG = DestinationConfig(uri="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9",
                           region="us-east-1", addressing_style="path")
HEAD = {"Bucket": "bucket", "Key": "prefix/job/LATEST"}


@pytest.mark.asyncio
async def test_a_worker_that_exits_at_start_is_not_started_again_at_every_request(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Every worker this pool starts is `false ...`: it exits at once, status 1, unread.
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    # Long enough that no slot's wait ends during the test, however slow the machine.
    monkeypatch.setattr(s3procs, "RESTART_BACKOFF_FIRST_S", 3600.0)
    caplog.set_level(logging.INFO, logger="ckptdrain.daemon.backends")
    pool = WorkerSenders(cast(S3Client, SimpleNamespace(cleanup_timeout_s=5.0)), CONFIG, "n", 1)
    try:
        # A read is sent once more to a fresh worker when its worker is lost: two starts,
        # the first failure's restart at once (one failed start may be an accident).
        with pytest.raises(S3Failure) as first:
            await pool.call("reading LATEST", "head_object", HEAD)
        assert first.value.transient and first.value.code == WORKER_LOST
        assert "Connection reset" not in str(first.value), first.value
        # Its second failed start in a row: the slot waits, and a request says why at once
        # instead of starting a third worker.
        with pytest.raises(S3Failure) as waiting:
            await pool.call("reading LATEST", "head_object", HEAD)
        said = str(waiting.value)
        assert waiting.value.transient
        assert "worker 0 exited before it started, 2 times in a row" in said, said
        assert "journalctl -u ckptdrain" in said and "drain.workers = 0" in said, said
        # So does a part: nothing is sent (the fd is never read) and no worker starts.
        with pytest.raises(S3Failure, match="2 times in a row"):
            await pool.send(Part(key="k", full="prefix/k", upload_id="u", number=1, offset=0,
                                 length=1), -1)
    finally:
        await pool.aclose()
    events = [r.getMessage() for r in caplog.records]
    assert sum("event=s3_worker_started" in m for m in events) == 2, events
    assert sum("event=s3_worker_restart_delayed" in m for m in events) == 1, events
    assert not any("Connection reset" in m for m in events), events


def test_a_slot_whose_workers_never_start_keeps_waiting_the_most_however_long_it_fails() -> None:
    """Found attacking the restart backoff: the wait doubled as a float product of 2 **
    (failed starts - 2), which past 1,025 failed starts in a row (about 8.5 hours of a
    broken worker at the 30 s most) raised OverflowError out of the pool's worker lookup, an
    untyped error in place of its S3Failure, for every request from then on."""
    restarts = s3procs.Restarts(1, "upload")
    worker = cast(s3procs.WorkerProcess, SimpleNamespace(
        index=0, ready=False, why=s3procs.EXITED_EARLY, ended=lambda: "exit status 1"))
    for _ in range(1100):
        restarts.lost(worker)
    assert not restarts.may_start(0)
    said = str(restarts.failure())
    assert "1100 times in a row" in said, said
