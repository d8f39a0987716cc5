"""``destination.engine = "crt"``: single PutObjects and the commit's HEADs sent by the AWS
common runtime's S3 client, against a real SeaweedFS, directly and through a fault proxy.

What the rest of the backend sees must not change with the engine: the object the server
stores (bytes, CRC64NVME, metadata), the HEAD's answer, and the failure (transient or not, its
kind) for each fault.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client.manifest import Manifest
from ckptdrain.daemon.backends import s3crt
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3 import MiB
from ckptdrain.daemon.backends.s3crt import CrtEngine, head_answer
from ckptdrain.daemon.checksums import from_s3_header, of_bytes
from tests.conftest import CKPTDRAIN, wait_for
from tests.integration.faultproxy import FaultProxy, ThreadedProxy
from tests.integration.seaweedfs import SeaweedFS, free_ports
from tests.integration.test_s3_backend import PREFIX, dest_config
from tests.integration.test_s3_daemon import get, s3_daemon, uploads
from tests.integration.test_s3_workers import workers_of

pytestmark = pytest.mark.s3

CRT = {"engine": "crt"}


def _by_runtime(requests: list[Any], method: str) -> list[bool]:
    """For each ``method`` request the proxy saw (multipart parts left out): whether the AWS
    common runtime sent it (its User-Agent), not botocore."""
    return [r.user_agent.startswith("CRTS3NativeClient/") for r in requests
            if r.method == method and "partNumber=" not in r.target]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _settle_fds(baseline: int) -> int:
    """The open fds once the runtime has let go of a given-up request's body (it closes its
    duplicate when the request ends, on its own thread): polled, bounded."""
    for _ in range(200):
        if _open_fds() <= baseline:
            break
        await asyncio.sleep(0.05)
    return _open_fds()


@pytest.mark.asyncio
async def test_puts_what_botocore_would_and_heads_answer_the_same(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        proxy: FaultProxy) -> None:
    # From the daemon's own loop here (drain.workers = 0); the daemon test below sends
    # through an upload worker. Through the proxy (no faults): it sees who sent each request.
    crt = backends(dest_config(s3_bucket, proxy.endpoint_url, **CRT))
    shards = [staged(0, seed=1), staged(1, seed=2), staged(MiB + 3, seed=3),
              staged(7 * MiB, seed=4)]
    keys = [f"job/{i}/sh ard+{i}.bin" for i in range(len(shards))]  # encoded in the path
    for key, shard in zip(keys, shards, strict=True):
        assert await crt.put_file(key, shard.fd, shard.size) == shard.checksum
    raw = seaweedfs.client()
    for key, shard in zip(keys, shards, strict=True):
        head = raw.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/{key}", ChecksumMode="ENABLED")
        # One PutObject (no multipart ETag), the server's own CRC64NVME of what it stored.
        assert "-" not in head["ETag"]
        assert from_s3_header(head["ChecksumCRC64NVME"]) == shard.checksum
        assert head["Metadata"]["ckptdrain-checksum"] == shard.checksum
        body = raw.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{key}")["Body"].read()
        assert body == shard.data

    assert _by_runtime(proxy.requests, "PUT") == [True] * len(keys)
    plain = backends(dest_config(s3_bucket, proxy.endpoint_url))
    asked = [*keys, "job/missing"]
    by_crt = await crt.stat_many(asked)
    assert _by_runtime(proxy.requests, "HEAD") == [True] * len(asked)
    by_botocore = await plain.stat_many(asked)
    assert _by_runtime(proxy.requests, "HEAD") == [True] * len(asked) + [False] * len(asked)
    assert by_crt == by_botocore
    assert by_crt[-1] is None
    assert [i.checksum for i in by_crt[:-1] if i] == [s.checksum for s in shards]


@pytest.mark.asyncio
async def test_a_taken_key_is_settled_or_replaced_as_with_botocore(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any) -> None:
    crt = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, **CRT))
    first, second = staged(2 * MiB, seed=10), staged(2 * MiB, seed=11)
    assert await crt.put_file("job/x", first.fd, first.size) == first.checksum
    # The same bytes again: If-None-Match refuses the create, the HEAD finds our checksum.
    assert await crt.put_file("job/x", first.fd, first.size) == first.checksum
    # Other bytes: a leftover no manifest names, replaced.
    assert await crt.put_file("job/x", second.fd, second.size) == second.checksum
    info = (await crt.stat_many(["job/x"]))[0]
    assert info is not None and info.checksum == second.checksum


@pytest.mark.asyncio
async def test_a_corrupted_body_is_refused_as_integrity(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        proxy: FaultProxy) -> None:
    crt = backends(dest_config(s3_bucket, proxy.endpoint_url, **CRT))
    shard = staged(MiB, seed=20)
    proxy.inject("corrupt", match=lambda r: r.method == "PUT")
    with pytest.raises(BackendError) as err:
        await crt.put_file("job/x", shard.fd, shard.size)
    assert err.value.kind == "integrity" and err.value.transient
    assert (await crt.stat_many(["job/x"])) == [None]
    assert await crt.put_file("job/x", shard.fd, shard.size) == shard.checksum


@pytest.mark.asyncio
async def test_max_attempts_bounds_the_attempts_at_a_throttling_server(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        proxy: FaultProxy) -> None:
    shard = staged(MiB, seed=21)
    once = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=1, **CRT))
    proxy.inject("slowdown", match=lambda r: r.method == "PUT")
    with pytest.raises(BackendError) as err:
        await once.put_file("job/x", shard.fd, shard.size)
    assert err.value.kind == "throttled" and err.value.transient, str(err.value)
    # One attempt: the runtime's own retries (5 by default) are off.
    assert [r.fault for r in proxy.requests if r.method == "PUT"] == ["slowdown"]

    proxy.requests.clear()
    thrice = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=3, **CRT))
    proxy.inject("slowdown", times=2, match=lambda r: r.method == "PUT")
    assert await thrice.put_file("job/x", shard.fd, shard.size) == shard.checksum
    assert [r.fault for r in proxy.requests if r.method == "PUT"] == ["slowdown", "slowdown",
                                                                      None]
    assert _by_runtime(proxy.requests, "PUT") == [True] * 3


@pytest.mark.asyncio
async def test_a_stalled_attempt_times_out_and_the_next_attempt_lands(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any) -> None:
    async with FaultProxy("127.0.0.1", seaweedfs.ports["s3"], stall_s=30.0) as stalling:
        crt = backends(dest_config(s3_bucket, stalling.endpoint_url, max_attempts=2,
                                   connect_timeout_s=0.5, read_timeout_s=0.5, **CRT))
        shard = staged(1000, seed=25)
        stalling.inject("stall", match=lambda r: r.method == "PUT")
        # The first attempt's answer never comes (the proxy holds it 30 s): given up after
        # its timeouts, it is sent again, long before the stall ends.
        assert await crt.put_file("job/x", shard.fd, shard.size) == shard.checksum
        assert [r.fault for r in stalling.requests if r.method == "PUT"] == ["stall", None]
        assert _by_runtime(stalling.requests, "PUT") == [True, True]


@pytest.mark.asyncio
async def test_the_engine_stands_aside_where_a_proxy_applies(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # The fault proxy as an HTTP proxy: botocore sends it absolute-form requests, which it
    # passes on to SeaweedFS. The runtime's S3 client takes no proxy, so botocore sends the
    # requests the runtime would have.
    monkeypatch.setenv("HTTP_PROXY", proxy.endpoint_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    crt = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, **CRT))
    shard = staged(MiB, seed=26)
    assert await crt.put_file("job/x", shard.fd, shard.size) == shard.checksum
    assert (await crt.stat_many(["job/x"]))[0] is not None
    assert _by_runtime(proxy.requests, "PUT") == [False]
    assert _by_runtime(proxy.requests, "HEAD") == [False]
    assert [r for r in caplog.records if "s3_crt_engine_unused" in r.getMessage()
            and "proxy" in r.getMessage()]


@pytest.mark.asyncio
async def test_a_ca_bundle_the_runtime_cannot_read_hands_its_requests_to_botocore(
        s3_bucket: str, backends: Any, staged: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("not a certificate\n")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))
    # https (the bundle applies), to a port nothing listens on: botocore's failure, typed.
    crt = backends(dest_config(s3_bucket, f"https://127.0.0.1:{free_ports(1)[0]}",
                               max_attempts=1, connect_timeout_s=1.0, **CRT))
    shard = staged(1000, seed=27)
    with pytest.raises(BackendError):
        await crt.put_file("job/x", shard.fd, shard.size)
    assert crt.crt is not None and crt.crt.unusable is not None
    assert "could not start" in crt.crt.unusable
    assert [r for r in caplog.records if "s3_crt_engine_unused" in r.getMessage()]


@pytest.mark.asyncio
async def test_an_unreachable_endpoint_is_a_transient_io_failure(
        s3_bucket: str, backends: Any, staged: Any) -> None:
    crt = backends(dest_config(s3_bucket, f"http://127.0.0.1:{free_ports(1)[0]}",
                               max_attempts=1, connect_timeout_s=1.0, **CRT))
    shard = staged(1000, seed=22)
    await crt.start()  # the runtime's threads and sockets are not counted as leaks
    baseline = _open_fds()
    with pytest.raises(BackendError) as err:
        await crt.put_file("job/x", shard.fd, shard.size)
    assert err.value.transient and err.value.kind in ("io", "timeout")
    assert "destination.endpoint_url" in str(err.value) or "timeout" in str(err.value)
    with pytest.raises(BackendError) as err:
        await crt.stat_many(["job/x"])
    assert err.value.transient
    assert await _settle_fds(baseline) <= baseline


@pytest.mark.asyncio
async def test_wrong_credentials_are_an_auth_failure_that_retrying_cannot_fix(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    crt = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, **CRT))
    shard = staged(1000, seed=23)
    with pytest.raises(BackendError) as err:
        await crt.put_file("job/x", shard.fd, shard.size)
    assert err.value.kind == "auth" and not err.value.transient
    assert "credentials" in str(err.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_stalled_request_is_given_up_and_its_body_fd_released(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        how: str, caplog: pytest.LogCaptureFixture) -> None:
    async with FaultProxy("127.0.0.1", seaweedfs.ports["s3"], stall_s=3.0) as stalling:
        crt = backends(dest_config(s3_bucket, stalling.endpoint_url, max_attempts=1,
                                   connect_timeout_s=0.5, read_timeout_s=0.5, **CRT))
        await crt.start()  # the runtime's threads and sockets are not counted as leaks
        shard = staged(MiB, seed=24)
        baseline = _open_fds()
        stalling.inject("stall", match=lambda r: r.method == "PUT")
        task = asyncio.create_task(crt.put_file("job/x", shard.fd, shard.size))
        if how == "cancel":
            for _ in range(1000):  # bounded: 10 s
                if [r for r in stalling.requests if r.method == "PUT"]:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(BackendError) as err:
                await task
            assert err.value.kind == "timeout" and err.value.transient
        # The runtime's duplicate of the body's fd is closed once it lets go of the request.
        assert await _settle_fds(baseline) <= baseline
        # And the request's late end (an error nobody awaited) was read, not left to asyncio
        # to log as "exception was never retrieved" when collected.
        del task
        gc.collect()
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.asyncio
async def test_a_cancel_while_a_given_up_attempt_ends_is_not_lost(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with FaultProxy("127.0.0.1", seaweedfs.ports["s3"], stall_s=30.0) as stalling:
        crt = backends(dest_config(s3_bucket, stalling.endpoint_url, max_attempts=3,
                                   connect_timeout_s=0.5, read_timeout_s=0.5, **CRT))
        shard = staged(1000, seed=28)
        stalling.inject("stall", match=lambda r: r.method == "PUT")
        # The runtime takes its time to end the timed-out attempt (a fault injected here: a
        # second before the real wait), and the drain is cancelled meanwhile.
        waiting = asyncio.Event()
        real = s3crt.outlast

        async def slow_end(future: Any, timeout_s: float | None = None) -> None:
            waiting.set()
            await real(asyncio.ensure_future(asyncio.sleep(1.0)), 5.0)
            await real(future, timeout_s)

        monkeypatch.setattr(s3crt, "outlast", slow_end)
        task = asyncio.create_task(crt.put_file("job/x", shard.fd, shard.size))
        async with asyncio.timeout(30):
            await waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Not taken for a timeout and retried: one attempt only.
        assert [r.fault for r in stalling.requests if r.method == "PUT"] == ["stall"]


@pytest.mark.asyncio
async def test_a_closed_engine_fails_a_request_as_closed(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any) -> None:
    crt = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, **CRT))
    await crt.start()
    assert crt.crt is not None and await crt.crt.available()
    await crt.crt.aclose()
    with pytest.raises(BackendError, match="is closed"):
        await crt.crt.head("checking job/x", f"{PREFIX}/job/x")


def test_head_answer_has_botocores_shape() -> None:
    answer = head_answer([
        ("Content-Length", "12"), ("ETag", '"abc"'), ("Last-Modified",
                                                     "Fri, 04 Dec 2026 22:00:00 GMT"),
        ("X-Amz-Meta-Ckptdrain-Checksum", "crc64nvme:00"), ("x-amz-checksum-crc64nvme", "AA=="),
        ("x-amz-checksum-type", "FULL_OBJECT")])
    assert answer["ContentLength"] == 12 and answer["ETag"] == '"abc"'
    assert answer["Metadata"] == {"ckptdrain-checksum": "crc64nvme:00"}
    assert answer["LastModified"].timestamp() == 1796421600.0
    assert answer["ChecksumCRC64NVME"] == "AA==" and answer["ChecksumType"] == "FULL_OBJECT"


def test_keys_are_uri_encoded_in_the_path_as_botocore_encodes_them() -> None:
    from botocore.utils import percent_encode

    engine = CrtEngine.__new__(CrtEngine)
    engine._base = "/bucket/"
    assert engine.path("p/job/a b+c%.bin") == "/bucket/p/job/a%20b%2Bc%25.bin"
    for key in ("p/job/00000000000000000001/rank-0/x.distcp", "p/j/~tilde/é=ü&?#.bin",
                "p/j/a:b;c,d'e(f)g!h*i@j$.bin"):
        assert engine.path(key) == "/bucket/" + percent_encode(key, safe="/~")


# -- the daemon, end to end -------------------------------------------------------------------


def test_a_daemon_with_the_runtime_engine_commits_through_faults(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str, tmp_path: Path) -> None:
    faulty = ThreadedProxy(seaweedfs.endpoint_url, seed=11, stall_s=5)
    try:
        faulty.do(lambda: faulty.proxy.set_rates(reset=0.1, slowdown=0.1))
        d = s3_daemon(make_daemon, "node-a", s3_bucket, faulty.endpoint_url,
                      CKPTDRAIN_DESTINATION__ENGINE="crt", CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="3",
                      CKPTDRAIN_DRAIN__WORKERS="1")
        blobs = {f"r0/s{i}.bin": os.urandom((i * 97 + 1) << 12) for i in range(40)}
        blobs["r0/large.bin"] = os.urandom(9 << 20)  # multipart: botocore's, as before
        with d.client(timeout_s=300).generation("crtjob", 3) as gen:
            for path, data in blobs.items():
                gen.put(path, data)
        d.client().wait("crtjob", 3, timeout_s=300)
        assert faulty.do(lambda: len(faulty.proxy.faults())) > 0, "no fault injected"
        seen = faulty.do(lambda: list(faulty.proxy.requests))
    finally:
        faulty.close()
    # Who sent what: the single PutObjects and the commit's HEADs went through the runtime
    # (from the upload worker), the multipart upload through botocore.
    by = {(r.method, "partNumber=" in r.target or "uploads" in r.target,
           r.user_agent.startswith("CRTS3NativeClient/"))
          for r in seen if r.method in ("PUT", "HEAD", "POST")}
    assert ("PUT", False, True) in by and ("HEAD", False, True) in by, sorted(by)
    assert ("PUT", True, True) not in by and ("PUT", True, False) in by, sorted(by)
    manifest = Manifest.from_json(get(seaweedfs, s3_bucket, f"crtjob/{3:020d}/MANIFEST.json"))
    assert {s.path: s.checksum for s in manifest.shards} == {
        p: of_bytes(b) for p, b in blobs.items()}
    for path in ("r0/s7.bin", "r0/large.bin"):
        assert get(seaweedfs, s3_bucket, f"crtjob/{3:020d}/{path}") == blobs[path]
    assert uploads(seaweedfs, s3_bucket) == []
    # The stored checksums agree with the manifest: `verify` (the runtime's HEADs here too,
    # from the CLI's own loop) reads no bytes.
    env = d.env() | {"CKPTDRAIN_DESTINATION__ENDPOINT_URL": seaweedfs.endpoint_url}
    out = subprocess.run([CKPTDRAIN, "verify", f"s3://{s3_bucket}/ckpt", "--job", "crtjob",
                          "--json"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["checked"] == report["stored"] == len(blobs)
    assert report["bytes"] == 0


def test_a_worker_killed_mid_drain_is_replaced_and_the_runtime_sends_the_rest(
        make_daemon: Any, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    # Paced (about 3 s for all) so shards are still being sent when the worker dies with the
    # runtime's requests in flight: each is sent again by the replacement, create-once.
    d = s3_daemon(make_daemon, "node-a", s3_bucket, seaweedfs.endpoint_url,
                  CKPTDRAIN_DESTINATION__ENGINE="crt", CKPTDRAIN_DRAIN__WORKERS="1",
                  CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="8MiB")
    blobs = {f"r0/s{i}.bin": os.urandom(512 << 10) for i in range(48)}
    with d.client(timeout_s=300).generation("crtkill", 1) as gen:
        for path, data in blobs.items():
            gen.put(path, data)

    def drained() -> int:
        for g in d.client(timeout_s=30).status()["generations"]:
            if g["job"] == "crtkill":
                return int(g["shards"].get("drained", 0))
        return 0

    wait_for(lambda: drained() >= 8, timeout_s=60)
    first = workers_of(d.pid)
    os.kill(first[0], signal.SIGKILL)
    d.client(timeout_s=300).wait("crtkill", 1, timeout_s=240)
    assert "s3_worker_lost" in d.log()
    assert first[0] not in workers_of(d.pid)
    manifest = Manifest.from_json(get(seaweedfs, s3_bucket, f"crtkill/{1:020d}/MANIFEST.json"))
    assert {s.path: s.checksum for s in manifest.shards} == {
        p: of_bytes(b) for p, b in blobs.items()}
    for path in ("r0/s0.bin", "r0/s47.bin"):
        assert get(seaweedfs, s3_bucket, f"crtkill/{1:020d}/{path}") == blobs[path]
