"""A multipart upload removed at the destination while this node sends its parts (another
node's orphan sweep after its grace, a lifecycle rule, an operator's abort, or an abort of ours
that timed out here but reached the server) is begun again: a new upload, every part sent
again, and the generation commits exactly the data. One removed every time fails once
drain.retry_budget_s is spent, saying what happened, with nothing left open.

Found reviewing the owed aborts: UploadPart's NoSuchUpload was a permanent ``not_found``, so
the shard and its generation failed ("could not drain") though its staged copy was intact;
only Complete's NoSuchUpload was retried."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ckptdrain.client import GenerationFailed
from tests.conftest import DaemonProcess, wait_for
from tests.integration.faultproxy import ThreadedProxy
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_daemon import PREFIX, _journalled_uploads, get, s3_daemon, uploads
from tests.integration.test_s3_owed_aborts import _journalled_parts, checkpoint

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Iterator[ThreadedProxy]:
    p = ThreadedProxy(seaweedfs.endpoint_url, seed=7, stall_s=5)
    yield p
    p.close()


def slow_daemon(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, *,
                endpoint: str = "", **env: str) -> DaemonProcess:
    """12 parts of 8 MiB, one at a time at 16 MiB/s: 6 s of parts to remove the upload under.
    The daemon's own sweep (grace an hour) is not what removes it."""
    return s3_daemon(make_daemon, "node-a", s3_bucket, endpoint or seaweedfs.endpoint_url,
                     CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1",
                     CKPTDRAIN_DESTINATION__ORPHAN_GRACE_S="3600",
                     CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="16MiB", **env)


def abort_all(seaweedfs: SeaweedFS, s3_bucket: str) -> int:
    """What a hostile sweep (or `aws s3api abort-multipart-upload`) does: abort every upload."""
    client = seaweedfs.client()
    found = uploads(seaweedfs, s3_bucket)
    for upload in found:
        client.abort_multipart_upload(Bucket=s3_bucket, Key=upload["Key"],
                                      UploadId=upload["UploadId"])
    return len(found)


@pytest.mark.parametrize("workers", ["0", "1"])
def test_an_upload_removed_mid_send_is_begun_again_and_commits(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, workers: str) -> None:
    # Parts sent on the daemon's loop, and by an upload worker (its failure comes back coded).
    d = slow_daemon(make_daemon, seaweedfs, s3_bucket, CKPTDRAIN_DRAIN__WORKERS=workers)
    data = checkpoint()
    with d.client().generation("gone", 1) as gen:
        gen.put("big.bin", data)
    wait_for(lambda: _journalled_parts(d) > 0, 60, 0.01, what="a part sent and journalled")
    assert abort_all(seaweedfs, s3_bucket) == 1
    d.client().wait("gone", 1, timeout_s=120)
    assert get(seaweedfs, s3_bucket, f"gone/{1:020d}/big.bin") == data
    assert uploads(seaweedfs, s3_bucket) == []
    assert _journalled_uploads(d) == 0
    log = d.log()
    assert "removed at the destination while it was sent" in log
    assert "event=s3_upload_gone" in log  # the next attempt found it gone, and began anew


@pytest.fixture
def hostile_sweep(seaweedfs: SeaweedFS, s3_bucket: str) -> Iterator[threading.Event]:
    """Aborts every upload under the prefix as soon as it shows (polling), until stopped."""
    stop = threading.Event()

    def sweep() -> None:
        while not stop.wait(0.05):
            abort_all(seaweedfs, s3_bucket)

    thread = threading.Thread(target=sweep, name="hostile-sweep", daemon=True)
    thread.start()
    yield stop
    stop.set()
    thread.join(timeout=10)


def test_an_upload_removed_every_time_fails_within_the_retry_budget(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str,
        hostile_sweep: threading.Event) -> None:
    d = slow_daemon(make_daemon, seaweedfs, s3_bucket, CKPTDRAIN_DRAIN__RETRY_BUDGET_S="5")
    with d.client().generation("gone", 1) as gen:
        gen.put("big.bin", checkpoint())
    with pytest.raises(GenerationFailed, match="removed at the destination while it was sent"
                       ) as failed:
        d.client().wait("gone", 1, timeout_s=120)
    # What to do about it, not "check destination.uri and that the bucket exists".
    assert "orphan_grace_s" in str(failed.value) and "lifecycle" in str(failed.value)
    # Begun again, not given up at the first removal.
    assert d.log().count("event=s3_upload_gone") >= 1
    hostile_sweep.set()
    status = d.client().status()  # the daemon is up and answers
    assert status["generations"][0]["state"] == "failed"
    assert "removed at the destination" in status["generations"][0]["error"]
    # Nothing open: not at the destination, not in the journal (its abort found it gone).
    wait_for(lambda: _journalled_uploads(d) == 0, 60, what="the journalled upload cleared")
    assert uploads(seaweedfs, s3_bucket) == []
    listed = seaweedfs.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/gone/")
    assert not [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith("big.bin")]


def _is_complete(r: Any) -> bool:
    return bool(r.method == "POST" and "uploadId=" in r.target)


@pytest.mark.parametrize("how", ["answer lost", "removed"])
def test_a_complete_that_finds_the_upload_gone(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy,
        how: str) -> None:
    # NoSuchUpload to a Complete that botocore sent again. "answer lost": the first one
    # completed the upload, so the object is there with the ETag its parts make: done, nothing
    # sent again. "removed": the upload was aborted while the Complete was held (5 s, then
    # reset): nothing is there, and a new upload sends every part again.
    d = slow_daemon(make_daemon, seaweedfs, s3_bucket, endpoint=proxy.endpoint_url)
    fault = "drop_response" if how == "answer lost" else "stall"
    proxy.do(lambda: proxy.proxy.inject(fault, match=_is_complete))
    data = checkpoint()
    with d.client().generation("done", 1) as gen:
        gen.put("big.bin", data)
    if how == "removed":
        wait_for(lambda: proxy.do(lambda: proxy.proxy.faults("stall")), 60,
                 what="the Complete held")
        assert abort_all(seaweedfs, s3_bucket) == 1
    d.client().wait("done", 1, timeout_s=120)
    assert get(seaweedfs, s3_bucket, f"done/{1:020d}/big.bin") == data
    assert uploads(seaweedfs, s3_bucket) == []
    assert _journalled_uploads(d) == 0
    parts = proxy.do(lambda: sum(1 for r in proxy.proxy.requests if r.is_upload_part))
    if how == "answer lost":
        assert proxy.do(lambda: proxy.proxy.faults("drop_response"))
        assert parts == 12 and "removed at the destination" not in d.log()
    else:
        assert parts == 24
        assert "removed at the destination before it completed" in d.log()
