"""`ckptdrain status` shows the S3 multipart uploads a node has open (what to look for when a
drain seems stuck), against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
import signal
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


def test_status_shows_a_drain_whose_destination_stopped_answering(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    # Found attacking the S3 drain: with the server stopped (SIGSTOP), status said nothing was
    # wrong until a request timed out (read_timeout_s, 120 s by default): a shard draining
    # with its progress unchanged looked the same as one being copied.
    d: DaemonProcess = make_daemon(
        dest=f"s3://{s3_bucket}/ckpt",
        CKPTDRAIN_DESTINATION__ENDPOINT_URL=seaweedfs.endpoint_url,
        # Asked at the destination before the first shard is written, it would wait there.
        CKPTDRAIN_ACCESS__CHECK_DESTINATION_OWNER="false")
    c = d.client()
    with c.generation("warm", 1) as gen:  # the upload workers connected, the bucket known
        gen.put("w", b"w")
    c.wait("warm", 1, timeout_s=60)
    os.kill(seaweedfs.pid, signal.SIGSTOP)
    try:
        with c.generation("hung", 1) as gen:
            gen.put("shard.bin", os.urandom(MiB))

        def idle() -> float:
            found = [s for s in c.status()["shards_draining"] if s["job"] == "hung"]
            return float(found[0]["idle_s"]) if found else -1.0

        first = idle()
        wait_for(lambda: idle() > max(first, 1.0), timeout_s=60)
        [shard] = c.status()["shards_draining"]
        assert (shard["path"], shard["size"], shard["drained_bytes"]) == ("shard.bin", MiB, 0)
        text = subprocess.run([CKPTDRAIN, "status"], env=d.env(), capture_output=True,
                              text=True, timeout=60, check=True).stdout
        assert "draining now" in text and "hung 1 shard.bin: 0 B of 1.0 MiB, last progress" in text
    finally:
        os.kill(seaweedfs.pid, signal.SIGCONT)
    c.wait("hung", 1, timeout_s=120)  # the server back: the same copy goes on
    assert c.status()["shards_draining"] == []
