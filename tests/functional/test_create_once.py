"""Nothing overwrites what is committed: shard writes are create-once, and a publish proves
that every shard it lists is the bytes its part record names.

Each "node" is its own backend and Committer over one shared destination (a real directory,
or the in-memory fake), as separate GPU nodes' daemons are over one Lustre tree or bucket.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from ckptdrain.client.keys import manifest_key, shard_key
from ckptdrain.client.manifest import Manifest, PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend, BackendError, ShardConflict
from ckptdrain.daemon.backends.collision import check_replaced
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.commit import CommitOutcome, Committer
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.tombstone import tombstone_json

JOB = "llama"
STEP = 5
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}

NodeFactory = Callable[[str], Backend]


def _no_xattrs(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOTSUP, "Operation not supported")


@pytest_asyncio.fixture(params=["posix", "posix-without-xattrs", "memory"])
async def node_backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[NodeFactory]:
    """One backend per node over a single shared destination. ``posix-without-xattrs`` is a
    filesystem that refuses user xattrs (old NFS): checksums must then come from re-reading."""
    if request.param == "posix-without-xattrs":
        for name in ("setxattr", "fsetxattr", "getxattr", "fgetxattr"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, _no_xattrs)
    config = DestinationConfig(uri=f"file://{tmp_path / 'dest'}")
    store = MemoryStore()
    opened: list[Backend] = []

    def make(node: str) -> Backend:
        backend: Backend
        if request.param == "memory":
            backend = MemoryBackend(node, store=store)
        else:
            backend = PosixBackend(config, node)
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        await backend.aclose()


async def put(backend: Backend, tmp_path: Path, path: str, data: bytes, step: int = STEP) -> str:
    """Drain ``data`` to ``path`` of the generation as a node's scheduler does."""
    staged = tmp_path / f"staged-{hashlib.sha256(data).hexdigest()[:12]}"
    staged.write_bytes(data)
    fd = os.open(staged, os.O_RDONLY)
    try:
        return await backend.put_file(shard_key(JOB, step, path), fd, len(data))
    finally:
        os.close(fd)


def record(node: str, ranks: tuple[int, ...], shards: list[tuple[str, bytes, int]],
           world_size: int, attempt: str = "") -> PartRecord:
    return PartRecord(
        job=JOB, step=STEP, world_size=world_size, node=node, ranks=ranks,
        shards=tuple(
            ShardEntry(path, len(data), of_bytes(data), rank, node)
            for path, data, rank in shards
        ),
        clocks=CLOCKS, attempt=attempt,
    )


async def read(backend: Backend, key: str) -> bytes:
    return b"".join([chunk async for chunk in backend.read_chunks(key)])


async def commit_one(backend: Backend, tmp_path: Path, node: str, data: bytes) -> Committer:
    """``node`` drains and commits step 5 of the job: one rank, one shard ``model.bin``."""
    committer = Committer(backend, node)
    await put(backend, tmp_path, "model.bin", data)
    await committer.record_part(record(node, (0,), [("model.bin", data, 0)], 1))
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED
    return committer


@pytest.mark.asyncio
async def test_a_restarted_attempt_cannot_overwrite_a_committed_shard(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    n1, n0 = node_backend("n1"), node_backend("n0")
    await commit_one(n1, tmp_path, "n1", b"committed weights")

    # A client on n0 opens generation(JOB, 5, attempt="restart-1") and puts other bytes.
    with pytest.raises(BackendError) as caught:
        await put(n0, tmp_path, "model.bin", b"different weights, same step")

    error = caught.value
    assert (error.kind, error.transient) == ("conflict", False)
    message = str(error)
    assert f"step 5 of job {JOB!r} is committed with different bytes at" in message
    assert "model.bin" in message and "save a new step" in message
    assert await read(n0, shard_key(JOB, STEP, "model.bin")) == b"committed weights"
    report = await catalog.verify(n0, JOB, STEP)
    assert report.ok, report.bad


@pytest.mark.asyncio
async def test_the_same_bytes_again_are_accepted_as_drained(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    n1, n0 = node_backend("n1"), node_backend("n0")
    data = b"weights" * 1000
    expected = of_bytes(data)
    # Before the commit (a retried drain) and after it (a re-drain after a daemon restart).
    assert await put(n1, tmp_path, "model.bin", data) == expected
    assert await put(n1, tmp_path, "model.bin", data) == expected
    committer = Committer(n1, "n1")
    await committer.record_part(record("n1", (0,), [("model.bin", data, 0)], 1))
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED
    assert await put(n0, tmp_path, "model.bin", data) == expected
    assert (await catalog.verify(n0, JOB, STEP)).ok


@pytest.mark.asyncio
async def test_a_leftover_of_an_attempt_that_never_committed_is_replaced(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    n1, n0 = node_backend("n1"), node_backend("n0")
    # Attempt one: rank 0 drained and recorded on n1, rank 1 never came (the job died).
    old = Committer(n1, "n1")
    await put(n1, tmp_path, "rank0.bin", b"old rank 0")
    await old.record_part(record("n1", (0,), [("rank0.bin", b"old rank 0", 0)], 2))
    assert (await old.try_publish(JOB, STEP, 2)).outcome is CommitOutcome.INCOMPLETE

    # Attempt restart-1 on n0 saves both ranks again, with other bytes.
    new = Committer(n0, "n0")
    await put(n0, tmp_path, "rank0.bin", b"new rank 0, longer")
    await put(n0, tmp_path, "rank1.bin", b"new rank 1")
    shards = [("rank0.bin", b"new rank 0, longer", 0), ("rank1.bin", b"new rank 1", 1)]
    await new.record_part(record("n0", (0, 1), shards, 2, attempt="restart-1"))

    result = await new.try_publish(JOB, STEP, 2, "restart-1")
    assert result.outcome is CommitOutcome.PUBLISHED, result.reason
    assert await read(n1, shard_key(JOB, STEP, "rank0.bin")) == b"new rank 0, longer"
    assert (await catalog.verify(n1, JOB, STEP)).ok


@pytest.mark.asyncio
async def test_publish_refuses_a_shard_another_attempt_replaced(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    n1, n2, n0 = node_backend("n1"), node_backend("n2"), node_backend("n0")
    ours, theirs = b"A" * 4096, b"B" * 4096  # same size: only the checksum tells them apart
    await put(n1, tmp_path, "rank0.bin", ours)
    await Committer(n1, "n1").record_part(record("n1", (0,), [("rank0.bin", ours, 0)], 2))
    # A restarted attempt drains rank 0 again, over the uncommitted leftover.
    await put(n0, tmp_path, "rank0.bin", theirs)
    # The last node of the first attempt completes the coverage and tries to publish.
    last = Committer(n2, "n2")
    await put(n2, tmp_path, "rank1.bin", b"rank 1")
    await last.record_part(record("n2", (1,), [("rank1.bin", b"rank 1", 1)], 2))

    result = await last.try_publish(JOB, STEP, 2)

    assert result.outcome is CommitOutcome.CONFLICT
    assert "rank0.bin" in result.reason and "not the bytes" in result.reason
    assert await n2.get_bytes(manifest_key(JOB, STEP)) is None
    assert await catalog.latest(n2, JOB) is None


@pytest.mark.asyncio
async def test_publish_still_accepts_shards_written_before_checksums_were_recorded(
    tmp_path: Path,
) -> None:
    """Objects from an older ckptdrain carry no recorded checksum: a publish proves them by
    size, as before, and the manifest still verifies."""
    backend = MemoryBackend("n1")
    data = b"written by an older daemon"
    await put(backend, tmp_path, "model.bin", data)
    backend.store.checksums.clear()
    committer = Committer(backend, "n1")
    await committer.record_part(record("n1", (0,), [("model.bin", data, 0)], 1))
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED
    assert (await catalog.verify(backend, JOB, STEP)).ok


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(20))
async def test_two_writers_of_one_key_at_once_leave_one_consistent_object(
    tmp_path: Path, seed: int
) -> None:
    """Two attempts drain the same uncommitted shard at once: both finish, and what is left is
    one of them, recorded with its own checksum (so a publish can tell which it is)."""
    store = MemoryStore()
    rng = random.Random(seed)
    writers = [MemoryBackend(n, store=store, interleave=rng) for n in ("n0", "n1")]
    payloads = [b"attempt zero" * 100, b"attempt one!" * 100]

    sums = await asyncio.gather(
        *(put(w, tmp_path, "rank0.bin", p) for w, p in zip(writers, payloads, strict=True))
    )

    key = shard_key(JOB, STEP, "rank0.bin")
    assert store.objects[key] in payloads
    assert store.checksums[key] == of_bytes(store.objects[key])
    assert sums == [of_bytes(p) for p in payloads]


@pytest.mark.asyncio
async def test_posix_records_the_checksum_on_the_inode_and_rehashes_without_it(
    tmp_path: Path,
) -> None:
    backend = PosixBackend(DestinationConfig(uri=f"file://{tmp_path / 'dest'}"), "n1")
    try:
        data = b"x" * 100_000
        checksum = await put(backend, tmp_path, "model.bin", data)
        path = tmp_path / "dest" / shard_key(JOB, STEP, "model.bin")
        assert os.getxattr(path, "user.ckptdrain.checksum") == checksum.encode()
        assert not [p for p in path.parent.iterdir() if p.name != "model.bin"]  # no temp left

        # A file an older version wrote has no xattr: stat hashes it and records the result.
        os.removexattr(path, "user.ckptdrain.checksum")
        info = await backend.stat(shard_key(JOB, STEP, "model.bin"))
        assert info is not None and (info.size, info.checksum) == (len(data), checksum)
        assert os.getxattr(path, "user.ckptdrain.checksum") == checksum.encode()
        assert await backend.stat(shard_key(JOB, STEP, "absent.bin")) is None
    finally:
        await backend.aclose()


@pytest.mark.asyncio
async def test_a_commit_landing_during_a_replacement_is_reported(tmp_path: Path) -> None:
    """The one window create-once cannot close without multi-key transactions: another attempt
    publishes between a replacement's check and its write. The replacing drain must not
    report success."""
    backend = MemoryBackend("n0")
    await put(backend, tmp_path, "model.bin", b"new attempt")
    manifest = Manifest(
        job=JOB, generation=STEP, world_size=1,
        shards=(ShardEntry("model.bin", 3, of_bytes(b"old"), 0,
                           "n1"),),
        nodes=("n1",), clocks={**CLOCKS, "committed": 4.0},
    )
    await backend.put_bytes(manifest_key(JOB, STEP), manifest.to_json(), exclusive=True)
    with pytest.raises(ShardConflict, match="was committed by another attempt while this one"):
        await check_replaced(
            backend, shard_key(JOB, STEP, "model.bin"), len(b"new attempt"),
            of_bytes(b"new attempt"),
        )


@pytest.mark.asyncio
async def test_a_damaged_or_abandoned_manifest_is_never_written_over(tmp_path: Path) -> None:
    backend = MemoryBackend("n0")
    await put(backend, tmp_path, "model.bin", b"leftover")
    await backend.put_bytes(manifest_key(JOB, STEP), b"{not json", exclusive=True)
    with pytest.raises(ShardConflict, match=r"damaged MANIFEST\.json"):
        await put(backend, tmp_path, "model.bin", b"other bytes")
    backend.objects[manifest_key(JOB, STEP)] = tombstone_json(JOB, STEP, "n9", 1.0)
    with pytest.raises(ShardConflict, match="abandoned and is being removed by retention"):
        await put(backend, tmp_path, "model.bin", b"other bytes")
    assert backend.objects[shard_key(JOB, STEP, "model.bin")] == b"leftover"
