"""Retention removing an abandoned generation while a late node publishes it.

A generation older than the newest commit and untouched for the grace period looks abandoned,
but a slow node may still hold every part record and publish it. Whatever the interleaving,
no manifest may ever list shards retention deleted: one of the two wins the generation's
MANIFEST.json key, and the other backs off.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from ckptdrain.client.keys import (
    generation_prefix,
    latest_key,
    manifest_key,
    parse_manifest_key,
    shard_key,
)
from ckptdrain.client.manifest import Manifest, PartRecord
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.commit import CommitOutcome, Committer, StepAbandoned
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.retention import TOMBSTONE_MIN_S, RetentionReport, apply_retention
from ckptdrain.daemon.tombstone import is_tombstone, tombstone_json

JOB = "llama"
GRACE_S = 600.0
LATE = 150  # the generation a slow node publishes late
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}


async def drained(backend: Backend, tmp_path: Path, node: str, step: int, rank: int,
                  world_size: int) -> PartRecord:
    """``node`` drains rank ``rank`` of ``step`` (two shards) and writes its part record."""
    entries = []
    for path in (f"model/rank{rank}.pt", f"optim/rank{rank}.pt"):
        data = hashlib.sha256(f"{step}/{path}".encode()).digest() * 64
        staged = tmp_path / f"staged-{node}-{step}-{rank}-{path.replace('/', '-')}"
        staged.write_bytes(data)
        fd = os.open(staged, os.O_RDONLY)
        try:
            checksum = await backend.put_file(shard_key(JOB, step, path), fd, len(data))
        finally:
            os.close(fd)
        entries.append(ShardEntry(path, len(data), checksum, rank, node))
    record = PartRecord(JOB, step, world_size, node, (rank,), tuple(entries), CLOCKS)
    await Committer(backend, node).record_part(record)
    return record


@dataclass
class Destination:
    """A shared destination: two committed generations (100, 200) and the late one (150),
    whose two nodes have both drained and recorded but not yet published."""

    kind: str
    tmp_path: Path
    store: MemoryStore = field(default_factory=MemoryStore)
    opened: list[Backend] = field(default_factory=list)

    def backend(self, node: str, rng: random.Random | None = None) -> Backend:
        made: Backend
        if self.kind == "memory":
            made = MemoryBackend(node, store=self.store, interleave=rng)
        else:
            made = PosixBackend(DestinationConfig(uri=f"file://{self.tmp_path / 'dest'}"), node)
        self.opened.append(made)
        return made

    async def populate(self) -> None:
        writer = self.backend("n1")
        for step in (100, 200):
            await drained(writer, self.tmp_path, "n1", step, 0, 1)
            assert (await Committer(writer, "n1").try_publish(JOB, step, 1)).committed
        await drained(writer, self.tmp_path, "n1", LATE, 0, 2)
        await drained(self.backend("n2"), self.tmp_path, "n2", LATE, 1, 2)
        self.age(LATE, 2 * GRACE_S)

    def age(self, step: int, by_s: float) -> None:
        prefix = generation_prefix(JOB, step)
        if self.kind == "memory":
            for key in self.store.modified:
                if key.startswith(prefix):
                    self.store.modified[key] -= by_s
            return
        for dirpath, _dirs, files in os.walk(self.tmp_path / "dest" / prefix):
            for name in files:
                path = os.path.join(dirpath, name)
                st = os.stat(path)
                os.utime(path, (st.st_atime - by_s, st.st_mtime - by_s))


@pytest_asyncio.fixture(params=["memory", "posix"])
async def dest(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Destination]:
    d = Destination(request.param, tmp_path)
    await d.populate()
    yield d
    for backend in d.opened:
        await backend.aclose()


async def retain(backend: Backend) -> RetentionReport:
    return await apply_retention(backend, JOB, keep_last=3, abandoned_grace_s=GRACE_S)


async def manifests_over_missing_shards(backend: Backend) -> list[str]:
    """Every MANIFEST.json that parses and lists a shard that is not there: must be none."""
    listed = {info.key for info in await backend.list(f"{JOB}/")}
    broken = []
    for key in sorted(k for k in listed if parse_manifest_key(k) is not None):
        data = await backend.get_bytes(key)
        try:
            manifest = Manifest.from_json(data or b"")
        except ManifestError:
            continue  # a tombstone (or damage): commits nothing
        prefix = generation_prefix(JOB, manifest.generation)
        missing = [s.path for s in manifest.shards if prefix + s.path not in listed]
        if missing:
            broken.append(f"{key} lists missing {missing}")
    return broken


@pytest.mark.asyncio
async def test_a_publish_held_after_its_checks_cannot_commit_what_retention_removed(
    tmp_path: Path,
) -> None:
    """The late publisher has read the part records and found every shard, and stops just
    before its exclusive create; retention removes the generation meanwhile."""
    d = Destination("memory", tmp_path)
    await d.populate()
    publisher = d.backend("n2")
    assert isinstance(publisher, MemoryBackend)
    held = publisher.hold("put_bytes", key_contains=manifest_key(JOB, LATE))
    async with asyncio.TaskGroup() as group:
        publish = group.create_task(Committer(publisher, "n2").try_publish(JOB, LATE, 2))
        await held.wait_reached()
        report = await retain(d.backend("gc"))
        held.release()
    result = publish.result()

    reader = d.backend("reader")
    assert await manifests_over_missing_shards(reader) == []
    assert report.abandoned_deleted == [LATE]
    assert result.outcome is CommitOutcome.CONFLICT
    assert "abandoned" in result.reason and "save a new step" in result.reason
    assert [g.step for g in await catalog.list_generations(reader, JOB)] == [200, 100]
    assert await catalog.latest(reader, JOB) == 200


@pytest.mark.asyncio
async def test_a_publish_that_creates_first_keeps_its_generation(dest: Destination) -> None:
    """The other order: retention stops just before its own create of the key; the late node
    publishes; retention then finds a manifest and removes nothing."""
    if dest.kind == "posix":
        pytest.skip("holding one call at an exact point needs the in-memory fake")
    gc = dest.backend("gc")
    assert isinstance(gc, MemoryBackend)
    held = gc.hold("put_bytes", key_contains=manifest_key(JOB, LATE))
    async with asyncio.TaskGroup() as group:
        removal = group.create_task(retain(gc))
        await held.wait_reached()
        result = await Committer(dest.backend("n2"), "n2").try_publish(JOB, LATE, 2)
        held.release()
    report = removal.result()

    assert result.outcome is CommitOutcome.PUBLISHED
    assert (report.abandoned_deleted, report.failed) == ([], [])
    assert (LATE, "committed while retention was removing it; kept") in report.skipped
    assert (await catalog.verify(gc, JOB, LATE)).ok
    assert await catalog.latest(gc, JOB) == 200


async def _step_90_committed_by_one_node_of_two(tmp_path: Path) -> Destination:
    """The in-memory destination, with step 90 drained on n1 and n2 (one rank each) and
    published by n1: older than keep_last 2 once 100 and 200 are there."""
    d = Destination("memory", tmp_path)
    await d.populate()
    n1, n2 = d.backend("n1"), d.backend("n2")
    await drained(n1, d.tmp_path, "n1", 90, 0, 2)
    await drained(n2, d.tmp_path, "n2", 90, 1, 2)
    assert (await Committer(n1, "n1").try_publish(JOB, 90, 2)).committed
    return d


@pytest.mark.asyncio
async def test_a_late_publish_cannot_bring_back_a_committed_generation_retention_removes(
    tmp_path: Path,
) -> None:
    """Found attacking retention: n1 published step 90; n2, running its own commit step of
    it, had read the part records and found every shard, and was slow to reach its create.
    Retention removed 90 (beyond keep_last) meanwhile: its manifest, then the rest. n2's
    create came after the manifest's delete and brought it back, over a directory whose
    shards were then deleted. Retention now takes the key with a tombstone before it
    deletes anything else, as it does for an abandoned generation."""
    d = await _step_90_committed_by_one_node_of_two(tmp_path)
    publisher = d.backend("n2")
    assert isinstance(publisher, MemoryBackend)
    held = publisher.hold("put_bytes", key_contains=manifest_key(JOB, 90))
    async with asyncio.TaskGroup() as group:
        publish = group.create_task(Committer(publisher, "n2").try_publish(JOB, 90, 2))
        await held.wait_reached()
        report = await apply_retention(d.backend("gc"), JOB, keep_last=2,
                                       abandoned_grace_s=GRACE_S)
        held.release()
    result = publish.result()

    reader = d.backend("reader")
    assert await manifests_over_missing_shards(reader) == []
    assert report.deleted == [90]
    # n2's own waiters hear the step committed: it was, from the same part records.
    assert result.outcome is CommitOutcome.ACCEPTED and result.manifest is None
    assert "was committed, and retention has since removed it" in result.reason
    assert is_tombstone(await reader.get_bytes(manifest_key(JOB, 90)) or b"")
    assert 90 not in [g.step for g in await catalog.list_generations(reader, JOB)]


@pytest.mark.asyncio
async def test_a_second_run_that_listed_the_old_manifest_keeps_the_first_runs_tombstone(
    tmp_path: Path,
) -> None:
    """Found attacking the committed tombstone: run B listed generation 90 while its manifest
    (committed long ago) was still there; run A then removed 90 and left its tombstone; B
    took the manifest's age for the tombstone's and removed the tombstone at once, and n2's
    late publish brought the manifest back over deleted shards."""
    d = await _step_90_committed_by_one_node_of_two(tmp_path)
    d.age(90, 2 * GRACE_S)
    publisher, gc_b = d.backend("n2"), d.backend("gcB")
    assert isinstance(publisher, MemoryBackend) and isinstance(gc_b, MemoryBackend)
    publishing = publisher.hold("put_bytes", key_contains=manifest_key(JOB, 90))
    listed = gc_b.hold("get_bytes", key_contains=manifest_key(JOB, 90))
    async with asyncio.TaskGroup() as group:
        publish = group.create_task(Committer(publisher, "n2").try_publish(JOB, 90, 2))
        await publishing.wait_reached()
        run_b = group.create_task(apply_retention(gc_b, JOB, keep_last=2,
                                                  abandoned_grace_s=GRACE_S))
        await listed.wait_reached()
        run_a = await apply_retention(d.backend("gcA"), JOB, keep_last=2,
                                      abandoned_grace_s=GRACE_S)
        listed.release()
        await run_b
        publishing.release()
    reader = d.backend("reader")
    assert run_a.deleted == [90]
    assert is_tombstone(await reader.get_bytes(manifest_key(JOB, 90)) or b"")
    assert publish.result().outcome is CommitOutcome.ACCEPTED
    assert await manifests_over_missing_shards(reader) == []
    assert 90 not in [g.step for g in await catalog.list_generations(reader, JOB)]


@pytest.mark.asyncio
async def test_a_dry_run_reports_an_interrupted_committed_removal_as_the_real_run_does(
    tmp_path: Path,
) -> None:
    # Found attacking the committed tombstone: with a removal interrupted after its
    # tombstone (part records and shards still there), `gc --dry-run` reported nothing to
    # delete and the real run then deleted it.
    d = await _step_90_committed_by_one_node_of_two(tmp_path)
    gc = d.backend("gc")
    await gc.delete(manifest_key(JOB, 90))
    assert await gc.put_bytes(manifest_key(JOB, 90),
                              tombstone_json(JOB, 90, "gc", time.time(), was_committed=True),
                              exclusive=True)
    dry = await apply_retention(gc, JOB, keep_last=2, abandoned_grace_s=GRACE_S, dry_run=True)
    real = await apply_retention(gc, JOB, keep_last=2, abandoned_grace_s=GRACE_S)
    assert (dry.deleted, real.deleted) == ([90], [90])
    assert [i.key for i in await gc.list(generation_prefix(JOB, 90))] == [manifest_key(JOB, 90)]
    # Now only tombstones are left (90's, and 150's young one, which the real run keeps):
    # the dry run says what the real run does (found attacking: it said "abandoned" of both).
    again = await apply_retention(gc, JOB, keep_last=2, abandoned_grace_s=GRACE_S, dry_run=True)
    real_again = await apply_retention(gc, JOB, keep_last=2, abandoned_grace_s=GRACE_S)
    for report in (again, real_again):
        assert (report.deleted, report.abandoned_deleted) == ([], [])
        assert [step for step, _ in report.skipped] == [LATE]


@pytest.mark.parametrize("abandoned_at", [b"1e999", b"NaN", b"true", b'"soon"',
                                          b"9" * 400, b"4102444800.0"])
@pytest.mark.asyncio
async def test_a_tombstone_whose_time_is_no_time_ages_by_its_listing(
    tmp_path: Path, abandoned_at: bytes
) -> None:
    # A tombstone written by hand or damaged, with no finite time or one far ahead (2100):
    # its grace counts from when the destination says the key was written, as before the
    # tombstone's own time was read, and retention neither fails nor keeps it for ever.
    d = await _step_90_committed_by_one_node_of_two(tmp_path)
    gc = d.backend("gc")
    await gc.delete(manifest_key(JOB, 90))
    body = b'{"abandoned_at": ' + abandoned_at + b', "kind": "abandoned", "was_committed": true}'
    assert await gc.put_bytes(manifest_key(JOB, 90), body, exclusive=True)
    first = await apply_retention(gc, JOB, keep_last=2, abandoned_grace_s=GRACE_S)
    assert first.failed == [] and first.deleted == [90]
    assert await gc.get_bytes(manifest_key(JOB, 90)) == body  # young by its listing: kept
    later = await apply_retention(gc, JOB, keep_last=2, abandoned_grace_s=GRACE_S,
                                  now=time.time() + 2 * GRACE_S)
    assert later.failed == []
    assert await gc.get_bytes(manifest_key(JOB, 90)) is None


@pytest.mark.asyncio
async def test_a_publish_while_retention_replaces_the_manifest_hears_it_committed(
    tmp_path: Path,
) -> None:
    """The late create reaches the key while retention is about to put its tombstone in the
    manifest's place: the key is never empty, so the create meets the manifest (or the
    tombstone) and its node hears the step committed; retention removes the generation."""
    d = await _step_90_committed_by_one_node_of_two(tmp_path)
    gc = d.backend("gc")
    assert isinstance(gc, MemoryBackend)
    held = gc.hold("put_bytes", key_contains=manifest_key(JOB, 90))
    async with asyncio.TaskGroup() as group:
        removal = group.create_task(apply_retention(gc, JOB, keep_last=2,
                                                    abandoned_grace_s=GRACE_S))
        await held.wait_reached()
        result = await Committer(d.backend("n2"), "n2").try_publish(JOB, 90, 2)
        held.release()
    report = removal.result()

    assert result.outcome is CommitOutcome.ACCEPTED
    assert report.deleted == [90] and report.failed == []
    assert await manifests_over_missing_shards(gc) == []
    assert is_tombstone(await gc.get_bytes(manifest_key(JOB, 90)) or b"")


@pytest.mark.asyncio
async def test_a_run_that_read_the_manifest_before_another_removed_it_keeps_a_tombstone(
    tmp_path: Path,
) -> None:
    """Found attacking retention: run B read generation 90's manifest (beyond keep_last),
    then run A removed 90 (tombstone, part records, shards). B then deleted the manifest key
    (A's tombstone) and, in the moment before its own tombstone, n2's late publish (which had
    checked every shard before A deleted them) created the manifest again: a committed
    manifest over missing shards, which B then kept as "published again". The tombstone now
    replaces the manifest in one write, so the key is never empty."""
    d = await _step_90_committed_by_one_node_of_two(tmp_path)
    publisher, gc_b = d.backend("n2"), d.backend("gcB")
    assert isinstance(publisher, MemoryBackend) and isinstance(gc_b, MemoryBackend)
    key = manifest_key(JOB, 90)
    publishing = publisher.hold("put_bytes", key_contains=key)
    # B's first change to the key after reading it, whichever call it is.
    b_delete = gc_b.hold("delete", key_contains=key)
    b_put = gc_b.hold("put_bytes", key_contains=key)
    async with asyncio.TaskGroup() as group:
        publish = group.create_task(Committer(publisher, "n2").try_publish(JOB, 90, 2))
        await publishing.wait_reached()
        run_b = group.create_task(apply_retention(gc_b, JOB, keep_last=2,
                                                  abandoned_grace_s=GRACE_S))
        first = [group.create_task(b_delete.wait_reached()),
                 group.create_task(b_put.wait_reached())]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        for waiting in first:
            waiting.cancel()
        run_a = await apply_retention(d.backend("gcA"), JOB, keep_last=2,
                                      abandoned_grace_s=GRACE_S)
        b_delete.release()
        await b_put.wait_reached()
        publishing.release()
        await publish
        b_put.release()
        await run_b

    reader = d.backend("reader")
    assert run_a.deleted == [90]
    assert await manifests_over_missing_shards(reader) == []
    assert is_tombstone(await reader.get_bytes(key) or b"")
    assert publish.result().outcome is CommitOutcome.ACCEPTED
    assert 90 not in [g.step for g in await catalog.list_generations(reader, JOB)]


@pytest.mark.asyncio
async def test_with_no_grace_period_the_tombstone_still_stops_a_late_publish(
    tmp_path: Path,
) -> None:
    """Found attacking `gc --grace-s 0`: the run tombstoned the abandoned generation, deleted
    its part records and shards, and removed the tombstone at once (it was "one grace period
    old"); the late node's create, its checks done just before, then found the key empty and
    committed a manifest over the deleted shards, which `ls` listed. The tombstone now stays
    TOMBSTONE_MIN_S whatever the grace period."""
    d = Destination("memory", tmp_path)
    await d.populate()
    publisher = d.backend("n2")
    assert isinstance(publisher, MemoryBackend)
    held = publisher.hold("put_bytes", key_contains=manifest_key(JOB, LATE))
    async with asyncio.TaskGroup() as group:
        publish = group.create_task(Committer(publisher, "n2").try_publish(JOB, LATE, 2))
        await held.wait_reached()
        report = await apply_retention(d.backend("gc"), JOB, keep_last=3, abandoned_grace_s=0)
        held.release()

    reader = d.backend("reader")
    assert report.abandoned_deleted == [LATE]
    assert publish.result().outcome is CommitOutcome.CONFLICT
    assert await manifests_over_missing_shards(reader) == []
    assert [g.step for g in await catalog.list_generations(reader, JOB)] == [200, 100]
    # Kept while young, whatever the grace period; gone once TOMBSTONE_MIN_S old.
    again = await apply_retention(reader, JOB, keep_last=3, abandoned_grace_s=0)
    assert [step for step, _ in again.skipped] == [LATE]
    assert is_tombstone(await reader.get_bytes(manifest_key(JOB, LATE)) or b"")
    later = await apply_retention(reader, JOB, keep_last=3, abandoned_grace_s=0,
                                  now=time.time() + TOMBSTONE_MIN_S + 1)
    assert later.abandoned_deleted == [LATE]
    assert await reader.get_bytes(manifest_key(JOB, LATE)) is None


@pytest.mark.asyncio
async def test_retention_and_a_late_publish_in_any_interleaving(tmp_path: Path) -> None:
    """Both at once, every call of both interleaved differently per seed."""
    outcomes = set()
    for seed in range(200):
        rng = random.Random(seed)
        d = Destination("memory", tmp_path)
        await d.populate()
        head_start = rng.randrange(40)  # the publisher's, so that both orders occur

        async def late_retention(backend: Backend, yields: int) -> RetentionReport:
            for _ in range(yields):
                await asyncio.sleep(0)
            return await retain(backend)

        report, result = await asyncio.gather(
            late_retention(d.backend("gc", rng), head_start),
            Committer(d.backend("n2", rng), "n2").try_publish(JOB, LATE, 2),
        )
        reader = d.backend("reader")
        assert await manifests_over_missing_shards(reader) == [], f"seed {seed}"
        committed = LATE in [g.step for g in await catalog.list_generations(reader, JOB)]
        assert committed == (result.outcome is CommitOutcome.PUBLISHED), f"seed {seed}"
        assert committed != (report.abandoned_deleted == [LATE]), f"seed {seed}"
        if committed:
            assert (await catalog.verify(reader, JOB, LATE)).ok, f"seed {seed}"
        outcomes.add(result.outcome)
    # Both winners occur across the seeds: the test explores both orders. (A publish that
    # finds the part records already gone is INCOMPLETE: it lost too.)
    assert CommitOutcome.PUBLISHED in outcomes and len(outcomes) > 1, outcomes


@pytest.mark.asyncio
async def test_the_tombstone_outlives_the_shards_by_one_grace_period(dest: Destination) -> None:
    gc = dest.backend("gc")
    first = await retain(gc)
    assert first.abandoned_deleted == [LATE]
    prefix = generation_prefix(JOB, LATE)
    left = [i.key for i in await gc.list(prefix)]
    assert left == [manifest_key(JOB, LATE)]
    assert is_tombstone(await gc.get_bytes(manifest_key(JOB, LATE)) or b"")
    # Not a commit for any reader, and a begin of the step is refused.
    assert await catalog.latest(gc, JOB) == 200
    with pytest.raises(StepAbandoned, match="save a new step"):
        await Committer(gc, "gc").is_committed(JOB, LATE)
    # A late publish now fails at its create, whatever records it still holds.
    await drained(dest.backend("n2"), dest.tmp_path, "n2", LATE, 0, 1)
    late = await Committer(dest.backend("n2"), "n2").try_publish(JOB, LATE, 1)
    assert late.outcome is CommitOutcome.CONFLICT and "abandoned" in late.reason

    # Two grace periods on: the shards that late node wrote go, and the tombstone, old now
    # by its own clock too (the grace counts from when it says it was written).
    second = await apply_retention(gc, JOB, keep_last=3, abandoned_grace_s=GRACE_S,
                                   now=time.time() + 2 * GRACE_S)
    assert second.abandoned_deleted == [LATE]
    assert [i.key for i in await gc.list(prefix)] == []
    if dest.kind == "posix":
        assert not (dest.tmp_path / "dest" / prefix).exists()
    assert [g.step for g in await catalog.list_generations(gc, JOB)] == [200, 100]


@pytest.mark.asyncio
async def test_a_young_tombstone_alone_is_kept_and_reported(dest: Destination) -> None:
    gc = dest.backend("gc")
    await retain(gc)
    again = await retain(gc)
    assert again.abandoned_deleted == []
    assert [step for step, _ in again.skipped] == [LATE]
    assert "tombstone stays" in again.skipped[0][1]
    assert [i.key for i in await gc.list(generation_prefix(JOB, LATE))] == [
        manifest_key(JOB, LATE)
    ]


@pytest.mark.asyncio
async def test_an_interrupted_removal_is_finished_by_the_next_run(tmp_path: Path) -> None:
    d = Destination("memory", tmp_path)
    await d.populate()
    gc = d.backend("gc")
    assert isinstance(gc, MemoryBackend)
    gc.inject("delete", BackendError("503 SlowDown", transient=True), key_contains="optim/")
    first = await retain(gc)
    assert [step for step, _ in first.failed] == [LATE]
    # The tombstone went first: nothing can publish the half-removed generation.
    assert is_tombstone(d.store.objects[manifest_key(JOB, LATE)])
    late = await Committer(d.backend("n2"), "n2").try_publish(JOB, LATE, 2)
    assert late.outcome is not CommitOutcome.PUBLISHED

    second = await retain(gc)  # not aged any further: the tombstone says it all
    assert second.abandoned_deleted == [LATE] and second.failed == []
    assert sorted(k for k in d.store.objects if k.startswith(generation_prefix(JOB, LATE))) == [
        manifest_key(JOB, LATE)
    ]


@pytest.mark.asyncio
async def test_a_dry_run_writes_no_tombstone(dest: Destination) -> None:
    gc = dest.backend("gc")
    report = await apply_retention(gc, JOB, keep_last=3, abandoned_grace_s=GRACE_S, dry_run=True)
    assert report.abandoned_deleted == [LATE]
    assert await gc.get_bytes(manifest_key(JOB, LATE)) is None
    assert await gc.get_bytes(latest_key(JOB)) == b"200\n"
