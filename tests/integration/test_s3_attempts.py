"""A new attempt replacing one whose multipart upload is under way: the old attempt's upload
is aborted (once), nothing of it is left at the destination, and the new attempt commits."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.conftest import DaemonProcess
from tests.integration.faultproxy import ThreadedProxy
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_daemon import get, s3_daemon, uploads

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Any:
    p = ThreadedProxy(seaweedfs.endpoint_url, seed=3, stall_s=5)
    yield p
    p.close()


def test_replacing_an_attempt_mid_upload_leaves_no_upload(make_daemon: Any, seaweedfs: SeaweedFS,
                                                          s3_bucket: str,
                                                          proxy: ThreadedProxy) -> None:
    d: DaemonProcess = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                                 CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1",
                                 CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="8MiB")
    old = os.urandom(1 << 20) * 48  # 6 parts of 8 MiB, about 6 s at the drain's pace
    with d.client().generation("swap", 1, attempt="A1") as gen:
        gen.put("big.bin", old)
    deadline = time.monotonic() + 60
    while not uploads(seaweedfs, s3_bucket):
        assert time.monotonic() < deadline, "the old attempt's upload never started"
        time.sleep(0.05)
    with d.client().generation("swap", 1, attempt="A2") as gen:
        gen.put("big.bin", b"the new attempt")
    d.client().wait("swap", 1, timeout_s=120, attempt="A2")
    assert get(seaweedfs, s3_bucket, f"swap/{1:020d}/big.bin") == b"the new attempt"
    deadline = time.monotonic() + 30
    while uploads(seaweedfs, s3_bucket):
        assert time.monotonic() < deadline, f"left behind: {uploads(seaweedfs, s3_bucket)}"
        time.sleep(0.1)
