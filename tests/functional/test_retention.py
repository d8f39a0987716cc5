"""Retention and ``ckptdrain gc``: what is kept, what is removed, in which order, and that a
reader never sees a manifest whose shards are gone. On a real directory (POSIX) and on the
recording in-memory fake."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from ckptdrain.client.keys import generation_prefix, latest_key, manifest_key, part_key, shard_key
from ckptdrain.client.manifest import Manifest, PartRecord
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends import posixfs
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.commit import CommitOutcome, Committer
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.keptmanifests import KeptManifests
from ckptdrain.daemon.retention import (
    RetentionReport,
    apply_retention,
    gc,
    group_generations,
    plan_retention,
)
from ckptdrain.daemon.tombstone import is_tombstone
from tests.conftest import fill_up

JOB = "llama"
NODE = "gpu1"
GRACE_S = 600.0
PATHS = ("model/rank0.pt", "optim/rank0.pt", ".metadata")
CKPTDRAIN = str(Path(sys.executable).with_name("ckptdrain"))


class YieldingMemoryBackend(MemoryBackend):
    """The fake, but every call lets other tasks run first, as a network round trip would:
    without it a concurrent reader could never observe a run half-way."""

    async def delete(self, key: str) -> None:
        await asyncio.sleep(0)
        await super().delete(key)

    async def get_bytes(self, key: str, *, max_bytes: int = 64 << 20) -> bytes | None:
        await asyncio.sleep(0)
        return await super().get_bytes(key, max_bytes=max_bytes)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        await asyncio.sleep(0)
        return await super().list(prefix)


@dataclass
class Dest:
    """A destination under test, and hands behind the backend's back."""

    kind: str
    root: Path
    store: MemoryStore
    backends: list[Backend]

    def backend(self, node: str = NODE) -> Backend:
        made: Backend
        if self.kind == "posix":
            made = PosixBackend(DestinationConfig(uri=f"file://{self.root}"), node)
        else:
            made = YieldingMemoryBackend(node, store=self.store)
        self.backends.append(made)
        return made

    def age(self, step: int, by_s: float, job: str = JOB) -> None:
        """Make every object of a generation look ``by_s`` seconds older."""
        prefix = generation_prefix(job, step)
        if self.kind == "posix":
            for dirpath, _dirs, files in os.walk(self.root / prefix):
                for name in files:
                    path = os.path.join(dirpath, name)
                    st = os.stat(path)
                    os.utime(path, (st.st_atime - by_s, st.st_mtime - by_s))
        else:
            for key in self.store.modified:
                if key.startswith(prefix):
                    self.store.modified[key] -= by_s

    def tombstone(self, key: str) -> bool:
        data = (self.root / key).read_bytes() if self.kind == "posix" else self.store.objects[key]
        return is_tombstone(data)

    def all_keys(self) -> list[str]:
        if self.kind == "posix":
            return sorted(
                str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()
            )
        return sorted(self.store.objects)


@pytest_asyncio.fixture(params=["posix", "memory"])
async def dest(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Dest]:
    d = Dest(request.param, tmp_path / "dest", MemoryStore(), [])
    yield d
    for backend in d.backends:
        await backend.aclose()


def shard_bytes(step: int, path: str) -> bytes:
    return hashlib.sha256(f"{step}/{path}".encode()).digest() * (8 + len(path))


async def write_shards(
    backend: Backend, step: int, paths: tuple[str, ...], job: str = JOB
) -> list[ShardEntry]:
    entries = []
    for path in paths:
        data = shard_bytes(step, path)
        await backend.put_bytes(shard_key(job, step, path), data)
        digest = of_bytes(data)
        entries.append(ShardEntry(path, len(data), digest, 0, NODE))
    return entries


async def commit(backend: Backend, step: int, paths: tuple[str, ...] = PATHS, job: str = JOB) -> None:
    """A committed generation, written by the real commit protocol."""
    entries = await write_shards(backend, step, paths, job)
    committer = Committer(backend, NODE)
    clocks = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}
    await committer.record_part(PartRecord(job, step, 1, NODE, (0,), tuple(entries), clocks))
    assert (await committer.try_publish(job, step, 1)).outcome is CommitOutcome.PUBLISHED


async def abandon(backend: Backend, step: int, job: str = JOB) -> None:
    """An uncommitted generation: rank 0 of two drained and recorded, rank 1 never came."""
    entries = await write_shards(backend, step, PATHS[:2], job)
    clocks = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}
    await Committer(backend, NODE).record_part(
        PartRecord(job, step, 2, NODE, (0,), tuple(entries), clocks)
    )


def steps_present(d: Dest, job: str = JOB) -> set[int]:
    """Steps with anything left but the tombstone an abandoned removal keeps at MANIFEST.json
    for one grace period (test_retention_race.py covers its life)."""
    return {
        int(k.split("/")[1])
        for k in d.all_keys()
        if k.startswith(f"{job}/0") and not (k.endswith("/MANIFEST.json") and d.tombstone(k))
    }


async def committed_steps(backend: Backend, job: str = JOB) -> list[int]:
    return [g.step for g in await catalog.list_generations(backend, job)]


async def retain(
    backend: Backend, keep_last: int, *, grace: float = GRACE_S, dry_run: bool = False
) -> RetentionReport:
    return await apply_retention(
        backend, JOB, keep_last=keep_last, abandoned_grace_s=grace, dry_run=dry_run
    )


# --- what is kept ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_keep_last_two_of_five_leaves_exactly_the_newest_two(dest: Dest) -> None:
    backend = dest.backend()
    for step in (100, 200, 300, 400, 500):
        await commit(backend, step)
    await commit(backend, 7, job="other")  # another job is none of this run's business

    report = await retain(backend, 2)

    assert (report.kept, report.deleted, report.abandoned_deleted) == ([500, 400], [300, 200, 100], [])
    assert (report.skipped, report.failed, report.dry_run) == ([], [], False)
    assert await committed_steps(backend) == [500, 400]
    expected = {
        *(shard_key(JOB, s, p) for s in (400, 500) for p in PATHS),
        *(manifest_key(JOB, s) for s in (100, 200, 300, 400, 500)),
        *(part_key(JOB, s, NODE) for s in (400, 500)),
        latest_key(JOB),
    }
    assert {k for k in dest.all_keys() if k.startswith(f"{JOB}/")} == expected
    # What is left of a removed generation, for a grace period, is its tombstone: no late
    # publish of it can commit it again over shards that are gone.
    for step in (100, 200, 300):
        assert dest.tombstone(manifest_key(JOB, step))
    for step in (400, 500):
        assert (await catalog.verify(backend, JOB, step)).ok
    assert await committed_steps(backend, "other") == [7]
    # A second run finds nothing more to do, and says nothing of the tombstones.
    again = await retain(backend, 2)
    assert (again.kept, again.deleted, again.abandoned_deleted) == ([500, 400], [], [])
    assert again.skipped == []


@pytest.mark.asyncio
async def test_a_run_lists_only_the_generations_it_may_remove() -> None:
    """After a commit, retention lists the generation directories and the one generation that
    goes, not the kept generations' shards (a 10,000-shard job with keep_last = 3 listed 40,000
    keys per commit, on every node), and reads only the kept generations' manifests."""
    store = MemoryStore()
    backend = MemoryBackend(NODE, store=store)
    many = tuple(f"model/rank{r}.pt" for r in range(40))
    for step in (1, 2, 3):
        await commit(backend, step, many)
    await commit(backend, 5, many, job="other")  # another job is never listed
    assert (await retain(backend, 3)).deleted == []
    await commit(backend, 4, many)
    await abandon(backend, 6)  # in flight: newer than the newest commit, never listed
    store.calls.clear()

    report = await retain(backend, 3)

    assert (report.kept, report.deleted) == ([4, 3, 2], [1])
    calls = [(op, key) for _node, op, key in store.calls]
    assert [c for c in calls if c[0] in ("list", "list_dirs")] == [
        ("list_dirs", f"{JOB}/"), ("list", generation_prefix(JOB, 1))]
    reads = [key for op, key in calls if op == "get_bytes"]
    assert reads[:4] == [manifest_key(JOB, s) for s in (6, 4, 3, 2)]
    assert manifest_key(JOB, 1) not in reads[:4]
    # Shards and the part record deleted; the manifest replaced by its tombstone.
    assert len([k for op, k in calls if op == "delete"]) == len(many) + 1
    await backend.aclose()


@pytest.mark.asyncio
async def test_kept_manifests_found_valid_before_are_checked_by_a_stat_not_read_again() -> None:
    """Each commit's run validated the newest keep_last manifests by reading and parsing them
    (1.4 MB and 83 ms each for 10,000 shards), the ones the run before had just validated
    included. Remembered (size, write time) and a stat stand for them now; one that changed
    or went is read again, and never counted valid unread."""
    store = MemoryStore()
    backend = MemoryBackend(NODE, store=store)
    kept = KeptManifests(min_bytes=0)  # remember every manifest, small ones included
    for step in (1, 2, 3):
        await commit(backend, step)
    first = await apply_retention(backend, JOB, keep_last=3, abandoned_grace_s=GRACE_S, kept=kept)
    assert first.kept == [3, 2, 1]
    await commit(backend, 4)
    store.calls.clear()

    report = await apply_retention(backend, JOB, keep_last=3, abandoned_grace_s=GRACE_S,
                                   kept=kept)

    assert (report.kept, report.deleted) == ([4, 3, 2], [1])
    reads = [k for _n, op, k in store.calls if op == "get_bytes" and k.endswith("MANIFEST.json")]
    assert reads == [manifest_key(JOB, 4), manifest_key(JOB, 1)]  # 4 new; 1's tombstone check
    stats = [k for _n, op, k in store.calls if op == "stat"]
    assert stats == [manifest_key(JOB, s) for s in (4, 3, 2)]  # 4 remembered; 3 and 2 checked

    # Step 3's manifest replaced by something else, step 2's gone: both read again, and
    # neither counted valid.
    store.objects[manifest_key(JOB, 3)] = b"{not a manifest"
    del store.objects[manifest_key(JOB, 2)]
    store.calls.clear()
    again = await apply_retention(backend, JOB, keep_last=3, abandoned_grace_s=GRACE_S,
                                  kept=kept)
    reads = [k for _n, op, k in store.calls if op == "get_bytes" and k.endswith("MANIFEST.json")]
    assert manifest_key(JOB, 3) in reads and manifest_key(JOB, 2) in reads
    assert again.kept == [4] and 3 in [step for step, _ in again.skipped]
    await backend.aclose()


@pytest.mark.asyncio
async def test_remembering_a_manifest_neither_hashes_it_nor_writes_to_a_full_destination(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On POSIX a stat with its checksum hashes a file that has none recorded (a manifest has
    none) and records it in an xattr, which a full destination refuses: the shortcut failed
    the whole run there, and retention, the one thing that frees space, never ran. It asks
    for size and time only now; and a stat that fails only means reading the manifest."""
    backend = PosixBackend(DestinationConfig(uri=f"file://{tmp_path / 'dest'}"), NODE)
    for step in (1, 2, 3):
        await commit(backend, step)
    hashed: list[int] = []
    real_hash = posixfs.hash_file

    def recording_hash(fd: int, stop: threading.Event) -> str:
        hashed.append(fd)
        return real_hash(fd, stop)

    def full(self: object, fd: int, checksum: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    kept = KeptManifests(min_bytes=0)

    async def retain_on_a_full_destination() -> RetentionReport:
        with monkeypatch.context() as full_now:  # the commits before it had room
            full_now.setattr(posixfs, "hash_file", recording_hash)
            full_now.setattr(posixfs.ChecksumXattr, "record", full)
            return await apply_retention(backend, JOB, keep_last=2, abandoned_grace_s=GRACE_S,
                                         kept=kept)

    first = await retain_on_a_full_destination()
    assert (first.kept, first.deleted, hashed) == ([3, 2], [1], [])
    await commit(backend, 4)
    again = await retain_on_a_full_destination()
    assert (again.kept, again.deleted, hashed) == ([4, 3], [2], [])
    await backend.aclose()

    memory = MemoryBackend(NODE)
    for step in (1, 2, 3):
        await commit(memory, step)
    kept = KeptManifests(min_bytes=0)
    await apply_retention(memory, JOB, keep_last=3, abandoned_grace_s=GRACE_S, kept=kept)
    memory.inject("stat", BackendError("503 SlowDown", transient=True), key_contains="MANIFEST")
    await commit(memory, 4)
    report = await apply_retention(memory, JOB, keep_last=3, abandoned_grace_s=GRACE_S,
                                   kept=kept)
    assert (report.kept, report.deleted) == ([4, 3, 2], [1])
    await memory.aclose()


@pytest.mark.asyncio
async def test_directories_left_without_keys_go_once_they_are_old(tmp_path: Path) -> None:
    """A removal killed after its unlinks but before its directories went, or a generation
    that made its directories and never wrote a shard, left directories with no key: every
    later run listed them and found nothing to do, for good. They go now, once unchanged for
    the grace period, never through a link and never the job's own directory."""
    root = tmp_path / "dest"
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), NODE)
    for step in (1, 2, 3):
        await commit(backend, step)
    job = root / JOB
    for step in (1, 2):  # 1 and 2: their keys gone, their directories left behind
        for info in await backend.list(generation_prefix(JOB, step)):
            (root / info.key).unlink()
    (job / f"{1:020d}" / "optim" / "deeper").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (job / f"{2:020d}" / "model" / "link").symlink_to(elsewhere)  # planted: never followed
    assert sorted(p.name for p in job.iterdir() if p.is_dir()) == [f"{s:020d}" for s in (1, 2, 3)]

    young = await apply_retention(backend, JOB, keep_last=1, abandoned_grace_s=GRACE_S)
    assert young.kept == [3] and (job / f"{1:020d}").is_dir()  # changed within the grace
    later = time.time() + 2 * GRACE_S
    foreseen = await apply_retention(backend, JOB, keep_last=1, abandoned_grace_s=GRACE_S,
                                     now=later, dry_run=True)
    assert (job / f"{1:020d}" / "optim" / "deeper").is_dir()
    old = await apply_retention(backend, JOB, keep_last=1, abandoned_grace_s=GRACE_S, now=later)

    assert old.kept == [3]
    # 1 went and says so, as its dry run did; 2 holds a link, and stays.
    assert young.abandoned_deleted == [] and foreseen.abandoned_deleted == old.abandoned_deleted == [1]
    assert not (job / f"{1:020d}").exists()
    assert (job / f"{2:020d}" / "model" / "link").is_symlink() and elsewhere.is_dir()
    assert not (job / f"{2:020d}" / "optim").exists()  # its empty siblings went
    assert (job / f"{3:020d}" / "MANIFEST.json").is_file() and job.is_dir()
    await backend.aclose()


@pytest.mark.asyncio
async def test_manifest_goes_before_part_records_before_shards(tmp_path: Path) -> None:
    store = MemoryStore()
    backend = MemoryBackend(NODE, store=store)
    for step in (10, 20, 30, 40):
        await commit(backend, step)
    await abandon(backend, 15)
    for key in list(store.modified):
        store.modified[key] -= 2 * GRACE_S
    store.calls.clear()

    report = await retain(backend, 1)

    assert (report.deleted, report.abandoned_deleted) == ([30, 20, 10], [15])
    changes = [(op, key) for _node, op, key in store.calls if op in ("delete", "put_bytes")]
    for step in report.deleted:
        prefix = generation_prefix(JOB, step)
        mine = [(op, k) for op, k in changes if k.startswith(prefix)]
        # The manifest is replaced by its tombstone in one write (the key is never empty),
        # and only then do the others go.
        assert mine[0] == ("put_bytes", manifest_key(JOB, step)), mine
        assert all(op == "delete" for op, _ in mine[1:]), mine
        kinds = ["manifest" if k.endswith("MANIFEST.json") else "part" if "/_parts/" in k
                 else "shard" for _, k in mine]
        # One manifest, then every part record, then every shard: never a shard first.
        assert kinds == sorted(kinds, key=["manifest", "part", "shard"].index)
        assert kinds.count("shard") == len(PATHS)
    # An abandoned generation first takes its manifest key for a tombstone (an exclusive
    # create: from then on no node can publish it), and only then loses its part records and
    # its shards; the tombstone itself stays for a grace period.
    calls = [(op, key) for _node, op, key in store.calls]
    prefix = generation_prefix(JOB, 15)
    abandoned_calls = [(op, key) for op, key in calls if key.startswith(prefix)]
    assert abandoned_calls == [
        ("list", prefix),  # the generation is listed (the run deletes what it lists)
        ("put_bytes", manifest_key(JOB, 15)),
        ("delete", part_key(JOB, 15, NODE)),
        *(("delete", shard_key(JOB, 15, p)) for p in sorted(PATHS[:2])),
    ]
    await backend.aclose()


@pytest.mark.asyncio
async def test_newest_committed_is_never_deleted_and_newer_uncommitted_is_untouched(
    dest: Dest,
) -> None:
    backend = dest.backend()
    await commit(backend, 100)
    await abandon(backend, 200)  # newer than anything committed: maybe still draining
    dest.age(100, 10 * GRACE_S)
    dest.age(200, 10 * GRACE_S)
    before = dest.all_keys()

    report = await retain(backend, 1, grace=0.0)

    assert report.kept == [100]
    assert (report.deleted, report.abandoned_deleted) == ([], [])
    assert [step for step, _ in report.skipped] == [200]
    assert "in flight" in report.skipped[0][1]
    assert dest.all_keys() == before
    assert await catalog.latest(backend, JOB) == 100


@pytest.mark.asyncio
async def test_abandoned_generations_go_only_after_the_grace_period(dest: Dest) -> None:
    backend = dest.backend()
    await commit(backend, 100)
    await abandon(backend, 150)  # a node died: no manifest will ever come
    await commit(backend, 200)
    await abandon(backend, 300)  # newer than the newest committed: in flight

    early = await retain(backend, 3)
    assert early.abandoned_deleted == []
    assert {step for step, _ in early.skipped} == {150, 300}
    assert steps_present(dest) == {100, 150, 200, 300}

    dest.age(150, 2 * GRACE_S)
    dest.age(300, 2 * GRACE_S)
    late = await retain(backend, 3)

    assert (late.kept, late.deleted, late.abandoned_deleted) == ([200, 100], [], [150])
    assert [step for step, _ in late.skipped] == [300]
    assert steps_present(dest) == {100, 200, 300}
    assert {k for k in dest.all_keys() if k.startswith(generation_prefix(JOB, 300))} == {
        shard_key(JOB, 300, PATHS[0]),
        shard_key(JOB, 300, PATHS[1]),
        part_key(JOB, 300, NODE),
    }
    assert await committed_steps(backend) == [200, 100]


@pytest.mark.asyncio
async def test_a_damaged_manifest_is_not_counted_and_is_kept_for_inspection(dest: Dest) -> None:
    backend = dest.backend()
    for step in (100, 200, 300):
        await commit(backend, step)
    await write_shards(backend, 400, PATHS)
    await backend.put_bytes(manifest_key(JOB, 400), b"{not json")

    report = await retain(backend, 2)

    # 400 is not a committed generation: the newest two valid ones are kept, 400 stays.
    assert (report.kept, report.deleted) == ([300, 200], [100])
    assert [step for step, _ in report.skipped] == [400]
    assert "inspection" in report.skipped[0][1]
    assert steps_present(dest) == {200, 300, 400}


@pytest.mark.asyncio
async def test_latest_naming_a_removed_generation_is_raised_to_the_newest(dest: Dest) -> None:
    backend = dest.backend()
    for step in (100, 200, 300):
        await commit(backend, step)
    # A LATEST that lagged (two commits raced) and now names what retention removes.
    await backend.put_bytes(latest_key(JOB), b"100\n")

    await retain(backend, 2)

    assert await backend.get_bytes(latest_key(JOB)) == b"300\n"
    # A hint naming a kept generation is left as it is.
    await backend.put_bytes(latest_key(JOB), b"200\n")
    await commit(backend, 400)  # raises LATEST to 400 itself
    await backend.put_bytes(latest_key(JOB), b"300\n")
    await retain(backend, 2)
    assert await backend.get_bytes(latest_key(JOB)) == b"300\n"


@pytest.mark.asyncio
async def test_dry_run_reports_and_removes_nothing(dest: Dest) -> None:
    backend = dest.backend()
    for step in (100, 200, 300):
        await commit(backend, step)
    await abandon(backend, 250)
    dest.age(250, 2 * GRACE_S)
    before = dest.all_keys()
    if isinstance(backend, MemoryBackend):
        backend.calls.clear()

    report = await retain(backend, 1, dry_run=True)

    assert report.dry_run
    assert (report.kept, report.deleted, report.abandoned_deleted) == ([300], [200, 100], [250])
    assert dest.all_keys() == before
    if isinstance(backend, MemoryBackend):
        assert backend.count("delete") == 0 and backend.count("put_bytes") == 0


@pytest.mark.asyncio
async def test_a_key_the_destination_cannot_address_fails_only_its_generation() -> None:
    """A key another tool wrote under an old generation that the backend refuses to address
    (S3Backend raises ValueError for ``a//b``) failed the whole run, every run after it, with
    the older generations and LATEST's repair behind it. Now only that generation fails."""
    backend = MemoryBackend(NODE)
    for step in (100, 200, 300, 400):
        await commit(backend, step)
    await backend.put_bytes(latest_key(JOB), b"100\n")  # a hint lagging behind
    backend.inject("delete", ValueError("'llama//x' is not a relative key"),
                   key_contains="00200/")

    report = await retain(backend, 1)

    assert report.deleted == [300, 100]
    assert [step for step, _ in report.failed] == [200]
    assert "cannot address" in report.failed[0][1]
    assert await backend.get_bytes(latest_key(JOB)) == b"400\n"  # repaired all the same
    await backend.aclose()


@pytest.mark.asyncio
async def test_a_failed_delete_is_reported_and_the_next_run_finishes(tmp_path: Path) -> None:
    backend = MemoryBackend(NODE)
    for step in (100, 200, 300):
        await commit(backend, step)
    backend.inject("delete", BackendError("503 SlowDown", transient=True), key_contains="00200/")

    first = await retain(backend, 1)

    assert first.deleted == [100]
    assert [step for step, _ in first.failed] == [200]
    assert "next run" in first.failed[0][1]
    second = await retain(backend, 1)
    assert second.failed == []
    assert 200 in second.deleted + second.abandoned_deleted
    left = {k for k in backend.objects if k.startswith(f"{JOB}/0")}
    assert {k.split("/")[1] for k in left} == {f"{s:020d}" for s in (100, 200, 300)}
    for step in (100, 200):  # their tombstones alone
        assert {k for k in left if k.split("/")[1] == f"{step:020d}"} == {manifest_key(JOB, step)}
        assert is_tombstone(backend.objects[manifest_key(JOB, step)])


@pytest.mark.asyncio
async def test_bad_arguments_are_refused() -> None:
    backend = MemoryBackend(NODE)
    with pytest.raises(ValueError, match="keep_last"):
        await apply_retention(backend, JOB, keep_last=0, abandoned_grace_s=1.0)
    with pytest.raises(ValueError, match="abandoned_grace_s"):
        await apply_retention(backend, JOB, keep_last=1, abandoned_grace_s=-1.0)
    with pytest.raises(ManifestError):
        await apply_retention(backend, "../etc", keep_last=1, abandoned_grace_s=1.0)
    assert backend.count("list") == 0


def test_plan_with_fewer_valid_generations_than_keep_last_removes_no_committed_one() -> None:
    listing = [
        ObjectInfo(manifest_key(JOB, 1), 10, 100.0),
        ObjectInfo(shard_key(JOB, 1, "a"), 10, 100.0),
        ObjectInfo(manifest_key(JOB, 2), 10, 200.0),
        ObjectInfo(shard_key(JOB, 3, "a"), 10, None),  # a store that reports no write time
        ObjectInfo(latest_key(JOB), 2, 300.0),
    ]
    generations = group_generations(JOB, listing)
    assert sorted(generations) == [1, 2, 3]
    assert [generations[s].has_manifest for s in (1, 2, 3)] == [True, True, False]

    # Step 2's manifest is damaged; only step 1 is valid, and keep_last is 3.
    plan = plan_retention(
        generations, [1], {2: "unreadable: not JSON"}, keep_last=3, abandoned_grace_s=0.0, now=1e9
    )
    assert (plan.kept, plan.delete_committed, plan.delete_abandoned) == ([1], [], [])
    assert [step for step, _ in plan.skipped] == [3, 2]
    assert "in flight" in plan.skipped[0][1] and "not JSON" in plan.skipped[1][1]

    # With step 2 valid and an older uncommitted step whose write time is unknown.
    older = group_generations(JOB, [*listing, ObjectInfo(shard_key(JOB, 0, "a"), 1, None)])
    plan = plan_retention(older, [2, 1], {}, keep_last=1, abandoned_grace_s=0.0, now=1e9)
    assert (plan.kept, plan.delete_committed, plan.newest_committed) == ([2], [1], 2)
    assert plan.skipped[-1] == (0, "uncommitted, but the destination does not report write times")


# --- concurrency ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_two_nodes_running_retention_at_once_agree(dest: Dest) -> None:
    a, b = dest.backend("node-a"), dest.backend("node-b")
    for step in (100, 200, 300, 400, 500, 600):
        await commit(a, step)
    await abandon(a, 350)
    await abandon(a, 700)
    dest.age(350, 2 * GRACE_S)
    dest.age(700, 2 * GRACE_S)

    ra, rb = await asyncio.gather(retain(a, 2), retain(b, 2))

    for report in (ra, rb):
        assert report.failed == []
        assert report.kept == [600, 500]
    # Between them, everything old went (each may have found some of it already gone).
    assert set(ra.deleted) | set(rb.deleted) | set(ra.abandoned_deleted) | set(
        rb.abandoned_deleted
    ) >= {100, 200, 300, 400, 350}
    assert steps_present(dest) == {500, 600, 700}
    assert await committed_steps(a) == [600, 500]
    for step in (500, 600):
        assert (await catalog.verify(b, JOB, step)).ok
    assert await catalog.latest(b, JOB) == 600


@pytest.mark.asyncio
async def test_a_reader_never_sees_a_manifest_whose_shards_are_gone_memory() -> None:
    store = MemoryStore()
    backend = YieldingMemoryBackend(NODE, store=store)
    reader_backend = YieldingMemoryBackend("reader", store=store)
    paths = tuple(f"model/rank0-{i}.pt" for i in range(12))
    for step in range(1, 9):
        await commit(backend, step, paths)
    done = asyncio.Event()
    seen = Observed()

    async def reader() -> None:
        while True:  # at least one full pass, however fast retention is
            finished = done.is_set()
            await check_committed(reader_backend, seen)
            await asyncio.sleep(0)
            if finished:
                return

    async with asyncio.TaskGroup() as group:
        task = group.create_task(reader())
        report = await retain(backend, 2)
        done.set()
        await asyncio.wait_for(task, 30)

    assert report.deleted == [6, 5, 4, 3, 2, 1]
    assert seen.violations == []
    assert seen.manifests_checked > 0
    # The reader ran while generations were half removed (manifest gone, shards still there).
    assert seen.half_removed > 0


@dataclass
class Observed:
    manifests_checked: int = 0
    half_removed: int = 0
    violations: list[str] = field(default_factory=list)


async def check_committed(backend: Backend, seen: Observed) -> None:
    """One reader pass: every listed manifest's shards must exist, unless the manifest itself
    is gone by the time a missing shard is noticed (retention removed it first)."""
    listed = {info.key for info in await backend.list(f"{JOB}/")}
    with_shards = {k.split("/")[1] for k in listed
                   if "/" in k and not k.endswith("/MANIFEST.json")} - {"LATEST"}
    for name in with_shards:  # shards there, and no manifest (gone, or a tombstone)
        data = await backend.get_bytes(f"{JOB}/{name}/MANIFEST.json")
        seen.half_removed += data is None or is_tombstone(data)
    for generation in await catalog.list_generations(backend, JOB):
        manifest = await catalog.read_manifest(backend, JOB, generation.step)
        if manifest is None:
            continue  # removed since the listing: nothing to check
        seen.manifests_checked += 1
        prefix = generation_prefix(JOB, generation.step)
        present = {info.key for info in await backend.list(prefix)}
        missing = [s.path for s in manifest.shards if prefix + s.path not in present]
        if missing and await backend.get_bytes(manifest_key(JOB, generation.step)) is not None:
            seen.violations.append(f"generation {generation.step} lists missing {missing}")


@pytest.mark.asyncio
async def test_a_reader_never_sees_a_manifest_whose_shards_are_gone_posix(tmp_path: Path) -> None:
    root = tmp_path / "dest"
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), NODE)
    paths = tuple(f"model/rank0-{i}.pt" for i in range(24))
    for step in range(1, 9):
        await commit(backend, step, paths)
    done = threading.Event()
    violations: list[str] = []
    checked = [0]

    def reader() -> None:
        # A restart script reading the directory by hand, as docs/layout.md describes.
        while True:  # at least one full pass, however fast retention is
            finished = done.is_set()
            for manifest_path in sorted((root / JOB).glob("*/MANIFEST.json")):
                try:
                    manifest = Manifest.from_json(manifest_path.read_bytes())
                except (FileNotFoundError, ManifestError):  # gone, or a tombstone
                    continue
                checked[0] += 1
                gen_dir = manifest_path.parent
                missing = [s.path for s in manifest.shards if not (gen_dir / s.path).exists()]
                if missing and manifest_path.exists():
                    violations.append(f"{gen_dir.name} lists missing {missing}")
            if finished:
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        report = await retain(backend, 2)
    finally:
        done.set()
        await asyncio.to_thread(thread.join, 30)
        await backend.aclose()
    assert not thread.is_alive()
    assert report.deleted == [6, 5, 4, 3, 2, 1]
    assert violations == []
    assert checked[0] > 0
    assert sorted(p.parent.name for p in (root / JOB).glob("*/MANIFEST.json")
                  if not is_tombstone(p.read_bytes())) == [f"{7:020d}", f"{8:020d}"]


class RemovedWhileRead(PosixBackend):
    """A POSIX destination where retention (``keep_last = 1``, another node's run) removes
    generation ``step`` the moment a reader first reads one of its shards' bytes."""

    step = 1
    removal: RetentionReport | None = None
    _ran = False

    async def _retention_first(self, key: str) -> None:
        # Claimed before the run: a verify checks shards concurrently, and two reads that both
        # saw no run yet ran retention twice, the second reporting the generation the first
        # had removed as abandoned (seen in CI).
        if key.startswith(generation_prefix(JOB, self.step)) and not self._ran:
            self._ran = True
            other = PosixBackend(DestinationConfig(uri=self.uri), "gpu2")
            try:
                self.removal = await retain(other, 1)
            finally:
                await other.aclose()

    async def copy_into(self, key: str, *args: object, **kw: object) -> tuple[int, str]:
        await self._retention_first(key)
        return await super().copy_into(key, *args, **kw)  # type: ignore[arg-type]

    async def read_chunks(self, key: str, **kw: int) -> AsyncIterator[bytes]:  # type: ignore[override]
        await self._retention_first(key)
        async for chunk in super().read_chunks(key, **kw):
            yield chunk


@pytest.mark.asyncio
async def test_a_restore_or_verify_retention_overtakes_says_so(tmp_path: Path) -> None:
    # Found attacking: retention puts a tombstone at a committed generation's MANIFEST.json
    # right after deleting its manifest, before the shards go. A restore that lost the race
    # took the key's mere presence for the manifest and said "the generation at the
    # destination is damaged: restore an older generation" (retention removes the older
    # ones first), and a verify reported its shards missing with the same advice.
    from ckptdrain.daemon.restore import RestoreError, restore

    root = tmp_path / "dest"
    writer = PosixBackend(DestinationConfig(uri=f"file://{root}"), NODE)
    await commit(writer, 1)
    await commit(writer, 2)
    await writer.aclose()

    reader = RemovedWhileRead(DestinationConfig(uri=f"file://{root}"), NODE)
    try:
        with pytest.raises(RestoreError) as restored:
            await restore(reader, JOB, 1, tmp_path / "restored")
        assert reader.removal is not None and reader.removal.deleted == [1]
        assert "removed while it was restored" in str(restored.value), restored.value
        assert "damaged" not in str(restored.value)
    finally:
        await reader.aclose()

    await commit(writer := PosixBackend(DestinationConfig(uri=f"file://{root}"), NODE), 3)
    await writer.aclose()
    reader = RemovedWhileRead(DestinationConfig(uri=f"file://{root}"), NODE)
    reader.step = 2
    try:
        with pytest.raises(catalog.NotCommitted) as verified:
            await catalog.verify(reader, JOB, 2)
        assert reader.removal is not None and reader.removal.deleted == [2]
        assert "removed while it was verified" in str(verified.value), verified.value
    finally:
        await reader.aclose()


@pytest.mark.asyncio
async def test_gc_covers_every_job_with_a_committed_generation() -> None:
    backend = MemoryBackend(NODE)
    for job in ("a", "b"):
        for step in (1, 2, 3):
            await commit(backend, step, job=job)
    reports = await gc(backend, None, 1, GRACE_S, False)
    assert [(r.job, r.kept, r.deleted) for r in reports] == [("a", [3], [2, 1]), ("b", [3], [2, 1])]
    only = await gc(backend, ["a"], 1, GRACE_S, True)
    assert [(r.job, r.deleted, r.dry_run) for r in only] == [("a", [], True)]


# --- ckptdrain gc ---------------------------------------------------------------------------


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
    clean.update(env)
    return subprocess.run(
        [CKPTDRAIN, *args], capture_output=True, text=True, env=clean, timeout=60, check=False
    )


def populate(root: Path) -> None:
    async def build() -> None:
        backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), NODE)
        try:
            for step in (100, 200, 300, 400):
                await commit(backend, step)
            await abandon(backend, 150)
        finally:
            await backend.aclose()

    asyncio.run(build())
    old = time.time() - 2 * GRACE_S
    for path in (root / generation_prefix(JOB, 150)).rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))


def files_of(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_gc_command_dry_run_then_for_real(tmp_path: Path) -> None:
    root = tmp_path / "dest"
    populate(root)
    before = files_of(root)
    uri = f"file://{root}"

    dry = run_cli("gc", uri, "--keep-last", "2", "--grace-s", str(GRACE_S), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    [report] = json.loads(dry.stdout)
    assert report["dry_run"] is True
    assert (report["job"], report["kept"], report["deleted"]) == (JOB, [400, 300], [200, 100])
    assert report["abandoned_deleted"] == [150]
    assert files_of(root) == before

    text = run_cli("gc", uri, "--keep-last", "2", "--grace-s", str(GRACE_S), "--dry-run")
    assert text.returncode == 0, text.stderr
    assert "would delete 200, 100" in text.stdout

    real = run_cli("gc", uri, "--keep-last", "2", "--grace-s", str(GRACE_S))
    assert real.returncode == 0, real.stderr
    assert f"job {JOB}: kept 400, 300; deleted 200, 100; deleted abandoned 150" in real.stdout
    listed = run_cli("ls", uri, "--json")
    assert [row["generation"] for row in json.loads(listed.stdout)] == [400, 300]
    # Found attacking retention: `ls` warned "ignoring ...MANIFEST.json: manifest lacks
    # clocks, nodes, ..." of each tombstone, every time, for a grace period.
    assert listed.stderr == ""
    assert {int(name) for name in {f.split("/")[1] for f in files_of(root)} - {"LATEST"}} == {
        100,
        150,
        200,
        300,
        400,
    }
    for step in (100, 200):  # the removed committed ones: their tombstones alone
        assert {f for f in files_of(root) if f.split("/")[1] == f"{step:020d}"} == {
            manifest_key(JOB, step)}
    # All that is left of 150 is its tombstone, until it is a grace period old.
    abandoned = root / JOB / f"{150:020d}"
    assert [p.name for p in abandoned.rglob("*") if p.is_file()] == ["MANIFEST.json"]
    assert is_tombstone((abandoned / "MANIFEST.json").read_bytes())


def test_gc_command_takes_its_defaults_from_the_config(tmp_path: Path) -> None:
    root = tmp_path / "dest"
    populate(root)
    uri = f"file://{root}"

    result = run_cli(
        "gc", uri, "--job", JOB, "--json",
        CKPTDRAIN_RETENTION__KEEP_LAST="3",
        CKPTDRAIN_RETENTION__ABANDONED_GRACE_S=str(10 * GRACE_S),
    )

    assert result.returncode == 0, result.stderr
    [report] = json.loads(result.stdout)
    assert (report["kept"], report["deleted"], report["abandoned_deleted"]) == ([400, 300, 200], [100], [])
    assert (report["keep_last"], report["abandoned_grace_s"]) == (3, 10 * GRACE_S)
    assert [step for step, in ((s["generation"],) for s in report["skipped"])] == [150]


def test_gc_command_refuses_bad_usage(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'dest'}"
    zero = run_cli("gc", uri, "--keep-last", "0")
    assert zero.returncode == 2
    assert "--keep-last must be at least 1" in zero.stderr
    assert "Traceback" not in zero.stderr
    job = run_cli("gc", uri, "--job", "../x")
    assert job.returncode == 2
    assert "--job" in job.stderr and "Traceback" not in job.stderr
    missing = run_cli("gc", uri)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    (tmp_path / "dest").mkdir()
    empty = run_cli("gc", uri)
    assert empty.returncode == 0, empty.stderr
    assert "nothing to do" in empty.stdout
    bad_config = run_cli("gc", uri, CKPTDRAIN_RETENTION__KEEP_LAST="0")
    assert bad_config.returncode == 78
    assert "keep_last" in bad_config.stderr



def _age(directory: Path) -> None:
    """Everything under ``directory`` written two grace periods ago (links left as they are)."""
    old = time.time() - 2 * GRACE_S
    for path in [*directory.rglob("*"), directory]:
        os.utime(path, (old, old), follow_symlinks=False)


def _gc_twice(uri: str, keep_last: int) -> list[subprocess.CompletedProcess[str]]:
    """A dry run, then two real runs, each as text."""
    args = ("gc", uri, "--keep-last", str(keep_last), "--grace-s", str(GRACE_S))
    return [run_cli(*args, "--dry-run"), run_cli(*args), run_cli(*args)]


@pytest.mark.parametrize("keep_last", [1, 4])
def test_a_manifest_that_is_a_link_in_an_old_generation_is_left_and_said_so(
        tmp_path: Path, keep_last: int) -> None:
    """Found attacking: a MANIFEST.json that is a symbolic link in a generation older than the
    kept ones made every `gc` (--dry-run too) exit 1 with "removal interrupted ... the next run
    retries it", run after run, with --keep-last 1; with --keep-last 3 the same destination
    (which read it) said "left 1: manifest not usable", exit 0. It is left alone, said so, exit 0, either way."""
    root = tmp_path / "dest"
    populate(root)
    manifest = root / manifest_key(JOB, 100)
    planted = tmp_path / "elsewhere.json"
    manifest.rename(planted)
    manifest.symlink_to(planted)
    _age(root / generation_prefix(JOB, 100))
    shards = {f for f in files_of(root) if f.startswith(generation_prefix(JOB, 100))}

    for out in _gc_twice(f"file://{root}", keep_last):
        assert out.returncode == 0, out.stderr
        assert "left 100: manifest not usable" in out.stdout and "symbolic link" in out.stdout
        assert "FAILED" not in out.stderr and "retries" not in out.stdout + out.stderr
        assert "Traceback" not in out.stderr
    assert manifest.is_symlink() and planted.is_file()
    assert {f for f in files_of(root) if f.startswith(generation_prefix(JOB, 100))} == shards


def test_gc_dry_run_foresees_the_empty_directories_the_real_run_removes(tmp_path: Path) -> None:
    """Found attacking: an old generation directory holding only empty directories was
    removed by `gc`, which said "deleted none", after `gc --dry-run` said "would delete none"."""
    root = tmp_path / "dest"
    populate(root)
    empty = root / generation_prefix(JOB, 50)
    (empty / "a" / "b").mkdir(parents=True)
    _age(empty)
    uri = f"file://{root}"
    args = ("gc", uri, "--keep-last", "2", "--grace-s", str(GRACE_S), "--json")

    dry = run_cli(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert empty.is_dir()
    real = run_cli(*args)
    assert real.returncode == 0, real.stderr
    assert not empty.exists()
    [foreseen], [done] = json.loads(dry.stdout), json.loads(real.stdout)
    assert foreseen["abandoned_deleted"] == done["abandoned_deleted"] == [150, 50]


def test_a_manifest_key_that_is_no_regular_file_is_left_with_its_shards(tmp_path: Path) -> None:
    """Found attacking: with a FIFO at an old generation's MANIFEST.json, `gc` said "deleted
    abandoned" and removed its shards without a tombstone at the manifest key first (it could
    not create one there and read the FIFO as no key at all); the FIFO stayed and no later run
    mentioned it. Such a key (a FIFO, a directory) is no commit and takes no tombstone: the
    generation is left whole and said so, by the dry run too, on every run."""
    root = tmp_path / "dest"
    populate(root)
    fifo, directory = root / manifest_key(JOB, 100), root / manifest_key(JOB, 200)
    fifo.unlink()
    os.mkfifo(fifo)
    directory.unlink()
    directory.mkdir()
    for step in (100, 200):
        _age(root / generation_prefix(JOB, step))
    before = files_of(root)

    for out in _gc_twice(f"file://{root}", 2):
        assert out.returncode == 0, out.stderr
        for step in (100, 200):
            assert f"left {step}: manifest not usable" in out.stdout, out.stdout
        assert "not a regular file" in out.stdout
        assert "deleted 200" not in out.stdout and "abandoned 100" not in out.stdout
        assert "Traceback" not in out.stderr
    # Only the abandoned 150 went (its tombstone stays the grace period).
    assert {f for f in before - files_of(root)} == {
        f for f in before if f.startswith(generation_prefix(JOB, 150))} - {manifest_key(JOB, 150)}
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and directory.is_dir()


@pytest.mark.asyncio
async def test_a_destination_too_full_for_the_tombstone_still_frees_its_old_generations(
    small_tmpfs: Path,
) -> None:
    """The tombstone replacing a committed generation's manifest in one write needs room
    beside it: on a destination with none, every run failed "the destination is full" and
    could free nothing (found attacking the one write). The manifest then goes first, making
    the room, as before."""
    backend = PosixBackend(DestinationConfig(uri=f"file://{small_tmpfs / 'dest'}"), NODE)
    try:
        for step in (1, 2, 3):
            await commit(backend, step)
        fill_up(small_tmpfs)
        report = await retain(backend, 1)
        assert (report.deleted, report.failed) == ([2, 1], [])
        for step in (1, 2):
            assert is_tombstone(await backend.get_bytes(manifest_key(JOB, step)) or b"")
        assert await committed_steps(backend) == [3]
        assert (await catalog.verify(backend, JOB, 3)).ok
    finally:
        await backend.aclose()
