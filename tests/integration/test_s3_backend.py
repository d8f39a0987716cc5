"""S3Backend against a real SeaweedFS, directly and through a fault-injecting proxy."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3 import (
    GiB,
    MiB,
    S3Backend,
    multipart_etag,
    part_plan,
)
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.fanout import for_each_bounded
from tests.integration.faultproxy import FaultProxy
from tests.integration.seaweedfs import REGION, SeaweedFS

NODE = "node-a"
PREFIX = "ckpt/run1"

# aiohttp warns (ResourceWarning, ignored outside tests) when a body over 1 MiB is given as
# bytes-like: it fears one large transport write. Part bodies are pooled bytearrays on purpose
# (io.BytesIO would copy every part into fresh memory), so the warning is expected here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Sending a large body directly with raw bytes:ResourceWarning"
)


def dest_config(bucket: str, endpoint_url: str, **overrides: Any) -> DestinationConfig:
    settings: dict[str, Any] = {
        "uri": f"s3://{bucket}/{PREFIX}",
        "endpoint_url": endpoint_url,
        "region": REGION,
        "addressing_style": "path",
        "checksum": "when_required",
        "retry_mode": "standard",
        "max_attempts": 5,
        "part_size_bytes": 8 * MiB,
        "multipart_threshold_bytes": 8 * MiB,
        "max_concurrency": 4,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 30.0,
    }
    settings.update(overrides)
    return DestinationConfig(**settings)


class RecordingUploadLog:
    """An UploadLog in memory that records every call."""

    def __init__(self, upload_id: str | None = None,
                 parts: dict[int, tuple[str, str]] | None = None) -> None:
        self.upload_id = upload_id
        self.parts = dict(parts or {})
        self.calls: list[tuple[Any, ...]] = []
        self.first_part = asyncio.Event()

    async def load(self) -> tuple[str | None, dict[int, tuple[str, str]]]:
        self.calls.append(("load",))
        return self.upload_id, dict(self.parts)

    async def begun(self, upload_id: str) -> None:
        self.calls.append(("begun", upload_id))
        self.upload_id = upload_id
        self.parts = {}

    async def part_done(self, number: int, etag: str, checksum: str) -> None:
        self.calls.append(("part_done", number))
        self.parts[number] = (etag, checksum)
        self.first_part.set()

    async def finished(self) -> None:
        self.calls.append(("finished",))

    def is_open(self) -> bool:
        return self.upload_id is not None

    def ops(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


def uploads(seaweedfs: SeaweedFS, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
    answer = seaweedfs.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    result: list[dict[str, Any]] = answer.get("Uploads", [])
    return result


async def copied_at_once(backend: S3Backend, shards: dict[str, Any], into: Path) -> None:
    """``copy_into`` of every key of ``shards`` at once, each into a new file of ``into`` named
    as the key's last part: each returns its staged shard's size and checksum and the file
    holds its bytes."""

    async def copy(key: str) -> tuple[int, str]:
        fd = os.open(into / key.rsplit("/", 1)[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            return await backend.copy_into(key, fd)
        finally:
            os.close(fd)

    got = await asyncio.gather(*(copy(key) for key in shards))
    assert got == [(s.size, s.checksum) for s in shards.values()]
    for key, shard in shards.items():
        assert (into / key.rsplit("/", 1)[1]).read_bytes() == shard.data


async def read_all(backend: S3Backend, key: str, chunk_bytes: int = 8 << 20) -> bytes:
    return b"".join([chunk async for chunk in backend.read_chunks(key, chunk_bytes=chunk_bytes)])


# -- part_plan (pure) -------------------------------------------------------------------------


def test_part_plan_keeps_the_configured_size_when_it_fits() -> None:
    assert part_plan(40 * MiB, 8 * MiB) == (8 * MiB, 5)
    assert part_plan(16 * MiB, 8 * MiB) == (8 * MiB, 2)
    assert part_plan(1, 8 * MiB) == (8 * MiB, 1)
    assert part_plan(0, 8 * MiB) == (8 * MiB, 1)


def test_part_plan_raises_small_parts_to_the_5_mib_floor() -> None:
    assert part_plan(100 * MiB, 1 * MiB) == (5 * MiB, 20)


def test_part_plan_clamps_to_the_5_gib_ceiling() -> None:
    assert part_plan(40 * GiB, 10 * GiB) == (5 * GiB, 8)


def test_part_plan_grows_parts_to_stay_within_10000() -> None:
    size = 1 << 40  # 1 TiB at 8 MiB would be 131,072 parts
    part, count = part_plan(size, 8 * MiB)
    assert count <= 10_000
    assert part % MiB == 0
    assert part * (count - 1) < size <= part * count
    assert part_plan(10_000 * 8 * MiB, 8 * MiB) == (8 * MiB, 10_000)
    assert part_plan(10_000 * 8 * MiB + 1, 8 * MiB)[1] <= 10_000


def test_part_plan_limits() -> None:
    largest = 10_000 * 5 * GiB
    assert part_plan(largest, 8 * MiB) == (5 * GiB, 10_000)
    with pytest.raises(ValueError, match="split the shard"):
        part_plan(largest + 1, 8 * MiB)
    with pytest.raises(ValueError):
        part_plan(-1, 8 * MiB)


def test_part_plan_invariants_over_many_sizes() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        size = rng.randrange(0, 10_000 * 5 * GiB)
        wish = rng.choice([1, 5 * MiB, 8 * MiB, 64 * MiB, 5 * GiB, 6 * GiB])
        part, count = part_plan(size, wish)
        assert 5 * MiB <= part <= 5 * GiB
        assert 1 <= count <= 10_000
        assert part * count >= size
        assert size == 0 or part * (count - 1) < size


def test_multipart_etag_is_md5_of_part_md5s() -> None:
    a, b = hashlib.md5(b"a").hexdigest(), hashlib.md5(b"b").hexdigest()
    expected = hashlib.md5(bytes.fromhex(a) + bytes.fromhex(b)).hexdigest()
    assert multipart_etag([f'"{a}"', b]) == f'"{expected}-2"'


# -- against SeaweedFS ------------------------------------------------------------------------


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("size", [1 * 1024, 7 * MiB, 40 * MiB, 130 * MiB],
                         ids=["1KiB", "7MiB", "40MiB", "130MiB"])
async def test_round_trip(seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
                          size: int) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(size, seed=size)
    log = RecordingUploadLog()

    checksum = await backend.put_file("job/00000000000000000001/model/rank0.pt", shard.fd,
                                      size, upload_log=log)

    assert checksum == shard.checksum
    back = await read_all(backend, "job/00000000000000000001/model/rank0.pt",
                          chunk_bytes=3 * MiB)
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(shard.data).hexdigest()
    assert back == shard.data
    chunks = [len(c) async for c in backend.read_chunks(
        "job/00000000000000000001/model/rank0.pt", chunk_bytes=3 * MiB)]
    assert all(n == 3 * MiB for n in chunks[:-1]) and 0 < chunks[-1] <= 3 * MiB

    listed = await backend.list("job/")
    assert [(o.key, o.size) for o in listed] == [
        ("job/00000000000000000001/model/rank0.pt", size)]
    head = seaweedfs.client().head_object(
        Bucket=s3_bucket, Key=f"{PREFIX}/job/00000000000000000001/model/rank0.pt")
    assert head["Metadata"]["ckptdrain-node"] == NODE
    if size < 8 * MiB:
        assert "-" not in head["ETag"]  # one PutObject
        assert log.calls == []
    else:
        _, count = part_plan(size, 8 * MiB)
        assert head["ETag"].strip('"').endswith(f"-{count}")
        assert count > 1
        assert len(log.ops("begun")) == 1
        assert sorted(c[1] for c in log.ops("part_done")) == list(range(1, count + 1))
        assert log.ops("finished") == [("finished",)]
    # Memory stays bounded by the pool: max_concurrency buffers at most.
    assert backend.buffers.allocated <= 4
    assert uploads(seaweedfs, s3_bucket) == []


@pytest.mark.s3
@pytest.mark.asyncio
async def test_small_objects_list_get_delete(seaweedfs: SeaweedFS, s3_bucket: str,
                                             backends: Any) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    backend.list_page_size = 2  # page through a real listing
    keys = [f"job/0001/_parts/node-{i}.json" for i in range(5)] + ["job/0001b/x", "other/y"]
    for i, key in enumerate(keys):
        assert await backend.put_bytes(key, f"record {i}".encode()) is True

    assert [o.key for o in await backend.list("job/0001/")] == sorted(keys[:5])
    assert [o.key for o in await backend.list("job/0001")] == sorted(keys[:6])
    assert len(await backend.list("")) == 7
    assert await backend.get_bytes("job/0001/_parts/node-3.json") == b"record 3"
    assert await backend.get_bytes("job/0001/missing") is None
    with pytest.raises(BackendError) as small:
        await backend.get_bytes("job/0001/_parts/node-3.json", max_bytes=3)
    assert small.value.transient is False

    await backend.delete("job/0001/_parts/node-3.json")
    await backend.delete("job/0001/_parts/node-3.json")  # missing is fine
    assert await backend.get_bytes("job/0001/_parts/node-3.json") is None
    # Keys are stored under the URI's prefix.
    listed = seaweedfs.client().list_objects_v2(Bucket=s3_bucket, Prefix="other/")
    assert listed.get("KeyCount", 0) == 0
    assert seaweedfs.client().head_object(Bucket=s3_bucket, Key=f"{PREFIX}/other/y")


@pytest.mark.s3
@pytest.mark.asyncio
async def test_delete_many_removes_keys_in_requests_of_a_thousand(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, proxy: FaultProxy) -> None:
    """Retention's bulk delete: DeleteObjects, 1,000 keys a request (a 10,000-shard generation
    was 10,000 DELETEs); keys already gone are fine; a key the server refuses fails the call
    with its code, and nothing is reported deleted that was not."""
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url))
    keys = [f"bulk/{i:05d}" for i in range(2100)]
    await for_each_bounded(keys, lambda k: backend.put_bytes(k, b"x"), 32)
    keep = await backend.put_bytes("bulkier/stays", b"y")
    proxy.requests.clear()

    await backend.delete_many([*keys, "bulk/never-written"])

    deletes = [r for r in proxy.requests if r.method == "POST" and "delete" in r.target]
    assert len(deletes) == 3 and not [r for r in proxy.requests if r.method == "DELETE"]
    assert await backend.list("bulk/") == []
    assert keep and await backend.get_bytes("bulkier/stays") == b"y"
    await backend.delete_many(keys[:5])  # all gone already: fine

    await backend.put_bytes("bulk/again", b"z")
    proxy.inject("delete_denied", match=lambda r: r.method == "POST" and "delete" in r.target)
    with pytest.raises(BackendError, match="AccessDenied") as refused:
        await backend.delete_many(["bulk/again"])
    assert refused.value.transient is False and "denied/key" in str(refused.value)
    assert await backend.get_bytes("bulk/again") == b"z"


@pytest.mark.asyncio
async def test_delete_objects_carries_a_content_md5(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores that predate flexible checksums (older MinIO, Ceph RGW) refuse a DeleteObjects
    without Content-MD5, and botocore sends only a CRC32: the request is caught just before
    it would leave (nothing listens on the endpoint) and its headers read."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    backend = S3Backend(dest_config("bucket", "http://127.0.0.1:9"), NODE, workers=0)
    try:
        await _caught_delete_objects(backend)
    finally:
        await backend.aclose()


async def _caught_delete_objects(backend: S3Backend) -> None:
    client = await backend._s3()
    seen: dict[str, str] = {}

    class Caught(Exception):
        pass

    def grab(request: Any, **_: Any) -> None:
        seen.update({k: v.decode() if isinstance(v, bytes) else str(v)
                     for k, v in request.headers.items()})
        seen["body"] = request.body.decode() if isinstance(request.body, bytes) else ""
        raise Caught

    client.meta.events.register("before-send.s3.DeleteObjects", grab)
    with pytest.raises(Caught):
        await client.delete_objects(Bucket="bucket",
                                    Delete={"Objects": [{"Key": "a/b"}], "Quiet": True})
    body = seen["body"].encode()
    assert seen["Content-MD5"] == base64.b64encode(hashlib.md5(body).digest()).decode()
    assert "<Key>a/b</Key>" in seen["body"]


@pytest.mark.s3
@pytest.mark.asyncio
async def test_missing_bucket_is_a_permanent_not_found(seaweedfs: SeaweedFS,
                                                       backends: Any) -> None:
    backend = backends(dest_config("no-such-bucket-here", seaweedfs.endpoint_url))
    with pytest.raises(BackendError) as err:
        await backend.list("")
    assert (err.value.kind, err.value.transient) == ("not_found", False)
    assert "destination.uri" in str(err.value)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_exclusive_create_has_exactly_one_winner(seaweedfs: SeaweedFS, s3_bucket: str,
                                                       backends: Any) -> None:
    a = backends(dest_config(s3_bucket, seaweedfs.endpoint_url), "node-a")
    b = backends(dest_config(s3_bucket, seaweedfs.endpoint_url), "node-b")
    for round_ in range(5):
        key = f"job/{round_:020d}/MANIFEST.json"
        won = await asyncio.gather(a.put_bytes(key, b"from a", exclusive=True),
                                   b.put_bytes(key, b"from b", exclusive=True))
        assert sorted(won) == [False, True]
        winner = b"from a" if won[0] else b"from b"
        assert await a.get_bytes(key) == winner
        assert await b.put_bytes(key, b"late", exclusive=True) is False
        assert await a.get_bytes(key) == winner
    assert await a.put_bytes("job/plain", b"1") is True
    assert await a.put_bytes("job/plain", b"2") is True  # not exclusive: overwrites


@pytest.mark.s3
@pytest.mark.asyncio
async def test_upload_survives_20_percent_faults(seaweedfs: SeaweedFS, s3_bucket: str,
                                                 backends: Any, staged: Any,
                                                 proxy: FaultProxy) -> None:
    proxy.set_rates(reset=0.1, slowdown=0.1)
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB, max_attempts=10))
    shard = staged(40 * MiB, seed=11)
    small = staged(1 * MiB, seed=12)

    assert await backend.put_file("job/big", shard.fd, shard.size) == shard.checksum
    assert await backend.put_file("job/small", small.fd, small.size) == small.checksum
    for i in range(6):
        assert await backend.put_bytes(f"job/rec{i}", b"x" * i) is True
    assert await read_all(backend, "job/big") == shard.data
    assert len(await backend.list("job/")) == 8

    assert proxy.faults("reset") and proxy.faults("slowdown")
    assert uploads(seaweedfs, s3_bucket) == []


@pytest.mark.s3
@pytest.mark.asyncio
async def test_error_inside_200_and_lost_complete_answer(seaweedfs: SeaweedFS, s3_bucket: str,
                                                         backends: Any, staged: Any,
                                                         proxy: FaultProxy) -> None:
    def is_complete(r: Any) -> bool:
        return r.method == "POST" and "uploadId=" in r.target

    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB))
    shard = staged(12 * MiB, seed=21)

    # A 200 whose body is an <Error>: botocore retries it as a 500.
    proxy.inject("error200", match=is_complete)
    assert await backend.put_file("job/a", shard.fd, shard.size) == shard.checksum
    assert len(proxy.faults("error200")) == 1

    # Complete succeeds on the server but its answer is lost: the retry finds NoSuchUpload,
    # and the object's ETag shows the upload did complete.
    proxy.inject("drop_response", match=is_complete)
    assert await backend.put_file("job/b", shard.fd, shard.size) == shard.checksum
    assert len(proxy.faults("drop_response")) == 1
    assert await read_all(backend, "job/b") == shard.data
    assert backend.aborted_uploads == 0
    assert uploads(seaweedfs, s3_bucket) == []


@pytest.mark.s3
@pytest.mark.asyncio
async def test_errors_are_typed_after_botocore_gives_up(seaweedfs: SeaweedFS, s3_bucket: str,
                                                        backends: Any,
                                                        proxy: FaultProxy) -> None:
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=2,
                                   read_timeout_s=0.5))
    # One stall is retried away.
    proxy.inject("stall")
    assert await backend.put_bytes("job/x", b"1") is True
    assert len(proxy.faults("stall")) == 1

    proxy.set_rates(stall=1.0)
    with pytest.raises(BackendError) as timeout:
        await backend.put_bytes("job/y", b"1")
    assert (timeout.value.kind, timeout.value.transient) == ("timeout", True)

    proxy.set_rates(slowdown=1.0)
    with pytest.raises(BackendError) as throttled:
        await backend.get_bytes("job/x")
    assert (throttled.value.kind, throttled.value.transient) == ("throttled", True)
    # max_attempts counts every try, the first included.
    assert len(proxy.faults("slowdown")) == 2

    proxy.set_rates(reset=1.0)
    with pytest.raises(BackendError) as io:
        await backend.list("job/")
    assert (io.value.kind, io.value.transient) == ("io", True)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_unreachable_server_fails_transient_and_sweep_cleans_up(
    seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, proxy: FaultProxy
) -> None:
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB, max_attempts=2,
                                   max_concurrency=2))
    shard = staged(30 * MiB, seed=31)
    proxy.unreachable_after(3)  # CreateMultipartUpload and two parts get through

    with pytest.raises(BackendError) as err:
        await backend.put_file("job/big", shard.fd, shard.size)
    assert err.value.transient is True

    # The abort was attempted but could not reach the server: the upload is still there, and
    # nothing claims it was aborted.
    assert [r for r in proxy.requests
            if r.method == "DELETE" and "uploadId=" in r.target and r.fault == "unreachable"]
    left = uploads(seaweedfs, s3_bucket, PREFIX)
    assert len(left) == 1
    assert backend.aborted_uploads == 0

    # Once reachable, the sweep (as at daemon start-up, with nothing journalled) removes it.
    proxy.unreachable = False
    assert await backend.sweep_orphans(set(), 0) == 1
    assert uploads(seaweedfs, s3_bucket) == []
    assert backend.aborted_uploads == 1


@pytest.mark.s3
@pytest.mark.asyncio
async def test_resume_sends_only_missing_parts(seaweedfs: SeaweedFS, s3_bucket: str,
                                               backends: Any, staged: Any,
                                               proxy: FaultProxy) -> None:
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB, max_attempts=2,
                                   max_concurrency=1))
    shard = staged(32 * MiB + 123, seed=41)  # 7 parts, the last short
    count = part_plan(shard.size, 5 * MiB)[1]
    log = RecordingUploadLog()

    # First attempt: the link drops after the create-once HEAD, CreateMultipartUpload and
    # three parts.
    proxy.unreachable_after(5)
    with pytest.raises(BackendError) as err:
        await backend.put_file("job/big", shard.fd, shard.size, upload_log=log)
    assert err.value.transient is True
    # With a journal, a transient failure keeps the upload for the next attempt.
    assert not [r for r in proxy.requests if r.method == "DELETE"]
    upload_id = log.upload_id
    assert upload_id is not None and sorted(log.parts) == [1, 2, 3]
    assert [u["UploadId"] for u in uploads(seaweedfs, s3_bucket)] == [upload_id]

    # The journal's record of part 2 does not match the server: it must be sent again.
    log.parts[2] = ('"00000000000000000000000000000000"', log.parts[2][1])
    proxy.unreachable = False
    sent_before = len([r for r in proxy.requests if r.is_upload_part and r.fault is None])

    assert await backend.put_file("job/big", shard.fd, shard.size,
                                  upload_log=log) == shard.checksum

    sent = [r for r in proxy.requests if r.is_upload_part and r.fault is None][sent_before:]
    numbers = sorted(int(r.target.split("partNumber=")[1].split("&")[0]) for r in sent)
    assert numbers == [2, *range(4, count + 1)]
    assert not log.ops("begun")[1:]  # the same upload continued
    assert log.ops("finished") == [("finished",)]
    assert await read_all(backend, "job/big") == shard.data
    assert uploads(seaweedfs, s3_bucket) == []


@pytest.mark.s3
@pytest.mark.asyncio
async def test_resume_of_a_vanished_upload_starts_over(seaweedfs: SeaweedFS, s3_bucket: str,
                                                       backends: Any, staged: Any) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB))
    shard = staged(11 * MiB, seed=51)
    log = RecordingUploadLog("no-such-upload", {1: ('"abc"', "crc32:00000000")})

    assert await backend.put_file("job/x", shard.fd, shard.size, upload_log=log) == shard.checksum
    begun = log.ops("begun")
    assert len(begun) == 1 and begun[0][1] != "no-such-upload"
    assert sorted(c[1] for c in log.ops("part_done")) == [1, 2, 3]
    assert await read_all(backend, "job/x") == shard.data


@pytest.mark.s3
@pytest.mark.asyncio
async def test_cancel_mid_multipart_leaves_nothing(seaweedfs: SeaweedFS, s3_bucket: str,
                                                   backends: Any, staged: Any) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB, max_concurrency=2))
    shard = staged(60 * MiB, seed=61)
    log = RecordingUploadLog()

    task = asyncio.create_task(backend.put_file("job/big", shard.fd, shard.size, upload_log=log))
    await asyncio.wait_for(log.first_part.wait(), timeout=60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert uploads(seaweedfs, s3_bucket) == []
    assert backend.aborted_uploads == 1
    assert await backend.list("job/") == []
    assert not log.ops("finished")


@pytest.mark.s3
@pytest.mark.asyncio
async def test_unreadable_staged_copy_aborts_the_upload(seaweedfs: SeaweedFS, s3_bucket: str,
                                                        backends: Any, staged: Any) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB))
    shard = staged(12 * MiB, seed=71)
    log = RecordingUploadLog()

    # The file is shorter than declared: a local fault, reported as OSError, never retried.
    with pytest.raises(OSError, match="truncated"):
        await backend.put_file("job/x", shard.fd, shard.size + 5 * MiB, upload_log=log)
    assert uploads(seaweedfs, s3_bucket) == []
    assert backend.aborted_uploads == 1
    assert await backend.list("job/") == []


@pytest.mark.s3
@pytest.mark.asyncio
async def test_sweep_aborts_foreign_uploads_older_than_grace(seaweedfs: SeaweedFS,
                                                             s3_bucket: str,
                                                             backends: Any) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    backend.list_page_size = 2  # page through a real listing
    admin = seaweedfs.client()

    def create(key: str) -> str:
        answer = admin.create_multipart_upload(Bucket=s3_bucket, Key=key,
                                               Metadata={"ckptdrain-node": "node-b"})
        return str(answer["UploadId"])

    foreign = {create(f"{PREFIX}/job/0002/rank{i}.pt") for i in range(3)}
    owned = create(f"{PREFIX}/job/0002/rank9.pt")
    elsewhere = create("another-prefix/job/0002/rank0.pt")

    # Fresh uploads (a large grace) are left alone, whoever owns them.
    assert await backend.sweep_orphans({owned}, 3600) == 0
    assert len(uploads(seaweedfs, s3_bucket)) == 5

    assert await backend.sweep_orphans({owned}, 0) == 3
    left = {u["UploadId"] for u in uploads(seaweedfs, s3_bucket)}
    assert left == {owned, elsewhere}
    assert not left & foreign
    assert backend.aborted_uploads == 3


@pytest.mark.s3
@pytest.mark.asyncio
async def test_corrupted_part_is_refused_and_aborted(seaweedfs: SeaweedFS, s3_bucket: str,
                                                     backends: Any, staged: Any,
                                                     proxy: FaultProxy) -> None:
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB))
    shard = staged(12 * MiB, seed=81)

    # One byte flipped on the way: the server checks the part's CRC32 and refuses it.
    proxy.inject("corrupt", match=lambda r: r.is_upload_part)
    with pytest.raises(BackendError) as err:
        await backend.put_file("job/x", shard.fd, shard.size)
    assert err.value.kind == "integrity"
    assert uploads(seaweedfs, s3_bucket) == []
    assert backend.aborted_uploads == 1
    assert await backend.list("job/") == []

    # The same for a single PutObject.
    proxy.inject("corrupt", match=lambda r: r.method == "PUT")
    with pytest.raises(BackendError) as err:
        await backend.put_bytes("job/record", b"x" * 1000)
    assert err.value.kind == "integrity"
    assert await backend.get_bytes("job/record") is None

    assert await backend.put_file("job/x", shard.fd, shard.size) == shard.checksum
    assert await read_all(backend, "job/x") == shard.data


@pytest.mark.s3
@pytest.mark.asyncio
async def test_read_resumes_after_a_cut_stream(seaweedfs: SeaweedFS, s3_bucket: str,
                                               backends: Any, staged: Any,
                                               proxy: FaultProxy) -> None:
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(20 * MiB, seed=91)
    assert await direct.put_file("job/x", shard.fd, shard.size) == shard.checksum

    via_proxy = backends(dest_config(s3_bucket, proxy.endpoint_url))
    proxy.inject("truncate", match=lambda r: r.method == "GET")
    assert await read_all(via_proxy, "job/x", chunk_bytes=4 * MiB) == shard.data
    gets = [r for r in proxy.requests if r.method == "GET"]
    assert [r.fault for r in gets] == ["truncate", None]


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_a_small_object_cut_mid_body_is_read_again(seaweedfs: SeaweedFS, s3_bucket: str,
                                                         backends: Any, proxy: FaultProxy,
                                                         workers: int) -> None:
    # Found attacking restore: one GET of a MANIFEST.json cut half-way through its body (after
    # botocore's retries end, with the headers) failed `ls`, `verify`, `restore` and a
    # loader's fetch. A small object is read again, whoever sends it (a worker or this
    # process), up to max_attempts requests; a read cut every time still fails, typed.
    data = os.urandom(5000)
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    assert await direct.put_bytes("job/MANIFEST.json", data) is True
    config = dest_config(s3_bucket, proxy.endpoint_url, max_attempts=3)
    via_proxy = backends(config) if workers == 0 else S3Backend(config, "gpu0", workers=workers)
    try:
        proxy.inject("truncate", match=lambda r: r.method == "GET")
        assert await via_proxy.get_bytes("job/MANIFEST.json") == data
        gets = [r for r in proxy.requests if r.method == "GET"]
        assert [r.fault for r in gets] == ["truncate", None]

        proxy.inject("truncate", times=3, match=lambda r: r.method == "GET")
        with pytest.raises(BackendError) as cut:
            await via_proxy.get_bytes("job/MANIFEST.json")
        assert (cut.value.kind, cut.value.transient) == ("io", True)
        assert len(proxy.faults("truncate")) == 1 + 3
    finally:
        if workers:
            await via_proxy.aclose()


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("size", [3 * MiB, 6 * MiB])
async def test_a_restore_from_a_trickling_server_fails_in_bounded_time(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        proxy: FaultProxy, tmp_path: Path, size: int) -> None:
    # Found attacking restore: a server (or a path to it) that sends a byte now and then, so
    # that no read ever times out, held `ckptdrain restore` for good: 64 MiB at 512 bytes/s is
    # a day and a half. Each read now has the time its attempts may take and 1 s per MiB
    # more, then fails saying so (one stream for an object of a part or less, ranges else).
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(size, seed=93)
    assert await direct.put_file("job/x", shard.fd, shard.size) == shard.checksum
    via_proxy = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=1,
                                     connect_timeout_s=1.0, read_timeout_s=2.0,
                                     part_size_bytes=5 * MiB, multipart_threshold_bytes=5 * MiB))
    proxy.inject("trickle", times=100, match=lambda r: r.method == "GET")  # 64 KiB/s
    fd = os.open(tmp_path / "x", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(BackendError) as slow:
            await via_proxy.copy_into("job/x", fd, expected_size=size)
    finally:
        os.close(fd)
    assert (slow.value.kind, slow.value.transient) == ("timeout", True)
    assert "MiB/s" in str(slow.value) and "did not come in" in str(slow.value)


class _Progress:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 2])
async def test_copy_into_fetches_ranges_in_parallel_and_combines_their_checksums(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, tmp_path: Path,
        workers: int) -> None:
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    backend = backends(config) if workers == 0 else S3Backend(config, "gpu0", workers=workers)
    try:
        size = 37 * MiB + 5
        shard = staged(size, seed=workers + 3)
        key = "job/00000000000000000001/big.bin"
        assert await backend.put_file(key, shard.fd, size) == shard.checksum
        for algo, expected in (("crc64nvme", shard.checksum),
                               ("sha256", "sha256:" + hashlib.sha256(shard.data).hexdigest())):
            out = tmp_path / f"restored-{workers}-{algo}"
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            progress = _Progress()
            try:
                got = await backend.copy_into(key, fd, algo=algo, progress=progress)
            finally:
                os.close(fd)
            assert got == (size, expected)
            assert out.read_bytes() == shard.data
            assert sum(progress.calls) == size
    finally:
        if workers:
            await backend.aclose()


@pytest.mark.s3
@pytest.mark.asyncio
async def test_an_object_of_one_part_is_read_without_a_head_when_the_manifest_gives_its_size(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        tmp_path: Path) -> None:
    # Restoring 256 x 1 MiB from SeaweedFS spent most of its time on requests: a HEAD (for
    # the size and ETag a ranged read needs) and a GET per object. A caller that knows the
    # size from the manifest, at most one part, gets the object in one streamed GET.
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, part_size_bytes=5 * MiB))
    small, big = staged(3000, seed=51), staged(11 * MiB + 1, seed=52)
    keys = {"small": "job/00000000000000000001/small.bin",
            "big": "job/00000000000000000001/big.bin"}
    assert await backend.put_file(keys["small"], small.fd, small.size) == small.checksum
    assert await backend.put_file(keys["big"], big.fd, big.size) == big.checksum
    sent = _sent_by_this_process(backend)
    cases = [("small", small.size), ("small", None),
             ("big", big.size),
             # A manifest that says "small" for an object that is not: one stream, given up
             # at the first bytes past the size (found attacking restore: a runaway object
             # was read to its end into the target's disk); the caller compares the size.
             ("big", 3000),
             # Larger than one part, and not the size the HEAD says: nothing is read.
             ("big", big.size + 7)]
    seen = []
    for name, expected_size in cases:
        out = tmp_path / f"{name}-{expected_size}"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            got = await backend.copy_into(keys[name], fd, expected_size=expected_size)
        finally:
            os.close(fd)
        shard = small if name == "small" else big
        if expected_size in (None, shard.size):
            assert got == (shard.size, shard.checksum)
            assert out.read_bytes() == shard.data
        else:
            assert got[0] != expected_size and got[1] == ""
            assert out.stat().st_size == 0
        seen.append(list(sent))
        sent.clear()
    assert seen == [["get_object"], ["head_object", "get_object"],
                    ["head_object", *["get_object"] * 3], ["get_object"], ["head_object"]]


@pytest.mark.s3
@pytest.mark.asyncio
async def test_objects_copied_at_once_share_max_concurrency_ranges(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        tmp_path: Path) -> None:
    # A restore copies several shards at once. Each copy_into used to bound only its own
    # ranges, so 8 shards at once had 8 x max_concurrency GETs and range buffers in flight
    # (500 MB resident restoring 1 GiB). max_concurrency bounds them across the backend.
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, part_size_bytes=5 * MiB,
                                   max_concurrency=2))
    shards = {f"job/00000000000000000001/s{i}.bin": staged(11 * MiB + i, seed=40 + i)
              for i in range(3)}
    for key, shard in shards.items():
        assert await backend.put_file(key, shard.fd, shard.size) == shard.checksum
    own_call = backend._call
    in_flight = peak = 0

    async def counting(what: str, operation: str, **params: Any) -> Any:
        nonlocal in_flight, peak
        if operation != "get_object" or "Range" not in params:
            return await own_call(what, operation, **params)
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            answer = await own_call(what, operation, **params)
        finally:
            in_flight -= 1
        return answer

    backend._call = counting
    await copied_at_once(backend, shards, tmp_path)
    # Counted from request to answer; the body is then read under the same slot.
    assert 0 < peak <= 2


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_with_workers_every_request_of_a_shard_is_sent_by_a_worker(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        workers: int) -> None:
    """HEAD, create, complete and abort cost a few CPU ms each to build and sign; on the
    daemon's loop they were most of its time during an S3 drain. With workers, the daemon's
    own client sends none of a shard's requests (it records what it sends here)."""
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    backend = backends(config) if workers == 0 else S3Backend(config, "gpu0", workers=workers)
    sent_here = _sent_by_this_process(backend)
    try:
        await backend.start()
        big, small = staged(20 * MiB + 3, seed=11), staged(3000, seed=12)
        log = RecordingUploadLog()
        key = "job/00000000000000000001/big.bin"
        assert await backend.put_file(key, big.fd, big.size, upload_log=log) == big.checksum
        assert await backend.put_file("job/00000000000000000001/small.bin", small.fd,
                                      small.size) == small.checksum
        # Sent again: the HEAD finds it and settles it as the same bytes.
        assert await backend.put_file(key, big.fd, big.size) == big.checksum
        # An upload begun and given up: its abort.
        begun = RecordingUploadLog()
        created = await backend._small("starting", "create_multipart_upload",
                                       Bucket=s3_bucket, Key=f"{PREFIX}/x.bin")
        await begun.begun(str(created["UploadId"]))
        assert await backend.abort_upload("x.bin", begun)
        head = await backend.stat(key)
        assert head is not None and head.checksum == big.checksum and head.size == big.size
    finally:
        if workers:
            await backend.aclose()
    control = {"head_object", "create_multipart_upload", "complete_multipart_upload",
               "abort_multipart_upload", "upload_part", "put_object"}
    if workers:
        assert not control & set(sent_here), sent_here
    else:
        assert {"head_object", "create_multipart_upload", "complete_multipart_upload",
                "abort_multipart_upload", "upload_part"} <= set(sent_here)
    assert uploads(seaweedfs, s3_bucket) == []


def _sent_by_this_process(backend: S3Backend) -> list[str]:
    """The operations ``backend``'s own client sends from now on (not its workers'), in
    order, recorded as they are sent."""
    sent: list[str] = []
    own_call = backend._call

    async def recording(what: str, operation: str, **params: Any) -> Any:
        sent.append(operation)
        return await own_call(what, operation, **params)

    backend._call = recording
    return sent


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_create_answered_as_its_caller_is_cancelled_leaves_no_upload(
        seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    # Found in the S3 benchmark: a stopping daemon cancelled a drain in the very turn its
    # create's answer arrived from the worker; the upload it began was recorded nowhere and
    # stayed on the server until the orphan sweep. Cancelled here exactly then: by a callback
    # on the worker's answer, which runs before the waiting task resumes.
    backend = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), NODE, workers=1)
    try:
        await backend.start()
        pool = backend.parts
        creating = asyncio.ensure_future(backend._small(
            "starting", "create_multipart_upload", Bucket=s3_bucket, Key=f"{PREFIX}/late.bin"))
        deadline = asyncio.get_running_loop().time() + 30
        while not any(w is not None and w.pending for w in pool._workers):
            assert asyncio.get_running_loop().time() < deadline, "the create was never sent"
            await asyncio.sleep(0)
        worker = next(w for w in pool._workers if w is not None and w.pending)
        (answer,) = worker.pending.values()
        answer.add_done_callback(lambda _: creating.cancel())
        with pytest.raises(asyncio.CancelledError):
            await creating
        reply, fds = answer.result()
        assert reply.get("answer") and fds == [], "the create was answered, not given up"
        assert uploads(seaweedfs, s3_bucket) == []
    finally:
        await backend.aclose()


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_range_cut_mid_body_is_read_on_from_its_first_byte_not_written(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, tmp_path: Path,
        proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    # Found attacking with a proxy that resets one range once: the whole restore failed (a
    # stream read as one was resumed, a large object's ranges were not). Reader processes
    # resume in the same code (test_s3_readers.py).
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(37 * MiB + 5, seed=94)
    key = "job/00000000000000000001/resumed.bin"
    assert await direct.put_file(key, shard.fd, shard.size) == shard.checksum
    via_proxy = backends(dest_config(s3_bucket, proxy.endpoint_url))
    proxy.inject("truncate", match=lambda r: r.method == "GET")
    out = tmp_path / "restored"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    caplog.set_level(logging.INFO, logger="ckptdrain")
    try:
        assert await via_proxy.copy_into(key, fd) == (shard.size, shard.checksum)
    finally:
        os.close(fd)
    assert out.read_bytes() == shard.data
    gets = [r for r in proxy.requests if r.method == "GET"]
    assert [r.fault for r in gets].count("truncate") == 1
    assert len(gets) == 5 + 1  # five ranges of 8 MiB, and the one cut read on
    resumed = [r for r in caplog.records if "s3_read_resumed" in r.getMessage()]
    assert len(resumed) == 1, caplog.text
    offset = int(resumed[0].getMessage().split("offset=")[1].split()[0])
    assert offset % (8 * MiB) != 0, "read again from the range's start, not read on"


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_range_cut_mid_body_fails_the_copy_as_transient(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, tmp_path: Path,
        proxy: FaultProxy) -> None:
    # A range's chunks are written in batches as they arrive: a range whose body is
    # cut short must fail the copy (to be retried), never leave a short or zero-filled file
    # passing for restored.
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(37 * MiB + 5, seed=93)
    key = "job/00000000000000000001/big.bin"
    assert await direct.put_file(key, shard.fd, shard.size) == shard.checksum
    via_proxy = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=1))
    proxy.inject("truncate", match=lambda r: r.method == "GET")
    out = tmp_path / "restored"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(BackendError) as caught:
            await via_proxy.copy_into(key, fd)
    finally:
        os.close(fd)
    assert caught.value.transient
    assert [r.fault for r in proxy.requests if r.fault] == ["truncate"]
    # Once the fault is gone the same copy completes with the right checksum.
    fd = os.open(out, os.O_WRONLY | os.O_TRUNC)
    try:
        assert await via_proxy.copy_into(key, fd) == (shard.size, shard.checksum)
    finally:
        os.close(fd)
    assert out.read_bytes() == shard.data


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["list", "list_dirs"])
@pytest.mark.parametrize(("fault", "pages"), [("stuck_listing", 2), ("endless_listing", 16),
                                              ("tokenless_listing", 1)])
async def test_a_listing_that_does_not_advance_fails_as_transient(
        s3_bucket: str, backends: Any, proxy: FaultProxy, how: str, fault: str,
        pages: int) -> None:
    # Found attacking a misbehaving server: "truncated" with the same token every time kept
    # a listing (a commit's, `ls`, `verify`) in a loop for good, its pages piling up; then,
    # attacking that fix, so did a new token every time over pages listing nothing new, and
    # "truncated" with no token passed for the last page (`ls` left generations out).
    via_proxy = backends(dest_config(s3_bucket, proxy.endpoint_url))
    proxy.inject(fault, times=1_000,
                 match=lambda r: r.method == "GET" and "list-type=2" in r.target)
    with pytest.raises(BackendError, match="did not advance") as caught:
        await getattr(via_proxy, how)("job/")
    assert caught.value.transient
    assert len(proxy.faults(fault)) == pages


@pytest.mark.s3
@pytest.mark.asyncio
async def test_runs_of_directory_markers_are_progress_not_broken_paging(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any) -> None:
    # Found attacking the paging check: 40 empty "directory marker" objects (what a FUSE
    # mount or a console's "folders" leave) in a row, at a page size of 1 or 2, were taken
    # for pages that list nothing new, and `ls`/`verify` failed as if the server were broken.
    s3 = seaweedfs.client()
    for i in range(40):
        s3.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/job/m{i:03d}/", Body=b"")
    for i in range(20):  # objects right under the prefix: no directories on their pages
        s3.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/job/f{i:03d}.bin", Body=b"f")
    s3.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/job/zz/a.bin", Body=b"z")
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    backend.list_page_size = 1
    assert [info.key for info in await backend.list("job/")] == [
        *(f"job/f{i:03d}.bin" for i in range(20)), "job/zz/a.bin"]
    assert await backend.list_dirs("job/") == [*(f"m{i:03d}" for i in range(40)), "zz"]
    assert await backend.list_dirs("") == ["job"]


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_restore_missing_a_shard_on_s3_says_what_to_do(seaweedfs: SeaweedFS,
                                                               s3_bucket: str, backends: Any,
                                                               staged: Any,
                                                               tmp_path: Path) -> None:
    # Found attacking restore: a shard deleted from S3 (its manifest there) failed the restore
    # with "does not exist" and no word of what to do, where the same damage on POSIX says
    # "restore an older generation"; and a large shard deleted between its HEAD and its
    # ranged GETs (retention, mid-restore) was "NoSuchKey ...; check destination.uri (bucket
    # and prefix) and that the bucket exists".
    from ckptdrain.client.keys import shard_key
    from ckptdrain.daemon.restore import RestoreError, restore
    from tests.functional.test_catalog import JOB, PATHS, commit

    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    await commit(backend, tmp_path, 100, PATHS)
    seaweedfs.client().delete_object(Bucket=s3_bucket,
                                     Key=f"{PREFIX}/{shard_key(JOB, 100, PATHS[1])}")
    with pytest.raises(RestoreError, match=r"optim/rank0\.pt does not exist.*damaged: restore "
                                           r"an older generation"):
        await restore(backend, JOB, 100, tmp_path / "restored", concurrency=1)
    assert not (tmp_path / "restored").exists()

    shard = staged(20 * MiB, seed=29)
    key = "job/00000000000000000001/big.bin"
    assert await backend.put_file(key, shard.fd, shard.size) == shard.checksum
    own_head = backend._head

    async def deleted_after_its_head(*args: Any) -> Any:
        answer = await own_head(*args)
        seaweedfs.client().delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/{key}")
        return answer

    backend._head = deleted_after_its_head  # type: ignore[method-assign]
    fd = os.open(tmp_path / "big", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(BackendError) as gone:
            await backend.copy_into(key, fd)
    finally:
        os.close(fd)
    assert (gone.value.kind, gone.value.transient) == ("not_found", False)
    assert "big.bin does not exist" in str(gone.value)
    assert "check destination.uri" not in str(gone.value)
