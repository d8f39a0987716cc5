"""Answers that are no S3 server's (a web server, a proxy or a load balancer answering 200 with
a page in the S3 server's place) are never taken for a write that landed or for what a key
holds, against a real S3 server (SeaweedFS) behind the fault proxy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.faultproxy import ProxiedRequest, ThreadedProxy
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_daemon import get, s3_daemon, uploads

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Iterator[ThreadedProxy]:
    p = ThreadedProxy(seaweedfs.endpoint_url, seed=7, stall_s=5)
    yield p
    p.close()


def test_a_put_answered_with_a_web_page_is_sent_again_not_taken_as_drained(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking the S3 drain: a PutObject answered 200 with an HTML page (no ETag) was
    # taken as the shard drained, its local copy went, and the generation could never commit
    # ("drained ... are missing at the destination; their local copies are gone too").
    def shard_put(r: ProxiedRequest) -> bool:
        return r.method == "PUT" and r.target.split("?")[0].endswith("/a.bin")

    proxy.do(lambda: proxy.proxy.inject("web_page", match=shard_put))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    data = {"a.bin": os.urandom(1 << 20), "b.bin": os.urandom(1 << 20)}
    with d.client().generation("page", 1) as gen:
        for path, blob in data.items():
            gen.put(path, blob)
    d.client().wait("page", 1, timeout_s=120)
    assert proxy.do(lambda: len(proxy.proxy.faults("web_page"))) == 1
    for path, blob in data.items():
        assert get(seaweedfs, s3_bucket, f"page/{1:020d}/{path}") == blob
    assert "without an ETag" in d.log()


def test_a_manifest_read_answered_with_a_web_page_is_no_damaged_manifest(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found with the above: the begin's check of the step's MANIFEST.json, answered with a web
    # page twice, refused the save for good (AlreadyCommitted: "a damaged MANIFEST.json ...
    # nothing may overwrite it"). Not an S3 answer, it is a read that failed.
    proxy.do(lambda: proxy.proxy.inject(
        "web_page", times=2,
        match=lambda r: r.method == "GET" and "MANIFEST.json" in r.target))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    blob = os.urandom(20 << 20)  # multipart (8 MiB parts)
    with d.client().generation("page", 1) as gen:
        gen.put("big.bin", blob)
    d.client().wait("page", 1, timeout_s=120)
    assert proxy.do(lambda: len(proxy.proxy.faults("web_page"))) >= 1
    assert get(seaweedfs, s3_bucket, f"page/{1:020d}/big.bin") == blob
    assert uploads(seaweedfs, s3_bucket) == []
