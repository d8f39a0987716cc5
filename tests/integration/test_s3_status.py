"""`ckptdrain status` shows the S3 multipart uploads a node has open (what to look for when a
drain seems stuck), against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for
from tests.integration.seaweedfs import SeaweedFS

pytestmark = pytest.mark.s3

MiB = 1 << 20


def test_status_lists_open_multipart_uploads(make_daemon: Any, seaweedfs: SeaweedFS,
                                             s3_bucket: str) -> None:
    d: DaemonProcess = make_daemon(
        dest=f"s3://{s3_bucket}/ckpt",
        CKPTDRAIN_DESTINATION__ENDPOINT_URL=seaweedfs.endpoint_url,
        CKPTDRAIN_DESTINATION__PART_SIZE_BYTES="5MiB",
        CKPTDRAIN_DESTINATION__MULTIPART_THRESHOLD_BYTES="5MiB",
        CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S=str(2 * MiB))
    c = d.client()
    with c.generation("big", 1) as gen:
        gen.put("shard.bin", os.urandom(16 * MiB))  # about 8 s to drain at 2 MiB/s
    wait_for(lambda: c.status()["uploads_open_count"] == 1, timeout_s=30)
    [upload] = c.status()["uploads_open"]
    assert (upload["job"], upload["step"], upload["path"]) == ("big", 1, "shard.bin")
    assert upload["size"] == 16 * MiB and upload["upload_id"] and upload["age_s"] >= 0
    listed = seaweedfs.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert upload["upload_id"] in {u["UploadId"] for u in listed}
    text = subprocess.run([CKPTDRAIN, "status"], env=d.env(), capture_output=True, text=True,
                          timeout=60, check=True).stdout
    assert "multipart uploads open: 1" in text and upload["upload_id"] in text
    c.wait("big", 1, timeout_s=120)
    assert c.status()["uploads_open"] == []
