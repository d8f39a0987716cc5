"""An abort that failed while the S3 destination was down is owed: tried again, with backoff,
once the destination answers, well before the orphan sweep's grace (set to an hour here, so
the sweep can never be what removes an upload), also across a kill -9; and never under a
`ckptdrain retry` that resumes the same upload.

Found attacking an S3 outage: a failed generation's abort was tried twice (the failing shard's,
then the generation's end) and, both failing, the upload was left to the orphan sweep, which
skips uploads younger than destination.orphan_grace_s (an hour by default)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckptdrain.client import GenerationFailed
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for
from tests.integration.faultproxy import ThreadedProxy
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_daemon import _journalled_uploads, get, s3_daemon, uploads

pytestmark = pytest.mark.s3


def checkpoint() -> bytes:
    return os.urandom(1 << 20) * 96  # 12 parts of 8 MiB, drained in 6 s (16 MiB/s)


# Well under orphan_grace_s (3600 here): the owed abort's, not the sweep's.
GONE_WITHIN_S = 45.0


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Iterator[ThreadedProxy]:
    p = ThreadedProxy(seaweedfs.endpoint_url, seed=7, stall_s=5)
    yield p
    p.close()


def _is_abort(r: Any) -> bool:
    return bool(r.method == "DELETE" and "uploadId=" in r.target)


def failed_with_its_abort_owed(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str,
                               proxy: ThreadedProxy, data: bytes) -> DaemonProcess:
    """A daemon whose generation ("owed", 1) failed in an outage that is still on, every abort
    of its upload failed (both the failing shard's and the generation's end's, logged), and
    the upload still open at the destination."""
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="2",
                  CKPTDRAIN_DESTINATION__CONNECT_TIMEOUT_S="1",
                  CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1",
                  CKPTDRAIN_DESTINATION__ORPHAN_GRACE_S="3600",
                  CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="16MiB",
                  CKPTDRAIN_DRAIN__RETRY_BUDGET_S="3")
    with d.client().generation("owed", 1) as gen:
        gen.put("big.bin", data)
    # Down once a part is sent and journalled: a retry then resumes the upload (ListParts)
    # rather than beginning another.
    wait_for(lambda: _journalled_parts(d) > 0, 60, 0.01, what="a part sent and journalled")
    proxy.do(lambda: setattr(proxy.proxy, "unreachable", True))
    with pytest.raises(GenerationFailed, match="could not drain"):
        d.client().wait("owed", 1, timeout_s=120)
    # The failing shard's abort and the generation's end's: both tried in the outage.
    wait_for(lambda: d.log().count("event=s3_abort_failed") >= 2, 60,
             what="the failed generation's aborts tried (and failed) in the outage")
    assert len(uploads(seaweedfs, s3_bucket)) == 1
    assert _journalled_uploads(d) == 1
    return d


def _journalled_parts(d: DaemonProcess) -> int:
    with contextlib.closing(sqlite3.connect(d.staging / "journal.sqlite3", timeout=10)) as db:
        return int(db.execute("SELECT COUNT(*) FROM upload_parts").fetchone()[0])


def gone(seaweedfs: SeaweedFS, s3_bucket: str, d: DaemonProcess, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while uploads(seaweedfs, s3_bucket) or _journalled_uploads(d):
        assert time.monotonic() < deadline, (
            f"upload still open {within_s:g} s after the destination came back: "
            f"{uploads(seaweedfs, s3_bucket)}")
        time.sleep(0.2)


def test_an_abort_failed_in_an_outage_is_done_once_the_destination_answers(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    d = failed_with_its_abort_owed(make_daemon, seaweedfs, s3_bucket, proxy,
                                   checkpoint())
    proxy.do(lambda: setattr(proxy.proxy, "unreachable", False))
    gone(seaweedfs, s3_bucket, d, GONE_WITHIN_S)
    assert "event=owed_abort_done" in d.log()
    # The local copy is still kept for `ckptdrain retry`.
    assert d.client().status()["generations"][0]["state"] == "failed"


@pytest.mark.parametrize("when", ["owed", "in-flight"])
def test_a_retry_as_the_destination_comes_back_commits_and_leaves_no_upload(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy,
        when: str) -> None:
    # The retry resumes the journalled upload (ListParts) that an owed abort is about to
    # abort, or is aborting: the abort must not land under the resumed upload (its parts then
    # got NoSuchUpload, a permanent failure), and what is left must commit exactly the data.
    data = checkpoint()
    d = failed_with_its_abort_owed(make_daemon, seaweedfs, s3_bucket, proxy, data)
    if when == "in-flight":
        # The owed abort's first DELETE is held (5 s, then reset; botocore sends it again)
        # and the retry comes while it is.
        proxy.do(lambda: proxy.proxy.inject("stall", match=_is_abort))
    proxy.do(lambda: setattr(proxy.proxy, "unreachable", False))
    if when == "in-flight":
        wait_for(lambda: proxy.do(lambda: proxy.proxy.faults("stall")), 60,
                 what="the owed abort in flight")
    out = subprocess.run([CKPTDRAIN, "retry", "owed", "1", "--socket", str(d.socket_path)],
                         env=d.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d.client().wait("owed", 1, timeout_s=120)
    assert get(seaweedfs, s3_bucket, f"owed/{1:020d}/big.bin") == data
    gone(seaweedfs, s3_bucket, d, GONE_WITHIN_S)


def test_an_abort_owed_across_a_kill_is_done_once_the_destination_answers(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Killed while the abort was owed, and started again while the destination is still
    # down: the start's abort fails too, and is owed again (the journal still names the
    # upload), not left to the sweep.
    d = failed_with_its_abort_owed(make_daemon, seaweedfs, s3_bucket, proxy,
                                   checkpoint())
    d.kill()
    d.start()
    wait_for(lambda: "event=s3_abort_failed" in d.log(), 60,
             what="the start's abort tried (and failed) in the outage")
    assert len(uploads(seaweedfs, s3_bucket)) == 1
    proxy.do(lambda: setattr(proxy.proxy, "unreachable", False))
    gone(seaweedfs, s3_bucket, d, GONE_WITHIN_S)
    assert d.client().status()["generations"][0]["state"] == "failed"


def test_a_new_attempt_at_the_step_begins_without_waiting_for_the_owed_abort(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking: the job restarted and saved the failed step again while the
    # destination answered nothing; the begin replacing the failed attempt tried its owed
    # abort itself, under the step's begin lock (the cleanup timeout per failed shard, on top
    # of the begin's committed check): the hand-off waited out the outage's timeouts. The
    # abort stays owed, tried by the daemon, and done once the destination answers.
    d = failed_with_its_abort_owed(make_daemon, seaweedfs, s3_bucket, proxy, checkpoint())

    def answer_nothing() -> None:
        proxy.proxy.unreachable = False
        proxy.proxy.set_rates(stall=1.0)

    proxy.do(answer_nothing)
    started = time.monotonic()
    with d.client().generation("owed", 1, attempt="second") as gen:
        begun = time.monotonic() - started
        gen.put("small.bin", b"x" * 1024)
    # The committed check's 5 s, and no abort try (2 x (1 s + 5 s) at least).
    assert begun < 9, f"the new attempt's begin took {begun:.1f} s"
    proxy.do(lambda: proxy.proxy.set_rates())
    d.client().wait("owed", 1, timeout_s=120)
    gone(seaweedfs, s3_bucket, d, GONE_WITHIN_S)
    assert get(seaweedfs, s3_bucket, f"owed/{1:020d}/small.bin") == b"x" * 1024


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_an_abort_owed_for_a_replaced_attempt_is_done_after_a_restart(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy,
        how: str) -> None:
    # Found attacking: the failed attempt was replaced by a new one (forgotten, its journal
    # rows with it, the upload's among them) while its abort was owed; after a restart
    # nothing owed it any more, and the upload stayed open for the orphan sweep's grace.
    d = failed_with_its_abort_owed(make_daemon, seaweedfs, s3_bucket, proxy, checkpoint())
    with d.client().generation("owed", 1, attempt="second") as gen:
        gen.put("small.bin", b"x" * 1024)
    if how == "stop":
        d.stop(60)
    else:
        d.kill()
    proxy.do(lambda: setattr(proxy.proxy, "unreachable", False))
    d.start()
    d.client().wait("owed", 1, timeout_s=120)
    gone(seaweedfs, s3_bucket, d, GONE_WITHIN_S)
    with contextlib.closing(sqlite3.connect(d.staging / "journal.sqlite3", timeout=10)) as db:
        assert db.execute("SELECT COUNT(*) FROM owed_aborts").fetchone()[0] == 0


def test_an_attempt_replaced_mid_drain_leaves_no_upload_behind(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found reviewing the owed aborts: a new attempt at the step replaced one whose shard was
    # mid-multipart. The end cancelled the copy, whose abort (the destination slow to answer
    # it) came after the replace had forgotten the old attempt, its journal rows with it: it
    # found nothing journalled, nothing was owed, and the upload stayed open for the orphan
    # sweep's grace. Every upload still journalled is owed before the rows go.
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="2",
                  CKPTDRAIN_DESTINATION__CONNECT_TIMEOUT_S="1",
                  CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1",
                  CKPTDRAIN_DESTINATION__ORPHAN_GRACE_S="3600",
                  CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="16MiB")
    with d.client().generation("owed", 1) as gen:
        gen.put("big.bin", checkpoint())
    wait_for(lambda: _journalled_parts(d) > 0, 60, 0.01, what="a part sent and journalled")
    # Every abort held (5 s, then reset) until the end of the test's outage: the cancelled
    # copy's own abort fails, and slowly, well after the replace forgot the old attempt.
    proxy.do(lambda: proxy.proxy.inject("stall", times=1000, match=_is_abort))
    data = b"x" * 1024
    with d.client().generation("owed", 1, attempt="second") as second:
        second.put("small.bin", data)
    d.client().wait("owed", 1, timeout_s=120)
    assert len(uploads(seaweedfs, s3_bucket)) == 1  # the old attempt's, mid-multipart
    wait_for(lambda: d.log().count("event=s3_abort_failed") >= 1, 60,
             what="the cancelled copy's abort tried (and failed) while held")
    proxy.do(lambda: proxy.proxy._script.clear())
    gone(seaweedfs, s3_bucket, d, GONE_WITHIN_S)
    assert get(seaweedfs, s3_bucket, f"owed/{1:020d}/small.bin") == data
    wait_for(lambda: _owed_rows(d) == 0, 10, what="the owed abort's journal row dropped")


def _owed_rows(d: DaemonProcess) -> int:
    with contextlib.closing(sqlite3.connect(d.staging / "journal.sqlite3", timeout=10)) as db:
        return int(db.execute("SELECT COUNT(*) FROM owed_aborts").fetchone()[0])
