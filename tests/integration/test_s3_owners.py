"""A job's owner read from an S3 destination (owners.py against SeaweedFS): a node that never
ran the job refuses it to another uid, and serves its owner."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.conftest import DaemonProcess
from tests.functional.test_job_takeover import (
    ACCESS,
    HOSTILE,
    VICTIM,
    fetch,
    latest,
    open_to_all,
    run_as,
    save,
    writable_by_all,
)
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_daemon import s3_daemon

pytestmark = [pytest.mark.s3,
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="dropping to another uid needs root (CI runs as root)")]


def test_an_s3_jobs_owner_is_read_from_its_newest_commit(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    node_a: DaemonProcess = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url,
                                      **ACCESS)
    node_b: DaemonProcess = s3_daemon(make_daemon, "node-b", s3_bucket, seaweedfs.endpoint_url,
                                      **ACCESS)
    open_to_all(node_a, node_b)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    into = writable_by_all(node_b)
    for attempt in (lambda: latest(node_b, "llama"), lambda: fetch(node_b, "llama", 1, into),
                    lambda: save(node_b, "llama", 2, b"poison")):
        out = run_as(HOSTILE, attempt)
        assert out.startswith("DENIED") and "belongs to another user" in out, out
    assert into.read_bytes() == b""
    assert run_as(VICTIM, lambda: save(node_b, "llama", 2, b"victim-2")) == "SAVED"
    assert node_a.client().latest("llama") == 2
