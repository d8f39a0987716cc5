"""Create-once shard writes and the publish proof against a real S3 server (SeaweedFS).

Every scenario runs with a single PutObject (1 KiB) and a multipart upload (12 MiB over an
8 MiB threshold): both must refuse to write over a committed shard.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.client.keys import manifest_key, shard_key
from ckptdrain.client.manifest import PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3 import MiB, S3Backend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.commit import CommitOutcome, Committer
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.retention import apply_retention
from ckptdrain.daemon.tombstone import is_tombstone, was_committed
from tests.integration.seaweedfs import REGION, SeaweedFS

PREFIX = "ckpt/run1"
JOB = "llama"
STEP = 5
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}
SIZES = pytest.mark.parametrize("size", [1024, 12 * MiB], ids=["put", "multipart"])

pytestmark = [
    pytest.mark.s3,
    pytest.mark.asyncio,
    # Part bodies are pooled bytearrays on purpose; see test_s3_backend.py.
    pytest.mark.filterwarnings(
        "ignore:Sending a large body directly with raw bytes:ResourceWarning"
    ),
]

Nodes = Callable[[str], S3Backend]


@pytest_asyncio.fixture
async def nodes(seaweedfs: SeaweedFS, s3_bucket: str) -> AsyncIterator[Nodes]:
    """One S3Backend per node, all on the same bucket and prefix."""
    config = DestinationConfig(
        uri=f"s3://{s3_bucket}/{PREFIX}", endpoint_url=seaweedfs.endpoint_url, region=REGION,
        addressing_style="path", checksum="when_required", max_attempts=3,
        part_size_bytes=8 * MiB, multipart_threshold_bytes=8 * MiB, max_concurrency=4,
    )
    made: list[S3Backend] = []

    def make(node: str) -> S3Backend:
        made.append(S3Backend(config, node))
        return made[-1]

    yield make
    for backend in made:
        await backend.aclose()


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


async def put(backend: S3Backend, tmp_path: Path, path: str, data: bytes) -> str:
    staged = tmp_path / f"staged-{hashlib.sha256(data).hexdigest()[:12]}"
    staged.write_bytes(data)
    fd = os.open(staged, os.O_RDONLY)
    try:
        return await backend.put_file(shard_key(JOB, STEP, path), fd, len(data))
    finally:
        os.close(fd)


def record(node: str, ranks: tuple[int, ...], shards: list[tuple[str, bytes, int]],
           world_size: int) -> PartRecord:
    return PartRecord(
        job=JOB, step=STEP, world_size=world_size, node=node, ranks=ranks,
        shards=tuple(
            ShardEntry(path, len(data), of_bytes(data), rank, node)
            for path, data, rank in shards
        ),
        clocks=CLOCKS,
    )


async def read(backend: S3Backend, key: str) -> bytes:
    return b"".join([chunk async for chunk in backend.read_chunks(key)])


def uploads_left(seaweedfs: SeaweedFS, bucket: str) -> list[Any]:
    answer = seaweedfs.client().list_multipart_uploads(Bucket=bucket)
    return list(answer.get("Uploads", []))


@SIZES
async def test_a_restarted_attempt_cannot_overwrite_a_committed_shard(
    nodes: Nodes, tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str, size: int
) -> None:
    n1, n0 = nodes("n1"), nodes("n0")
    committed = payload(size, 1)
    await put(n1, tmp_path, "model.bin", committed)
    committer = Committer(n1, "n1")
    await committer.record_part(record("n1", (0,), [("model.bin", committed, 0)], 1))
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED

    with pytest.raises(BackendError) as caught:
        await put(n0, tmp_path, "model.bin", payload(size, 2))

    assert (caught.value.kind, caught.value.transient) == ("conflict", False)
    assert f"step 5 of job {JOB!r} is committed with different bytes at" in str(caught.value)
    assert "save a new step" in str(caught.value)
    assert await read(n0, shard_key(JOB, STEP, "model.bin")) == committed
    report = await catalog.verify(n0, JOB, STEP)
    assert report.ok, report.bad
    assert uploads_left(seaweedfs, s3_bucket) == []


@SIZES
async def test_the_same_bytes_again_are_accepted(
    nodes: Nodes, tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str, size: int
) -> None:
    n1, n0 = nodes("n1"), nodes("n0")
    data = payload(size, 3)
    expected = of_bytes(data)
    assert await put(n1, tmp_path, "model.bin", data) == expected
    assert await put(n0, tmp_path, "model.bin", data) == expected
    committer = Committer(n1, "n1")
    await committer.record_part(record("n1", (0,), [("model.bin", data, 0)], 1))
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED
    assert await put(n0, tmp_path, "model.bin", data) == expected
    assert (await catalog.verify(n0, JOB, STEP)).ok
    assert uploads_left(seaweedfs, s3_bucket) == []


@SIZES
async def test_a_leftover_of_an_attempt_that_never_committed_is_replaced(
    nodes: Nodes, tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str, size: int
) -> None:
    n1, n0 = nodes("n1"), nodes("n0")
    await put(n1, tmp_path, "model.bin", payload(size, 4))
    newer = payload(size, 5)

    assert await put(n0, tmp_path, "model.bin", newer) == (
        of_bytes(newer)
    )

    assert await read(n1, shard_key(JOB, STEP, "model.bin")) == newer
    head = seaweedfs.client().head_object(
        Bucket=s3_bucket, Key=f"{PREFIX}/{shard_key(JOB, STEP, 'model.bin')}"
    )
    # The replacement carries its checksum, so a publish can tell it from what it replaced.
    assert head["Metadata"]["ckptdrain-checksum"] == of_bytes(newer)
    assert head["Metadata"]["ckptdrain-node"] == "n0"
    assert uploads_left(seaweedfs, s3_bucket) == []


@SIZES
async def test_publish_refuses_a_shard_another_attempt_replaced(
    nodes: Nodes, tmp_path: Path, size: int
) -> None:
    n1, n2, n0 = nodes("n1"), nodes("n2"), nodes("n0")
    ours, theirs = payload(size, 6), payload(size, 7)  # same size, different bytes
    await put(n1, tmp_path, "rank0.bin", ours)
    await Committer(n1, "n1").record_part(record("n1", (0,), [("rank0.bin", ours, 0)], 2))
    await put(n0, tmp_path, "rank0.bin", theirs)  # a restarted attempt, uncommitted: replaced
    last = Committer(n2, "n2")
    await put(n2, tmp_path, "rank1.bin", b"rank 1")
    await last.record_part(record("n2", (1,), [("rank1.bin", b"rank 1", 1)], 2))

    result = await last.try_publish(JOB, STEP, 2)

    assert result.outcome is CommitOutcome.CONFLICT
    assert "rank0.bin" in result.reason and "not the bytes" in result.reason
    assert await n2.get_bytes(manifest_key(JOB, STEP)) is None


async def test_objects_written_without_checksum_metadata_still_publish(
    nodes: Nodes, seaweedfs: SeaweedFS, s3_bucket: str
) -> None:
    """Shards an older ckptdrain wrote carry no checksum metadata: proved by size, as before."""
    backend = nodes("n1")
    data = b"written by an older daemon"
    seaweedfs.client().put_object(
        Bucket=s3_bucket, Key=f"{PREFIX}/{shard_key(JOB, STEP, 'model.bin')}", Body=data
    )
    committer = Committer(backend, "n1")
    await committer.record_part(record("n1", (0,), [("model.bin", data, 0)], 1))
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED
    assert (await catalog.verify(backend, JOB, STEP)).ok


@SIZES
async def test_two_writers_of_one_key_at_once_leave_one_consistent_object(
    nodes: Nodes, tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str, size: int
) -> None:
    """Both drains finish (one creates, the other finds the key taken and replaces the
    uncommitted leftover), and the object left records the checksum of its own bytes if any."""
    writers = [nodes("n0"), nodes("n1")]
    payloads = [payload(size, 8), payload(size, 9)]

    await asyncio.gather(*(put(w, tmp_path, "model.bin", p)
                           for w, p in zip(writers, payloads, strict=True)))

    stored = await read(writers[0], shard_key(JOB, STEP, "model.bin"))
    assert stored in payloads
    info = await writers[0].stat(shard_key(JOB, STEP, "model.bin"))
    assert info is not None and info.size == size
    assert info.checksum in (None, of_bytes(stored))
    assert uploads_left(seaweedfs, s3_bucket) == []


async def test_stat_and_list_dirs(nodes: Nodes, tmp_path: Path) -> None:
    backend = nodes("n1")
    data = b"small shard"
    checksum = await put(backend, tmp_path, "a/model.bin", data)
    info = await backend.stat(shard_key(JOB, STEP, "a/model.bin"))
    assert info is not None and (info.size, info.checksum) == (len(data), checksum)
    assert info.modified is not None
    assert await backend.stat(shard_key(JOB, STEP, "absent")) is None
    await backend.put_bytes(f"{JOB}/LATEST", b"5\n")
    await backend.put_bytes(shard_key(JOB, 7, "x"), b"x")
    backend.list_page_size = 1  # paging through a real server
    assert await backend.list_dirs(f"{JOB}/") == [f"{STEP:020d}", f"{7:020d}"]
    assert await backend.list_dirs("nothing/") == []


@pytest.mark.parametrize("first", ["retention", "publish"])
async def test_retention_and_a_late_publish_meet_at_the_manifest_key(
    nodes: Nodes, tmp_path: Path, first: str
) -> None:
    """On S3 the one arbiter is the conditional create of MANIFEST.json: whichever of the
    tombstone and the manifest lands first holds it, and the other side backs off."""
    n1, gc = nodes("n1"), nodes("gc")
    for step in (4, 6):  # committed on both sides of the late step 5
        data = f"step {step}".encode()
        await put_step(n1, tmp_path, step, data)
        committer = Committer(n1, "n1")
        await committer.record_part(record_of(step, data))
        assert (await committer.try_publish(JOB, step, 1)).committed
    await put_step(n1, tmp_path, STEP, b"late")
    await Committer(n1, "n1").record_part(record_of(STEP, b"late"))
    later = time.time() + 7200  # the late generation looks abandoned to this run

    async def removal() -> Any:
        return await apply_retention(gc, JOB, keep_last=5, abandoned_grace_s=600, now=later)

    if first == "retention":
        report = await removal()
        assert report.abandoned_deleted == [STEP]
        assert [i.key for i in await gc.list(f"{JOB}/{STEP:020d}/")] == [manifest_key(JOB, STEP)]
        # The late node still has everything and writes it all again: its publish fails.
        await put_step(n1, tmp_path, STEP, b"late")
        await Committer(n1, "n1").record_part(record_of(STEP, b"late"))
        result = await Committer(n1, "n1").try_publish(JOB, STEP, 1)
        assert result.outcome is CommitOutcome.CONFLICT and "abandoned" in result.reason
        assert await catalog.latest(gc, JOB) == 6
    else:
        result = await Committer(n1, "n1").try_publish(JOB, STEP, 1)
        report = await removal()
        assert result.outcome is CommitOutcome.PUBLISHED
        assert report.abandoned_deleted == [] and STEP in report.kept
        assert (await catalog.verify(gc, JOB, STEP)).ok


async def test_a_committed_generation_s_tombstone_replaces_its_manifest(
    nodes: Nodes, tmp_path: Path
) -> None:
    """Retention removing a committed generation puts its tombstone in the manifest's place
    with one plain PUT (the key is never empty), before the shards go: a late create of the
    manifest then fails, and its node hears the step committed."""
    n1, gc = nodes("n1"), nodes("gc")
    for step in (4, 6):
        data = f"step {step}".encode()
        await put_step(n1, tmp_path, step, data)
        await Committer(n1, "n1").record_part(record_of(step, data))
        assert (await Committer(n1, "n1").try_publish(JOB, step, 1)).committed
    report = await apply_retention(gc, JOB, keep_last=1, abandoned_grace_s=600)
    assert (report.kept, report.deleted) == ([6], [4])
    held = await gc.get_bytes(manifest_key(JOB, 4))
    assert held is not None and is_tombstone(held) and was_committed(held)
    assert [i.key for i in await gc.list(f"{JOB}/{4:020d}/")] == [manifest_key(JOB, 4)]
    # A node that had checked the shards before they went reaches its create only now.
    assert not await n1.put_bytes(manifest_key(JOB, 4), b"{}", exclusive=True)
    assert await catalog.latest(gc, JOB) == 6


async def put_step(backend: S3Backend, tmp_path: Path, step: int, data: bytes) -> None:
    staged = tmp_path / f"step-{step}"
    staged.write_bytes(data)
    fd = os.open(staged, os.O_RDONLY)
    try:
        await backend.put_file(shard_key(JOB, step, "w.bin"), fd, len(data))
    finally:
        os.close(fd)


def record_of(step: int, data: bytes) -> PartRecord:
    entry = ShardEntry("w.bin", len(data), of_bytes(data), 0, "n1")
    return PartRecord(JOB, step, 1, "n1", (0,), (entry,), CLOCKS)


class DyingUploadLog:
    """An UploadLog whose process 'dies' (raises) right after the Complete, before the journal
    records it: the restarted drain finds the object there and the journal still full."""

    def __init__(self) -> None:
        self.upload_id: str | None = None
        self.parts: dict[int, tuple[str, str]] = {}
        self.finished_calls = 0

    async def load(self) -> tuple[str | None, dict[int, tuple[str, str]]]:
        return self.upload_id, dict(self.parts)

    async def begun(self, upload_id: str) -> None:
        self.upload_id, self.parts = upload_id, {}

    async def part_done(self, number: int, etag: str, checksum: str) -> None:
        self.parts[number] = (etag, checksum)

    async def finished(self) -> None:
        self.finished_calls += 1
        if self.finished_calls == 1:
            raise RuntimeError("the daemon was killed")
        self.upload_id, self.parts = None, {}

    def is_open(self) -> bool:
        return self.upload_id is not None


async def test_a_restarted_drain_recognises_its_own_completed_upload(
    nodes: Nodes, tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str
) -> None:
    backend = nodes("n1")
    data = payload(20 * MiB, 10)
    staged = tmp_path / "big"
    staged.write_bytes(data)
    log = DyingUploadLog()
    key = shard_key(JOB, STEP, "model.bin")
    fd = os.open(staged, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match="killed"):
            await backend.put_file(key, fd, len(data), upload_log=log)
        assert await backend.put_file(key, fd, len(data), upload_log=log) == (
            of_bytes(data)
        )
    finally:
        os.close(fd)
    # Not sent again: the object is the first upload (a replacement would record a checksum).
    head = seaweedfs.client().head_object(Bucket=s3_bucket, Key=f"{PREFIX}/{key}")
    assert "ckptdrain-checksum" not in head["Metadata"]
    assert (log.upload_id, log.finished_calls) == (None, 2)
    assert await read(backend, key) == data
    assert uploads_left(seaweedfs, s3_bucket) == []
