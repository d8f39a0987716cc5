"""With upload workers, the daemon's own S3 client sends none of the small requests its commit
and its sweeps make: part records, manifests and LATEST written and read, listings, deletes,
the parts of an upload to resume and the orphan sweep. Each cost the daemon's event loop
1.6-2.6 CPU ms to build, sign and parse; a worker does that now. The answers are the ones the
daemon's own loop gets (workers = 0), also where they do not fit in one message: an object's
bytes either way, a page of a listing longer than a datagram, a refused exclusive write, a
missing object, one longer than asked for. With workers the daemon builds no botocore client
of its own for any of it."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3 import STAT_BATCH, S3Backend
from ckptdrain.daemon.backends.s3messages import MAX_MESSAGE_BYTES
from ckptdrain.daemon.config import DestinationConfig
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_backend import PREFIX, dest_config, uploads

GEN1 = "job/00000000000000000001"
GEN2 = "job/00000000000000000002"


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_the_commits_requests_are_sent_by_a_worker_with_the_same_answers(
        seaweedfs: SeaweedFS, s3_bucket: str, workers: int) -> None:
    backend = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), "gpu0", workers=workers)
    sent_here: list[str] = []
    own_call = backend._call

    async def recording(what: str, operation: str, **params: Any) -> Any:
        sent_here.append(operation)
        return await own_call(what, operation, **params)

    backend._call = recording  # type: ignore[method-assign]
    # Long names: one page of this listing is several datagrams of JSON.
    names = [f"{GEN2}/{'s' * 160}-{i:04d}.bin" for i in range(400)]
    try:
        await backend.start()
        record = os.urandom(3000)
        manifest = os.urandom(300 << 10)  # copied into and out of its memfd in a thread
        assert await backend.put_bytes(f"{GEN1}/_parts/gpu0.json", record, exclusive=True)
        # The server's 412 comes back through the worker as the same refusal.
        assert not await backend.put_bytes(f"{GEN1}/_parts/gpu0.json", b"other",
                                           exclusive=True)
        assert await backend.get_bytes(f"{GEN1}/_parts/gpu0.json") == record
        assert await backend.put_bytes(f"{GEN1}/MANIFEST.json", manifest)
        assert await backend.get_bytes(f"{GEN1}/MANIFEST.json") == manifest
        assert await backend.get_bytes(f"{GEN1}/none.json") is None
        with pytest.raises(BackendError) as refused:
            await backend.get_bytes(f"{GEN1}/MANIFEST.json", max_bytes=1000)
        assert refused.value.kind == "integrity" and not refused.value.transient
        assert "more than the 1000 expected" in str(refused.value)

        for name in names:
            assert await backend.put_bytes(name, b"")
        listed = await backend.list(f"{GEN2}/")
        # The page's keys alone are longer than a datagram: the answer came in a memfd.
        assert sum(len(i.key) for i in listed) > MAX_MESSAGE_BYTES
        assert [(i.key, i.size) for i in listed] == [(n, 0) for n in sorted(names)]
        assert await backend.list_dirs("job/") == [GEN1.split("/")[1], GEN2.split("/")[1]]
        await backend.delete(names[0])
        assert names[0] not in [i.key for i in await backend.list(f"{GEN2}/")]
        # Retention's bulk delete: its request (the keys) is longer than a datagram too.
        await backend.delete_many(names[1:])
        assert await backend.list(f"{GEN2}/") == []

        # An upload to resume: its parts are listed by the worker; then it is swept as an
        # orphan (nobody owns it), and the sweep's abort is the worker's too.
        full = f"{PREFIX}/{GEN1}/big.bin"
        created = seaweedfs.client().create_multipart_upload(Bucket=s3_bucket, Key=full)
        assert await backend._list_parts("big.bin", full, str(created["UploadId"])) == {}
        assert await backend.sweep_orphans(set(), 0.0) == 1
        assert uploads(seaweedfs, s3_bucket) == []
        # With workers, this process never built botocore's client (about 14 MB resident and
        # 0.2 CPU s to build): nothing it did needed one.
        assert (backend._client is None) == bool(workers)
    finally:
        await backend.aclose()
    if workers:
        assert sent_here == []
    else:
        assert {"put_object", "get_object", "list_objects_v2", "delete_object", "delete_objects",
                "list_parts",
                "list_multipart_uploads", "abort_multipart_upload"} <= set(sent_here)


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_the_commits_proof_heads_shards_in_batches_with_stats_answers(
        seaweedfs: SeaweedFS, s3_bucket: str, workers: int) -> None:
    """The commit's proof of every shard (stat_many) was one HEAD per shard, each handed to a
    worker by the daemon's loop: about 0.4 ms of loop time per shard, 4 s for 10,000. It is a
    batch of STAT_BATCH HEADs per message now, answered as stat answers key by key."""
    backend = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), "gpu0", workers=workers)
    sent: list[int] = []  # one entry per message to a worker
    try:
        await backend.start()
        keys = [f"{GEN1}/shard-{i:04d}.bin" for i in range(STAT_BATCH + 44)]
        for i, key in enumerate(keys):
            if i % 7:  # every 7th shard is missing
                assert await backend.put_bytes(key, os.urandom(i % 50))
        if workers:
            own_request = backend.parts._request  # type: ignore[attr-defined]

            async def counting(body: dict[str, Any], fds: list[int], what: str,
                               timeout_s: float | None = None) -> Any:
                sent.append(1)
                return await own_request(body, fds, what, timeout_s)

            backend.parts._request = counting  # type: ignore[attr-defined]
        many = await backend.stat_many(keys)
        one_by_one = [await backend.stat(k) for k in keys]
        assert many == one_by_one
        assert [info is None for info in many] == [i % 7 == 0 for i in range(len(keys))]
        assert [info.size for info in many if info is not None] == [
            i % 50 for i in range(len(keys)) if i % 7]
        if workers:
            # Two messages for the batches (a long one is spilled into a memfd), then one per
            # single stat.
            assert len(sent) == 2 + len(keys)
    finally:
        await backend.aclose()


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_a_batch_of_heads_fails_as_a_head_does_when_the_server_refuses(
        seaweedfs: SeaweedFS, s3_bucket: str, workers: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A wrong secret: every HEAD is refused (403), which is no answer about the shard.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    backend = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), "gpu0",
                        workers=workers)
    try:
        await backend.start()
        with pytest.raises(BackendError) as batch:
            await backend.stat_many([f"{GEN1}/a.bin", f"{GEN1}/b.bin"])
        with pytest.raises(BackendError) as single:
            await backend.stat(f"{GEN1}/a.bin")
        assert (batch.value.kind, batch.value.transient) == (single.value.kind,
                                                             single.value.transient)
        # The failure names the key that got it, as a stat's does.
        assert any(f"checking {PREFIX}/{GEN1}/{name} at " in str(batch.value)
                   for name in ("a.bin", "b.bin"))
    finally:
        await backend.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_a_closed_backends_batch_fails_as_its_stat_does(workers: int) -> None:
    """Found reviewing the batches: without workers, a failure other than an S3Failure (the
    backend closed under a commit) came out of the batch as an ExceptionGroup, which the
    commit does not know as a destination error, and the generation ended as `internal`."""
    config = DestinationConfig(uri="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9",
                               region="us-east-1", addressing_style="path")
    backend = S3Backend(config, "gpu0", workers=workers)
    await backend.aclose()
    with pytest.raises(BackendError) as batch:
        await backend.stat_many([f"{GEN1}/a.bin", f"{GEN1}/b.bin"])
    with pytest.raises(BackendError) as single:
        await backend.stat(f"{GEN1}/a.bin")
    assert type(batch.value) is type(single.value)
    assert "closed" in str(batch.value) and "closed" in str(single.value)


@pytest.mark.s3
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [0, 1])
async def test_a_shard_whose_metadata_looks_like_a_message_tag_stats_alike(
        seaweedfs: SeaweedFS, s3_bucket: str, workers: int) -> None:
    # Another client of the bucket wrote user metadata named as the messages' date tag.
    seaweedfs.client().put_object(Bucket=s3_bucket, Key=f"{PREFIX}/{GEN1}/odd.bin", Body=b"abc",
                                  Metadata={"__datetime__": "2020-01-01T00:00:00"})
    backend = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), "gpu0", workers=workers)
    try:
        await backend.start()
        info = await backend.stat(f"{GEN1}/odd.bin")
        assert info is not None and info.size == 3
        assert await backend.stat_many([f"{GEN1}/odd.bin"]) == [info]
    finally:
        await backend.aclose()
