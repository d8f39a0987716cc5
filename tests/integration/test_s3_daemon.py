"""The daemon draining to a real S3 server (SeaweedFS): same layout and commit protocol as
file://, multipart with resumable uploads, retries through faults, aborts, orphan sweeps."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import GenerationFailed
from ckptdrain.client.manifest import Manifest
from ckptdrain.daemon.checksums import of_bytes
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for
from tests.integration.faultproxy import ThreadedProxy
from tests.integration.seaweedfs import SeaweedFS

pytestmark = pytest.mark.s3

PREFIX = "ckpt"


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Iterator[ThreadedProxy]:
    p = ThreadedProxy(seaweedfs.endpoint_url, seed=7, stall_s=5)
    yield p
    p.close()


def s3_daemon(make_daemon: Any, node: str, bucket: str, endpoint: str, **env: str) -> DaemonProcess:
    settings = {
        "CKPTDRAIN_DESTINATION__ENDPOINT_URL": endpoint,
        "CKPTDRAIN_DESTINATION__PART_SIZE_BYTES": "8MiB",
        "CKPTDRAIN_DESTINATION__MULTIPART_THRESHOLD_BYTES": "8MiB",
        "CKPTDRAIN_DESTINATION__MAX_CONCURRENCY": "4",
    } | env
    return make_daemon(node, dest=f"s3://{bucket}/{PREFIX}", **settings)  # type: ignore[no-any-return]


def _journalled_uploads(d: DaemonProcess) -> int:
    with contextlib.closing(sqlite3.connect(d.staging / "journal.sqlite3", timeout=10)) as db:
        return int(db.execute("SELECT COUNT(*) FROM uploads").fetchone()[0])


def uploads(server: SeaweedFS, bucket: str) -> list[dict[str, Any]]:
    return list(server.client().list_multipart_uploads(Bucket=bucket, Prefix=PREFIX).get("Uploads", []))


def get(server: SeaweedFS, bucket: str, key: str) -> bytes:
    return server.client().get_object(Bucket=bucket, Key=f"{PREFIX}/{key}")["Body"].read()  # type: ignore[no-any-return]


def test_round_trip_three_ranks_multipart(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, tmp_path: Path) -> None:
    d = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url)
    sizes = {"tiny": 1 << 10, "small": 7 << 20, "medium": 40 << 20, "large": 130 << 20}
    blobs: dict[str, bytes] = {}
    for rank in range(3):
        with d.client(timeout_s=300).generation("s3job", 10, rank=rank, world_size=3) as gen:
            for name, size in sizes.items():
                data = os.urandom(size) if name != "large" else os.urandom(1 << 20) * 130
                blobs[f"r{rank}/{name}.bin"] = data
                gen.put(f"r{rank}/{name}.bin", data)
    d.client().wait("s3job", 10, timeout_s=300)
    manifest = Manifest.from_json(get(seaweedfs, s3_bucket, f"s3job/{10:020d}/MANIFEST.json"))
    assert {s.path for s in manifest.shards} == set(blobs)
    for shard in manifest.shards:
        assert shard.checksum == of_bytes(blobs[shard.path])
    assert get(seaweedfs, s3_bucket, f"s3job/{10:020d}/r1/large.bin") == blobs["r1/large.bin"]
    assert uploads(seaweedfs, s3_bucket) == []
    env = d.env()
    dest = f"s3://{s3_bucket}/{PREFIX}"
    out = subprocess.run([CKPTDRAIN, "ls", dest, "--json"], env=env, capture_output=True, text=True, check=True)
    assert [r["generation"] for r in json.loads(out.stdout)] == [10]
    out = subprocess.run([CKPTDRAIN, "verify", dest, "--job", "s3job"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    restored = tmp_path / "restored"
    out = subprocess.run([CKPTDRAIN, "restore", dest, "--job", "s3job", "--to", str(restored)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (restored / "r2" / "medium.bin").read_bytes() == blobs["r2/medium.bin"]
    assert "12 from this node's local copy" in out.stdout
    from_s3 = tmp_path / "from-s3"
    out = subprocess.run([CKPTDRAIN, "restore", dest, "--job", "s3job", "--to", str(from_s3), "--no-local"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for path, data in blobs.items():
        assert (from_s3 / path).read_bytes() == data == (restored / path).read_bytes()


def test_commits_through_twenty_percent_faults(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str,
                                               proxy: ThreadedProxy) -> None:
    proxy.do(lambda: proxy.proxy.set_rates(reset=0.1, slowdown=0.1))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="3")
    blobs = {f"s{i}": os.urandom((3 + 7 * i) << 20) for i in range(4)}
    with d.client().generation("faulty", 1) as gen:
        for path, data in blobs.items():
            gen.put(path, data)
    d.client().wait("faulty", 1, timeout_s=240)
    faults = proxy.do(lambda: len(proxy.proxy.faults()))
    assert faults > 0, "the proxy injected nothing: the test proved nothing"
    for path, data in blobs.items():
        assert get(seaweedfs, s3_bucket, f"faulty/{1:020d}/{path}") == data
    assert uploads(seaweedfs, s3_bucket) == []


def daemon_behind_a_part_listing_fault(make_daemon: Any, s3_bucket: str, proxy: ThreadedProxy,
                                       fault: str) -> DaemonProcess:
    """A daemon (commit_wait_s = 3) whose every listing of part records gets ``fault``."""
    proxy.do(lambda: proxy.proxy.inject(
        fault, times=1_000_000,
        match=lambda r: r.method == "GET" and "list-type=2" in r.target and "_parts" in r.target))
    return s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                     CKPTDRAIN_DRAIN__COMMIT_WAIT_S="3")


def test_a_listing_without_end_ends_the_generation_at_commit_wait_s(
        make_daemon: Any, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking the paging check: new keys on every page never looked stalled, and the
    # commit's poll read them for good, past commit_wait_s (and held every other generation
    # the poller waits on). A poll's read of the part records is bounded now.
    d = daemon_behind_a_part_listing_fault(make_daemon, s3_bucket, proxy, "growing_listing")
    jobs = [f"grown{i}" for i in range(4)]
    for job in jobs:
        with d.client().generation(job, 1) as gen:
            gen.put("a.bin", os.urandom(1 << 20))
    # Attacking the bound: polled one after another, each read taking its 3 s (the wait's),
    # the four ended 3 s apart (the last ~12 s late); polled together, all four end about
    # 9 s in here (a read at the record, one at the poll, the hand-offs). One after another
    # would take 15 s or more.
    deadline = time.monotonic() + 14
    for job in jobs:
        with pytest.raises(GenerationFailed, match=r"part records .* took more than 3 s"):
            d.client().wait(job, 1, timeout_s=max(0.1, deadline - time.monotonic()))
    assert d.proc is not None and d.proc.poll() is None


def test_a_listing_that_never_advances_ends_the_generation_at_commit_wait_s(
        make_daemon: Any, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking a misbehaving server: a part-record listing answered "truncated" with
    # the same token every time held the commit in that loop for good (the generation never
    # ended, past commit_wait_s, and the workers sent ~640 requests a second). The listing
    # now fails when a token comes back, and the commit's wait ends the generation.
    d = daemon_behind_a_part_listing_fault(make_daemon, s3_bucket, proxy, "stuck_listing")
    with d.client().generation("paged", 1) as gen:
        gen.put("a.bin", os.urandom(1 << 20))
    with pytest.raises(GenerationFailed, match="commit_wait_s"):
        d.client().wait("paged", 1, timeout_s=60)
    listed = proxy.do(lambda: len(proxy.proxy.faults("stuck_listing")))
    assert 0 < listed < 200, listed  # tried again at the commit's pace, not in a tight loop
    assert "did not advance" in d.log()
    assert d.proc is not None and d.proc.poll() is None


def test_unreachable_past_retry_budget_fails_and_leaves_no_upload(make_daemon: Any, seaweedfs: SeaweedFS,
                                                                  s3_bucket: str, proxy: ThreadedProxy) -> None:
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="2",
                  CKPTDRAIN_DESTINATION__CONNECT_TIMEOUT_S="1",
                  CKPTDRAIN_DRAIN__RETRY_BUDGET_S="3")
    with d.client().generation("gone", 1) as gen:
        # Counted from here, past the begin's own questions to the destination (how many
        # they are is the begin's business): reachable for the drain's owner lookup, the
        # upload's create and its first part, then gone: the upload exists server-side.
        proxy.do(lambda: proxy.proxy.unreachable_after(3))
        gen.put("big.bin", os.urandom(40 << 20))
    with pytest.raises(GenerationFailed, match="could not drain"):
        d.client().wait("gone", 1, timeout_s=120)
    status = d.client().status()
    assert status["generations"][0]["state"] == "failed"
    assert "big.bin" in status["generations"][0]["error"]
    # Reachable again: the failed generation's upload is aborted, nothing is left behind.
    proxy.do(lambda: setattr(proxy.proxy, "unreachable", False))
    deadline = time.monotonic() + 60
    while uploads(seaweedfs, s3_bucket):
        assert time.monotonic() < deadline, uploads(seaweedfs, s3_bucket)
        time.sleep(0.5)
    # The local copy is kept: `ckptdrain retry` drains it again and the generation commits.
    out = subprocess.run([CKPTDRAIN, "retry", "gone", "1", "--socket", str(d.socket_path)], env=d.env(),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    d.client().wait("gone", 1, timeout_s=120)


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_a_restart_mid_multipart_resumes(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str,
                                         proxy: ThreadedProxy, how: str) -> None:
    # SIGTERM: found attacking an S3 outage. A graceful stop cancelled the upload, and the
    # cancellation aborted it, so a restart (an upgrade) sent every part again; a kill -9
    # kept it. A stopping daemon leaves a journalled upload to the next start now.
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1",
                  CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="16MiB")
    data = os.urandom(1 << 20) * 96  # 12 parts of 8 MiB
    with d.client().generation("resume", 1) as gen:
        gen.put("big.bin", data)

    def parts_sent() -> int:
        return proxy.do(lambda: sum(1 for r in proxy.proxy.requests if r.is_upload_part and r.fault is None))

    deadline = time.monotonic() + 120
    while parts_sent() < 5:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if how == "kill -9":
        d.kill()
    else:
        assert d.stop() == 0
    before = parts_sent()
    assert uploads(seaweedfs, s3_bucket), "the upload should still be there after the stop"
    d.start()
    d.client().wait("resume", 1, timeout_s=180)
    resent = parts_sent() - before
    assert resent < 12, f"{resent} parts sent after the restart: the upload did not resume"
    assert get(seaweedfs, s3_bucket, f"resume/{1:020d}/big.bin") == data
    assert uploads(seaweedfs, s3_bucket) == []


def test_an_upload_a_restart_with_a_larger_threshold_leaves_unfinished_is_aborted(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking the S3 drain: killed mid-multipart and restarted with a larger
    # multipart_threshold_bytes, the shard went up as one PutObject and the generation
    # committed, but the upload journalled before the kill stayed open until the orphan
    # sweep's grace (an hour by default).
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1",
                  CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="16MiB")
    data = os.urandom(1 << 20) * 40  # 5 parts of 8 MiB
    with d.client().generation("grown", 1) as gen:
        gen.put("big.bin", data)
    deadline = time.monotonic() + 120
    while _journalled_uploads(d) == 0 or not uploads(seaweedfs, s3_bucket):
        assert time.monotonic() < deadline, "the multipart upload never began"
        time.sleep(0.05)
    d.kill()
    d.overrides["CKPTDRAIN_DESTINATION__MULTIPART_THRESHOLD_BYTES"] = "64MiB"
    d.start()
    d.client().wait("grown", 1, timeout_s=180)
    assert get(seaweedfs, s3_bucket, f"grown/{1:020d}/big.bin") == data
    deadline = time.monotonic() + 30
    while uploads(seaweedfs, s3_bucket) or _journalled_uploads(d):
        assert time.monotonic() < deadline, "the upload begun before the kill is still open"
        time.sleep(0.1)


def test_a_part_answered_with_a_wrong_etag_is_sent_again(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking a misbehaving server: one UploadPart answered with a wrong ETag made the
    # Complete fail with InvalidPart, classed as another writer's conflict, and the generation
    # failed for good, told "another writer got there first". It is resumed now: the part
    # whose ETag ListParts does not confirm is sent again.
    proxy.do(lambda: proxy.proxy.inject("wrong_etag", match=lambda r: r.is_upload_part))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    data = os.urandom(23 << 20)  # 3 parts of 8 MiB
    with d.client().generation("etag", 1) as gen:
        gen.put("big.bin", data)
    d.client().wait("etag", 1, timeout_s=120)
    assert get(seaweedfs, s3_bucket, f"etag/{1:020d}/big.bin") == data
    assert proxy.do(lambda: len(proxy.proxy.faults("wrong_etag"))) == 1
    parts = proxy.do(lambda: sum(1 for r in proxy.proxy.requests if r.is_upload_part))
    assert parts == 3 + 1, parts  # the one with the wrong ETag, once more
    assert uploads(seaweedfs, s3_bucket) == []
    assert "InvalidPart" in d.log() or "rewriting ETags" in d.log()


def test_a_restart_while_the_destination_answers_nothing_serves_at_once(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    # Found attacking an S3 outage: the start-up's orphan sweep was awaited before the socket
    # was served, and with the destination answering nothing every hand-off was refused
    # ("no socket there") for the sweep's 60 s. It runs in the background now.
    blackhole = ThreadedProxy(seaweedfs.endpoint_url, seed=11, stall_s=120)
    try:
        # A request sent into the outage waits out its read timeout (120 s by default: this
        # test took 127 s when the drain's PutObject went out before the outage ended).
        d = s3_daemon(make_daemon, "node-a", s3_bucket, blackhole.endpoint_url,
                      CKPTDRAIN_DESTINATION__READ_TIMEOUT_S="5")
        blackhole.do(lambda: blackhole.proxy.set_rates(stall=1.0))
        assert d.stop() == 0
        d.start(timeout_s=30)
        with d.client().generation("blip", 1) as gen:
            gen.put("w.bin", b"w" * 4096)  # safe on the node; drained once it answers
        blackhole.do(lambda: blackhole.proxy.set_rates(stall=0.0))
        d.client().wait("blip", 1, timeout_s=240)
    finally:
        blackhole.close()


def test_foreign_orphans_swept_after_grace(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    s3 = seaweedfs.client()
    old = s3.create_multipart_upload(Bucket=s3_bucket, Key=f"{PREFIX}/j/{1:020d}/old.bin",
                                     Metadata={"ckptdrain-node": "dead-node"})["UploadId"]
    # Ages are the server's clock against the grace: old is 8 s old when fresh is new, and the
    # daemon's start-up (seconds on a loaded machine) must stay within the 6 s grace of fresh.
    time.sleep(8)
    fresh = s3.create_multipart_upload(Bucket=s3_bucket, Key=f"{PREFIX}/j/{2:020d}/fresh.bin",
                                       Metadata={"ckptdrain-node": "busy-node"})["UploadId"]
    d = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url,
                  CKPTDRAIN_DESTINATION__ORPHAN_GRACE_S="6")
    # The start-up sweep runs in the background, once the socket is served.
    wait_for(lambda: "event=orphans_swept" in d.log(), timeout_s=30)
    left = {u["UploadId"] for u in uploads(seaweedfs, s3_bucket)}
    assert old not in left and fresh in left
    assert d.client().status()["node_id"] == "node-a"
    s3.abort_multipart_upload(Bucket=s3_bucket, Key=f"{PREFIX}/j/{2:020d}/fresh.bin", UploadId=fresh)


def test_two_daemons_publish_at_once(make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    a = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url)
    b = s3_daemon(make_daemon, "node-b", s3_bucket, seaweedfs.endpoint_url)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def rank(d: DaemonProcess, r: int) -> None:
        try:
            with d.client().generation("race", 3, rank=r, world_size=2) as gen:
                gen.put(f"rank{r}.bin", os.urandom(2 << 20))
                barrier.wait(30)
            d.client().wait("race", 3, timeout_s=120)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(d, r)) for r, d in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    keys = [o["Key"] for o in seaweedfs.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/race/").get("Contents", [])]
    assert sum(k.endswith("MANIFEST.json") for k in keys) == 1
    for d in (a, b):
        [gen] = d.client().status()["generations"]
        assert gen["state"] == "committed"


def test_restart_with_an_open_rank_mid_upload_leaves_no_upload(make_daemon: Any, seaweedfs: SeaweedFS,
                                                               s3_bucket: str, proxy: ThreadedProxy) -> None:
    """One node, killed while a rank was still open and its shard mid-multipart: recovery fails
    the generation before anything else runs, and its upload must still be aborted (not left
    to a sweep that skips young uploads)."""
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1")
    data = os.urandom(1 << 20) * 96  # 12 parts of 8 MiB
    gen = d.client().generation("open-rank", 1)
    gen.__enter__()
    try:
        gen.put("big.bin", data)  # acknowledged; the rank stays open (never sealed)

        def parts_sent() -> int:
            return proxy.do(lambda: sum(1 for r in proxy.proxy.requests if r.is_upload_part and r.fault is None))

        deadline = time.monotonic() + 120
        while parts_sent() < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        d.kill()
        assert uploads(seaweedfs, s3_bucket), "the upload should be in progress when killed"
    finally:
        # The daemon is gone: drop the rank's socket without sealing (the test's own end).
        if gen._channel is not None:
            gen._channel.close()
    d.start()
    with pytest.raises(GenerationFailed, match="restarted"):
        d.client().wait("open-rank", 1, timeout_s=30)
    deadline = time.monotonic() + 60
    while uploads(seaweedfs, s3_bucket):
        assert time.monotonic() < deadline, f"upload left behind: {uploads(seaweedfs, s3_bucket)}"
        time.sleep(0.1)


def test_wait_and_latest_when_the_manifest_get_is_cut_mid_body(make_daemon: Any, seaweedfs: SeaweedFS,
                                                               s3_bucket: str, proxy: ThreadedProxy) -> None:
    """The S3 server cuts every GET of a MANIFEST.json half-way: `wait` and `latest` get a
    typed error (or, for latest, no answer from that step), and the daemon serves on."""
    from ckptdrain.client import DestinationError, DrainError

    key = f"{PREFIX}/cut/{5:020d}/MANIFEST.json"
    seaweedfs.client().put_object(Bucket=s3_bucket, Key=key, Body=b'{"job": "cut"' + b" " * 4096 + b"}")
    proxy.do(lambda: proxy.proxy.inject("truncate", times=10_000,
                                        match=lambda r: r.method == "GET" and "MANIFEST.json" in r.target))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url,
                  CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="2")
    c = d.client()
    with pytest.raises(DestinationError):
        c.wait("cut", 5, timeout_s=20)
    try:
        assert c.latest("cut") is None
    except DrainError as exc:
        assert isinstance(exc, DestinationError), exc
    assert proxy.do(lambda: proxy.proxy.faults("truncate")), "the fault never fired"
    assert d.proc is not None and d.proc.poll() is None, d.log()
    with c.generation("bystander", 1) as gen:
        gen.put("ok", b"still here")
    c.wait("bystander", 1, timeout_s=60)


def test_a_complete_whose_body_changed_on_the_way_is_sent_again(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking the S3 drain: one byte flipped in a CompleteMultipartUpload body (which
    # carries no checksum) got MalformedXML, taken as permanent: the upload was aborted and
    # the generation failed. It is the XML we sent, changed on the way: the drain retries.
    proxy.do(lambda: proxy.proxy.inject(
        "corrupt", match=lambda r: r.method == "POST" and "uploadId=" in r.target))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    data = os.urandom(20 << 20)  # three parts of 8 MiB
    with d.client().generation("flipped", 1) as gen:
        gen.put("big.bin", data)
    d.client().wait("flipped", 1, timeout_s=120)
    assert get(seaweedfs, s3_bucket, f"flipped/{1:020d}/big.bin") == data
    assert len(proxy.do(lambda: proxy.proxy.faults("corrupt"))) == 1
    retried = [line for line in d.log().splitlines() if "MalformedXML" in line]
    assert retried, d.log()
    # Said as what it is (found attacking the first version: "the server refused the
    # body's checksum", which no server had).
    assert all("refused the body's checksum" not in line for line in retried), retried
    assert any("could not parse the XML" in line for line in retried), retried


def test_one_answer_that_is_no_manifest_does_not_refuse_a_step_for_good(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found attacking the S3 drain: the begin's GET of a MANIFEST.json nobody had written,
    # answered 200 with an S3 <Error> body (a middlebox), refused the step for good: "has a
    # damaged MANIFEST.json; nothing may overwrite it". The key is read once more first.
    proxy.do(lambda: proxy.proxy.inject(
        "error200", match=lambda r: r.method == "GET" and "MANIFEST.json" in r.target))
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    with d.client().generation("misread", 1) as gen:
        gen.put("w.bin", b"saved all the same")
    d.client().wait("misread", 1, timeout_s=120)
    assert get(seaweedfs, s3_bucket, f"misread/{1:020d}/w.bin") == b"saved all the same"
    assert len(proxy.do(lambda: proxy.proxy.faults("error200"))) == 1


def test_the_commit_proves_its_own_small_shards_by_listing_not_a_head_each(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy) -> None:
    # Found measuring 256 x 1 MiB drained to SeaweedFS: the commit sent a HEAD per shard
    # (about a fifth of the drain's CPU) for objects whose PutObject had answered their ETag.
    d = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    blobs = {f"r0/s{i}.bin": os.urandom(4096 + i) for i in range(24)}
    with d.client().generation("proved", 1, rank=0, world_size=1) as gen:
        for name, data in blobs.items():
            gen.put(name, data)
    d.client().wait("proved", 1, timeout_s=120)
    manifest = Manifest.from_json(get(seaweedfs, s3_bucket, f"proved/{1:020d}/MANIFEST.json"))
    assert {s.path: s.size for s in manifest.shards} == {k: len(v) for k, v in blobs.items()}
    seen = proxy.do(lambda: list(proxy.proxy.requests))
    shard_heads = [r.target for r in seen if r.method == "HEAD" and "/r0/" in r.target]
    # The proof's own listing: the directory the shards share, no delimiter.
    proofs = [r.target for r in seen if r.method == "GET" and "list-type=2" in r.target
              and "delimiter" not in r.target
              and f"proved%2F{1:020d}%2Fr0%2F" in r.target]
    assert shard_heads == []
    assert len(proofs) == 1, [r.target for r in seen if r.method == "GET"]


@pytest.mark.parametrize("restart", [False, True])
def test_an_abort_mid_upload_aborts_the_upload(make_daemon: Any, seaweedfs: SeaweedFS,
                                               s3_bucket: str, restart: bool) -> None:
    """Found attacking recovery: `ckptdrain abort` of a generation whose shards were mid-
    multipart (resumed after a restart: their upload ids journalled) cancelled the copies
    and left the uploads open, to the orphan sweep's grace (an hour). A copy its generation's
    end cancels aborts its upload."""
    slow = {"CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S": "6MiB"}
    d = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url, **slow)
    with d.client(timeout_s=120).generation("aborted-mid", 10) as gen:
        for i in range(3):
            gen.put(f"s{i}.bin", os.urandom(20 << 20))
    wait_for(lambda: len(uploads(seaweedfs, s3_bucket)) == 3, 60, 0.05)
    if restart:
        # Killed once the three upload ids are journalled: an upload created but not yet
        # journalled is the orphan sweep's (after its grace), not the abort's. A loaded
        # fresh-clone run killed it in that window, and one upload stayed.
        wait_for(lambda: _journalled_uploads(d) == 3, 60, 0.05)
        d.kill()
        d.start()  # the copies resume the journalled uploads, still paced
    out = subprocess.run([CKPTDRAIN, "abort", "aborted-mid", "10"], env=d.env(),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 30
    while uploads(seaweedfs, s3_bucket):
        assert time.monotonic() < deadline, f"upload left behind: {uploads(seaweedfs, s3_bucket)}"
        time.sleep(0.1)


def _recorded(d: DaemonProcess, job: str, step: int) -> None:
    def state() -> str:
        return next((str(g["state"]) for g in d.client().status()["generations"]
                     if (g["job"], g["step"]) == (job, step)), "unknown")
    wait_for(lambda: state() == "recorded")


@pytest.mark.parametrize("newer", [False, True], ids=["late-publish", "newer-step-seen"])
def test_one_answer_that_is_no_manifest_does_not_undo_another_nodes_commit(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy,
        newer: bool) -> None:
    # Found attacking multi-node commits on S3: node-a had recorded its part and was paused;
    # node-b published the step with it (and, in one case, a newer step). One 200 answer
    # whose body was an S3 <Error>, to node-a's GET of that MANIFEST.json, failed the step
    # as a conflict ("the existing MANIFEST.json is unreadable") at the late publish, or
    # cancelled it ("step 2 committed first"). Every decision's read of a manifest key now
    # reads again once before it counts what it read.
    a = s3_daemon(make_daemon, "node-a", s3_bucket, proxy.endpoint_url)
    b = s3_daemon(make_daemon, "node-b", s3_bucket, seaweedfs.endpoint_url)
    with a.client().generation("misread2", 1, rank=0, world_size=2) as gen:
        gen.put("rank0.bin", b"node-a's part")
    _recorded(a, "misread2", 1)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        with b.client().generation("misread2", 1, rank=1, world_size=2) as gen:
            gen.put("rank1.bin", b"node-b's part")
        b.client().wait("misread2", 1, timeout_s=60)
        if newer:
            with b.client().generation("misread2", 2, rank=0, world_size=1) as gen:
                gen.put("rank0.bin", b"a resized job's step 2")
            b.client().wait("misread2", 2, timeout_s=60)
        step_1 = f"misread2/{1:020d}/MANIFEST.json"
        proxy.do(lambda: proxy.proxy.inject(
            "error200", match=lambda r: r.method == "GET" and step_1 in r.target))
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert a.client().wait("misread2", 1, timeout_s=60)["committed"] is True
    assert len(proxy.do(lambda: proxy.proxy.faults("error200"))) == 1


def test_a_restore_killed_mid_range_is_rerun_to_exactly_the_checkpoint(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, proxy: ThreadedProxy,
        tmp_path: Path) -> None:
    # Attacking the restore's ranged reads into a buffer (s3rangeget.py): kill -9 while a
    # range's batches are being written (the answer trickled through a proxy), then the rerun
    # the docs advise (--overwrite, straight to the server) leaves exactly the checkpoint: no
    # temp file of the killed run, every byte the manifest's.
    d = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url)
    blobs = {"big.bin": os.urandom(20 << 20), "small.bin": os.urandom(4096)}
    with d.client().generation("killed", 1) as gen:
        for path, data in blobs.items():
            gen.put(path, data)
    d.client().wait("killed", 1, timeout_s=120)
    dest = f"s3://{s3_bucket}/{PREFIX}"
    into = tmp_path / "into"
    proxy.do(lambda: proxy.proxy.inject(
        "trickle", times=100, match=lambda r: r.method == "GET" and "X-Amz-Signature=" in r.target))
    slow = d.env() | {"CKPTDRAIN_DESTINATION__ENDPOINT_URL": proxy.endpoint_url}
    proc = subprocess.Popen([CKPTDRAIN, "restore", dest, "--job", "killed", "--to", str(into),
                             "--no-local"], env=slow, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        def writing() -> bool:
            # Named first: small.bin's temp file, renamed between the listing and a stat,
            # failed the test (FileNotFoundError) one run in a few under two workers.
            for p in into.glob(".big.bin.*.ckptdrain-tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if p.stat().st_size > 0:
                        return True
            return False
        wait_for(writing, 60, what="a range of big.bin written in part")
        assert any(r.fault == "trickle" for r in proxy.do(lambda: list(proxy.proxy.requests)))
    finally:
        proc.kill()
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()
    out = subprocess.run([CKPTDRAIN, "restore", dest, "--job", "killed", "--to", str(into),
                          "--no-local", "--overwrite"], env=d.env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = {p.relative_to(into).as_posix(): p.read_bytes() for p in into.rglob("*") if p.is_file()}
    assert got.pop("MANIFEST.json")
    assert got == blobs
