"""LATEST is only ever raised, and readers never answer a step older than the newest commit.

Two generations of one job published at the same moment used to race in the hint's
read-compare-write and leave it lowered (5, then 4). Each trial publishes two generations at
once, in one process (one Committer, as one daemon) or from two nodes (two Committers), on
the in-memory fake (every call interleaved differently per seed) and on a real directory.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from ckptdrain.client.keys import latest_key, manifest_key, parse_manifest_key, shard_key
from ckptdrain.client.manifest import PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.commit import CommitOutcome, Committer, parse_latest
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.retention import apply_retention

JOB = "llama"
TRIALS = 200
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}


async def recorded(committer: Committer, tmp_path: Path, step: int,
                   owner_uid: int | None = None) -> None:
    """One rank of ``step`` drained and recorded by ``committer``'s node; not yet published."""
    data = f"step {step}".encode()
    staged = tmp_path / f"staged-{committer.node_id}-{step}"
    staged.write_bytes(data)
    fd = os.open(staged, os.O_RDONLY)
    try:
        checksum = await committer.backend.put_file(shard_key(JOB, step, "w.bin"), fd, len(data))
    finally:
        os.close(fd)
    entry = ShardEntry("w.bin", len(data), checksum, 0, committer.node_id)
    await committer.record_part(
        PartRecord(JOB, step, 1, committer.node_id, (0,), (entry,), CLOCKS, owner_uid=owner_uid)
    )


async def publish_together(committers: list[Committer], steps: list[int]) -> None:
    results = await asyncio.gather(
        *(c.try_publish(JOB, step, 1) for c, step in zip(committers, steps, strict=True))
    )
    assert all(r.outcome is CommitOutcome.PUBLISHED for r in results), results


def trial_steps(rng: random.Random) -> list[int]:
    """Two distinct steps above an already committed one, in either order."""
    return rng.sample(range(2, 12), 2)


@pytest.mark.asyncio
async def test_one_daemon_publishing_two_generations_at_once_only_raises_latest_memory(
    tmp_path: Path,
) -> None:
    for seed in range(TRIALS):
        await one_daemon_memory_trial(tmp_path, seed)


async def one_daemon_memory_trial(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    store = MemoryStore()
    written: list[int | None] = []

    def on_write(key: str, data: bytes) -> None:
        if key == latest_key(JOB):
            written.append(parse_latest(data))

    store.on_write = on_write
    committer = Committer(MemoryBackend("n1", store=store, interleave=rng), "n1")
    await recorded(committer, tmp_path, 1)
    assert (await committer.try_publish(JOB, 1, 1)).committed
    steps = trial_steps(rng)
    for step in steps:
        await recorded(committer, tmp_path, step)

    await publish_together([committer, committer], steps)

    assert written == sorted(written), f"seed {seed}: LATEST went {written}"
    assert parse_latest(store.objects[latest_key(JOB)]) == max(steps), f"seed {seed}"


@pytest.mark.asyncio
async def test_one_daemon_publishing_two_generations_at_once_only_raises_latest_posix(
    tmp_path: Path,
) -> None:
    for seed in range(TRIALS):
        rng = random.Random(seed)
        root = tmp_path / f"dest-{seed}"
        backend = LatestRecordingPosix(DestinationConfig(uri=f"file://{root}"), "n1")
        try:
            committer = Committer(backend, "n1")
            await recorded(committer, tmp_path, 1)
            assert (await committer.try_publish(JOB, 1, 1)).committed
            steps = trial_steps(rng)
            for step in steps:
                await recorded(committer, tmp_path, step)

            await publish_together([committer, committer], steps)

            # One daemon's LATEST writes are serialised, so this order is the files' order.
            assert backend.written == sorted(backend.written), f"seed {seed}: {backend.written}"
            hint = (root / latest_key(JOB)).read_bytes()
            assert parse_latest(hint) == max(steps), f"seed {seed}: LATEST is {hint!r}"
        finally:
            await backend.aclose()


class LatestRecordingPosix(PosixBackend):
    def __init__(self, config: DestinationConfig, node_id: str) -> None:
        super().__init__(config, node_id)
        self.written: list[int | None] = []

    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        created = await super().put_bytes(key, data, exclusive=exclusive)
        if key == latest_key(JOB):
            self.written.append(parse_latest(data))
        return created


@pytest.mark.asyncio
async def test_two_nodes_publishing_at_once_leave_latest_at_the_newest(tmp_path: Path) -> None:
    """Across nodes there is no lock: a node that read the hint before the other raised it
    may write over it. Whoever writes last then finds the newer manifest and raises it again,
    and a reader never answers a step older than every manifest that existed when it asked."""
    for seed in range(TRIALS):
        await two_nodes_trial(tmp_path, seed)


async def two_nodes_trial(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    store = MemoryStore()
    nodes = [Committer(MemoryBackend(n, store=store, interleave=rng), n) for n in ("a", "b")]
    await recorded(nodes[0], tmp_path, 1)
    assert (await nodes[0].try_publish(JOB, 1, 1)).committed
    steps = trial_steps(rng)
    for node, step in zip(nodes, steps, strict=True):
        await recorded(node, tmp_path, step)
    reader = MemoryBackend("reader", store=store, interleave=rng)
    done = asyncio.Event()
    answers: list[tuple[int, int | None]] = []

    async def read_latest() -> None:
        while True:  # at least one full read after both publishes
            finished = done.is_set()
            floor = newest_manifest(store)
            answers.append((floor, await catalog.latest(reader, JOB)))
            if finished:
                return

    async with asyncio.TaskGroup() as group:
        watcher = group.create_task(read_latest())
        await publish_together(nodes, steps)
        done.set()
        await asyncio.wait_for(watcher, 30)

    assert parse_latest(store.objects[latest_key(JOB)]) == max(steps), f"seed {seed}"
    for floor, answer in answers:
        assert answer is not None and answer >= floor, f"seed {seed}: {answers}"
    assert answers[-1][1] == max(steps)


def newest_manifest(store: MemoryStore) -> int:
    steps = [p[1] for key in store.objects if (p := parse_manifest_key(key)) is not None]
    return max(steps, default=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["memory", "posix"])
async def test_a_lowered_hint_does_not_hide_a_newer_commit(tmp_path: Path, kind: str) -> None:
    backend: Backend = (
        MemoryBackend("n1")
        if kind == "memory"
        else PosixBackend(DestinationConfig(uri=f"file://{tmp_path / 'dest'}"), "n1")
    )
    try:
        committer = Committer(backend, "n1")
        for step in (4, 5):
            await recorded(committer, tmp_path, step)
            assert (await committer.try_publish(JOB, step, 1)).committed
        # Another node that read the hint before 5 was published writes its stale 4 over it.
        await backend.put_bytes(latest_key(JOB), b"4\n")
        # An in-flight generation above (no manifest yet) and a damaged one are not commits.
        await recorded(committer, tmp_path, 6)
        await backend.put_bytes(manifest_key(JOB, 7), b"{damaged")

        assert await catalog.latest(backend, JOB) == 5
        assert await catalog.latest(backend, JOB, use_hint=False) == 5
        assert await backend.list_dirs(f"{JOB}/") == [f"{s:020d}" for s in (4, 5, 6, 7)]
        assert await backend.list_dirs("absent/") == []
    finally:
        await backend.aclose()


@pytest.mark.asyncio
async def test_latest_answers_a_commit_while_retention_removes_what_it_found(
    tmp_path: Path,
) -> None:
    """Found attacking retention: with no usable LATEST (a write of it failed, or it names a
    removed step), `latest` scanned the generations newest first; it read step 31 (still
    draining), then 31 committed and retention (keep_last 1) removed 30, which it read next:
    None, "no committed generation", for a job that had one all along. A scan that passes a
    committed generation's tombstone above its answer scans again."""
    store = MemoryStore()
    writer = Committer(MemoryBackend("n1", store=store), "n1")
    await recorded(writer, tmp_path, 30)
    assert (await writer.try_publish(JOB, 30, 1)).committed
    await writer.backend.delete(latest_key(JOB))  # the hint could not be written
    await recorded(writer, tmp_path, 31)
    reader = MemoryBackend("reader", store=store)
    held = reader.hold("get_bytes", key_contains=manifest_key(JOB, 30))
    async with asyncio.TaskGroup() as group:
        asking = group.create_task(catalog.latest(reader, JOB))
        await held.wait_reached()  # 31 read as not committed yet; 30 next
        assert (await writer.try_publish(JOB, 31, 1)).committed
        report = await apply_retention(writer.backend, JOB, keep_last=1, abandoned_grace_s=60)
        assert report.deleted == [30]
        held.release()
    assert asking.result() == 31


@pytest.mark.asyncio
async def test_the_latest_manifest_removed_after_it_was_found_is_asked_again(
    tmp_path: Path,
) -> None:
    """Found attacking retention: `restore --generation latest` found 30 the newest, then 31
    committed and retention removed 30 before its manifest was read, and the restore said
    "generation 30 is not committed; pick one listed by `ckptdrain ls`". The manifest is now
    read once, as the hint's floor, and returned with the answer (test_latest_resolved_once
    races the commands themselves): removed before that read, 30 is no floor, and the scan
    finds 31."""
    store = MemoryStore()
    writer = Committer(MemoryBackend("n1", store=store), "n1")
    await recorded(writer, tmp_path, 30)
    assert (await writer.try_publish(JOB, 30, 1)).committed
    reader = MemoryBackend("reader", store=store)
    reads, reached, go = [0], asyncio.Event(), asyncio.Event()
    plain = reader.get_bytes

    async def get_bytes(key: str, **kw: int) -> bytes | None:
        if key == manifest_key(JOB, 30):
            reads[0] += 1
            if reads[0] == 1:  # the hint's read, the only one
                reached.set()
                await go.wait()
        return await plain(key, **kw)

    reader.get_bytes = get_bytes  # type: ignore[method-assign]
    async with asyncio.TaskGroup() as group:
        resolving = group.create_task(catalog.resolve(reader, JOB, "latest"))
        await reached.wait()
        await recorded(writer, tmp_path, 31)
        assert (await writer.try_publish(JOB, 31, 1)).committed
        assert (await apply_retention(writer.backend, JOB, keep_last=1,
                                      abandoned_grace_s=60)).deleted == [30]
        go.set()
    assert resolving.result().generation == 31
    assert reads[0] == 1


@pytest.mark.asyncio
async def test_the_owner_of_a_job_is_found_while_retention_removes_what_it_read(
    tmp_path: Path,
) -> None:
    """The owner lookup before another user's begin scans as latest does, and the same race
    (31 read uncommitted, then committed, and 30 removed before it was read) answered "no
    owner": the other user's begin of the job went through."""
    store = MemoryStore()
    writer = Committer(MemoryBackend("n1", store=store), "n1")
    for step in (30, 31):
        await recorded(writer, tmp_path, step, owner_uid=1000)
        if step == 30:
            assert (await writer.try_publish(JOB, 30, 1)).committed
            await writer.backend.delete(latest_key(JOB))  # the hint could not be written
    reader = MemoryBackend("reader", store=store)
    held = reader.hold("get_bytes", key_contains=manifest_key(JOB, 30))
    async with asyncio.TaskGroup() as group:
        asking = group.create_task(Committer(reader, "n2").owners.owner(JOB))
        await held.wait_reached()  # 31 read as not committed yet; 30 next
        assert (await writer.try_publish(JOB, 31, 1)).committed
        assert (await apply_retention(writer.backend, JOB, keep_last=1,
                                      abandoned_grace_s=60)).deleted == [30]
        held.release()
    assert asking.result() == 1000
