"""The read side: listing committed generations, latest, verify and restore, on a real
directory (POSIX) and on the in-memory fake."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.client.keys import latest_key, manifest_key, shard_key
from ckptdrain.client.manifest import TMP_SUFFIX, Manifest, PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.commit import CommitOutcome, Committer
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.restore import RestoreError, restore

JOB = "llama"
Corrupt = Callable[[str, bytes], None]


@pytest_asyncio.fixture(params=["posix", "memory"])
async def dest(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Backend, Corrupt]]:
    """A backend, and a way to change a key's bytes behind its back (bit rot, a bad disk)."""
    root = tmp_path / "dest"
    store = MemoryStore()

    def corrupt_file(key: str, data: bytes) -> None:
        (root / key).write_bytes(data)

    def corrupt_object(key: str, data: bytes) -> None:
        store.objects[key] = data

    backend: Backend
    if request.param == "posix":
        backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), "gpu1")
        yield backend, corrupt_file
    else:
        backend = MemoryBackend("gpu1", store=store)
        yield backend, corrupt_object
    await backend.aclose()


def shard_bytes(step: int, path: str) -> bytes:
    # Big enough to be read in several chunks and hashed off the loop.
    seed = hashlib.sha256(f"{step}/{path}".encode()).digest()
    return seed * (40_000 + len(path))


async def commit(
    backend: Backend, tmp_path: Path, step: int, paths: tuple[str, ...] = ("model/rank0.pt",)
) -> None:
    entries = []
    for path in paths:
        data = shard_bytes(step, path)
        staged = tmp_path / f"staged-{step}"
        staged.write_bytes(data)
        fd = os.open(staged, os.O_RDONLY)
        try:
            checksum = await backend.put_file(shard_key(JOB, step, path), fd, len(data))
        finally:
            os.close(fd)
        entries.append(ShardEntry(path, len(data), checksum, 0, "gpu1"))
    committer = Committer(backend, "gpu1", clock=lambda: 1000.0 + step)
    await committer.record_part(
        PartRecord(
            JOB,
            step,
            1,
            "gpu1",
            (0,),
            tuple(entries),
            {"handoff": 1.0, "staged": 2.0, "drained": 3.0},
        )
    )
    assert (await committer.try_publish(JOB, step, 1)).outcome is CommitOutcome.PUBLISHED


PATHS = ("model/rank0.pt", "optim/rank0.pt", ".metadata")


@pytest.mark.asyncio
async def test_listing_jobs_and_generations_reads_directories_not_every_shard(
    tmp_path: Path,
) -> None:
    # `ckptdrain ls` and `gc` listed every key under the destination (every shard of every
    # generation) to find a few job names and manifest keys: a million keys on S3 is a
    # thousand listing requests. They list directories now, and stat manifest keys.
    backend = MemoryBackend("gpu1", store=MemoryStore())
    await commit(backend, tmp_path, 100, PATHS)
    await commit(backend, tmp_path, 300, PATHS)
    await backend.put_bytes(shard_key(JOB, 400, "model/rank0.pt"), b"in flight")
    await backend.put_bytes(shard_key("uncommitted", 5, "x"), b"x")
    await backend.put_bytes("not a job/00000000000000000001/MANIFEST.json", b"{}")
    backend.calls.clear()

    assert await catalog.list_jobs(backend) == [JOB]
    assert [g.step for g in await catalog.list_generations(backend, JOB)] == [300, 100]
    assert backend.count("list") == 0
    # What was asked: the directories, the manifests' presence and the manifests themselves.
    assert {op for op, _ in backend.calls} == {"list_dirs", "stat", "get_bytes"}
    assert all(key.endswith("MANIFEST.json") for op, key in backend.calls if op != "list_dirs")


@pytest.mark.asyncio
async def test_a_job_that_cannot_be_read_is_left_out_not_every_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found attacking the listing by directory: one job whose directory could not be listed,
    # or whose newest manifest key was a link, stopped `ls` and `gc` of every job.
    root = tmp_path / "dest"
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), "gpu1")
    await commit(backend, tmp_path, 100)
    linked = root / manifest_key("linked", 7)
    linked.parent.mkdir(parents=True)
    linked.symlink_to(root / manifest_key(JOB, 100))
    memory = MemoryBackend("gpu1", store=MemoryStore())
    await commit(memory, tmp_path, 100)
    await memory.put_bytes(manifest_key("locked", 3), b"{}")
    memory.inject("list_dirs", BackendError("listing locked/: permission denied", kind="auth"),
                  key_contains="locked/")
    try:
        assert await catalog.list_jobs(backend) == [JOB]
        assert await catalog.list_jobs(memory) == [JOB]
    finally:
        await backend.aclose()
    assert "linked/00000000000000000007/MANIFEST.json" in caplog.text
    assert "leaving out job locked" in caplog.text


@pytest.mark.asyncio
async def test_only_committed_generations_are_listed(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, _ = dest
    await commit(backend, tmp_path, 100, PATHS)
    await commit(backend, tmp_path, 300)
    # A generation whose shards drained but whose manifest never came (a node died).
    await backend.put_bytes(shard_key(JOB, 400, "model/rank0.pt"), b"orphan")
    # Another job, and a generation whose manifest is damaged.
    await backend.put_bytes(shard_key("other", 5, "x"), b"x")
    await backend.put_bytes(manifest_key("broken", 7), b"{")

    assert await catalog.list_jobs(backend) == ["broken", JOB]
    generations = await catalog.list_generations(backend, JOB)
    assert [g.step for g in generations] == [300, 100]  # newest first
    g100 = generations[1]
    assert (g100.job, g100.shards, g100.nodes, g100.committed_at) == (JOB, 3, ("gpu1",), 1100.0)
    assert g100.bytes == sum(len(shard_bytes(100, p)) for p in PATHS)
    assert await catalog.list_generations(backend, "broken") == []
    assert await catalog.list_generations(backend, "nobody") == []


_CRC = "crc64nvme:" + "0" * 16
# One field of a manifest's second shard, and why `ls` leaves the manifest out: the words it
# logged before shard entries were checked by one match each (the rules now run only to say
# what is wrong), kept word for word.
_DAMAGED_SHARD = [
    ("rank", 2, "rank 2 is out of range for world_size 2; use 0..1"),
    ("size", True, "manifest shard 1: manifest shard 1 size must be an integer, not bool"),
    ("size", -1, "manifest shard 1: manifest shard 1 size is -1; it must be 0..9223372036854775807"),
    ("checksum", "crc64nvme:" + "A" * 16, "manifest shard 1: checksum digest 'AAAAAAAAAAAAAAAA' "
     "is not 16 lowercase hex digits for crc64nvme"),
    ("path", "model/../x", "manifest shard 1: shard path 'model/../x' contains a '..' component"),
    ("path", "model/x.ckptdrain-tmp", "manifest shard 1: shard path 'model/x.ckptdrain-tmp' ends "
     "a component in '.ckptdrain-tmp', which is reserved for ckptdrain's temporary files"),
    ("path", "_parts/x", "manifest shard 1: shard path '_parts/x' is reserved"),
    ("path", "model/\u00e9", "manifest shard 1: shard path 'model/\u00e9' contains '\u00e9'"),
    ("path", "model/a.pt/inner", "manifest of 'llama' generation 200 lists shard 'model/a.pt' "
     "and shard 'model/a.pt/inner': one is a directory of the other"),
    ("path", "model/a.pt", "manifest of 'llama' generation 200 lists shard path 'model/a.pt' twice"),
    ("node", "gpu2", "manifest of 'llama' generation 200 shard 'model/b.pt' names node 'gpu2', "
     "not one of ['gpu1']"),
    ("node", "-gpu", "manifest shard 1: node id '-gpu' is not acceptable"),
    ("extra", 1, "manifest shard 1 has unknown field(s) extra"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("field", "value", "why"), _DAMAGED_SHARD)
async def test_ls_leaves_out_a_manifest_with_one_damaged_shard_saying_why(
    dest: tuple[Backend, Corrupt], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    field: str, value: object, why: str,
) -> None:
    backend, _ = dest
    await commit(backend, tmp_path, 100)
    manifest = Manifest(job=JOB, generation=200, world_size=2, nodes=("gpu1",),
                        shards=(ShardEntry("model/a.pt", 3, _CRC, 0, "gpu1"),
                                ShardEntry("model/b.pt", 4, _CRC, 1, "gpu1")),
                        clocks={"handoff": 1.0, "staged": 2.0, "drained": 3.0, "committed": 4.0})
    obj = json.loads(manifest.to_json())
    obj["generation"] = 300
    await backend.put_bytes(manifest_key(JOB, 300), json.dumps(obj).encode())  # intact
    obj["generation"] = 200
    obj["shards"][1][field] = value
    await backend.put_bytes(manifest_key(JOB, 200), json.dumps(obj).encode())

    with caplog.at_level(logging.WARNING, logger="ckptdrain.daemon.catalog"):
        listed = await catalog.list_generations(backend, JOB)
    assert [g.step for g in listed] == [300, 100]
    assert f"ignoring {manifest_key(JOB, 200)}: {why}" in caplog.text


@pytest.mark.asyncio
async def test_latest_trusts_the_hint_only_when_its_manifest_exists(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, _ = dest
    assert await catalog.latest(backend, JOB) is None
    await commit(backend, tmp_path, 100)
    await commit(backend, tmp_path, 200)
    assert await catalog.latest(backend, JOB) == 200

    # A lagging hint (a node wrote a stale step over a newer one) is a floor, not the answer.
    await backend.put_bytes(latest_key(JOB), b"100\n")
    assert await catalog.latest(backend, JOB) == 200
    assert await catalog.latest(backend, JOB, use_hint=False) == 200

    await backend.put_bytes(latest_key(JOB), b"900\n")  # names no manifest: fall back
    assert await catalog.latest(backend, JOB) == 200
    for junk in (b"garbage", b"99999999999999999999", b"-1", b"x" * 100):
        await backend.put_bytes(latest_key(JOB), junk)
        assert await catalog.latest(backend, JOB) == 200
    await backend.put_bytes(manifest_key(JOB, 200), b"{damaged")
    await backend.delete(latest_key(JOB))
    assert await catalog.latest(backend, JOB) == 100


@pytest.mark.asyncio
async def test_resolve_names_what_is_not_committed(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, _ = dest
    with pytest.raises(catalog.NotCommitted, match="no committed generation"):
        await catalog.resolve(backend, JOB, "latest")
    await commit(backend, tmp_path, 100)
    assert (await catalog.resolve(backend, JOB, "latest")).generation == 100
    with pytest.raises(catalog.NotCommitted, match="generation 5 of job 'llama' is not committed"):
        await catalog.resolve(backend, JOB, 5)


@pytest.mark.asyncio
async def test_verify_passes_an_intact_generation(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, _ = dest
    await commit(backend, tmp_path, 100, PATHS)
    report = await catalog.verify(backend, JOB, "latest", concurrency=2)
    assert report.ok
    assert report.checked == 3
    assert report.bytes == sum(len(shard_bytes(100, p)) for p in PATHS)
    assert report.bad == []


@pytest.mark.asyncio
async def test_verify_names_every_damaged_shard(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, corrupt = dest
    await commit(backend, tmp_path, 100, PATHS)
    good = shard_bytes(100, "model/rank0.pt")
    flipped = bytes([good[0] ^ 1]) + good[1:]
    corrupt(shard_key(JOB, 100, "model/rank0.pt"), flipped)
    corrupt(shard_key(JOB, 100, "optim/rank0.pt"), b"short")
    await backend.delete(shard_key(JOB, 100, ".metadata"))

    report = await catalog.verify(backend, JOB, 100)

    assert not report.ok
    assert report.checked == 3
    assert [path for path, _ in report.bad] == [".metadata", "model/rank0.pt", "optim/rank0.pt"]
    reasons = dict(report.bad)
    assert reasons[".metadata"] == "missing at the destination"
    assert "in the manifest" in reasons["model/rank0.pt"]
    assert reasons["optim/rank0.pt"].startswith("5 bytes, the manifest lists")


@pytest.mark.asyncio
async def test_verify_surfaces_a_destination_failure(tmp_path: Path) -> None:
    backend = MemoryBackend("gpu1")
    await commit(backend, tmp_path, 100)
    backend.inject("read_chunks", BackendError("connection reset", transient=True))
    with pytest.raises(BackendError, match="connection reset"):
        await catalog.verify(backend, JOB, 100)


@pytest.mark.asyncio
async def test_restore_round_trip(dest: tuple[Backend, Corrupt], tmp_path: Path) -> None:
    backend, _ = dest
    await commit(backend, tmp_path, 100, PATHS)
    progress: list[int] = []
    target = tmp_path / "restored"

    report = await restore(
        backend, JOB, 100, target, concurrency=2, progress=progress.append
    )

    expected = {p: shard_bytes(100, p) for p in PATHS}
    assert {p: (target / p).read_bytes() for p in PATHS} == expected
    assert report.files == 3
    assert report.bytes == sum(progress) == sum(map(len, expected.values()))
    # The manifest travels with it, so the directory says what it is.
    assert (target / "MANIFEST.json").read_bytes() == await backend.get_bytes(
        manifest_key(JOB, 100)
    )
    assert not [n for _, _, files in os.walk(target) for n in files if n.endswith(TMP_SUFFIX)]


@pytest.mark.asyncio
async def test_restore_stops_on_a_damaged_shard_and_leaves_no_partial_file(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, corrupt = dest
    await commit(backend, tmp_path, 100, PATHS)
    good = shard_bytes(100, "optim/rank0.pt")
    corrupt(shard_key(JOB, 100, "optim/rank0.pt"), good[:-1] + b"\0")
    target = tmp_path / "restored"

    with pytest.raises(RestoreError,
                       match=r"optim/rank0\.pt does not match its checksum.*read twice"):
        await restore(backend, JOB, 100, target, concurrency=1)

    assert not (target / "optim/rank0.pt").exists()
    assert not (target / "MANIFEST.json").exists()
    assert not [n for _, _, files in os.walk(target) for n in files if n.endswith(TMP_SUFFIX)]


@pytest.mark.asyncio
async def test_a_shard_missing_at_the_destination_says_to_restore_an_older_generation(
    tmp_path: Path
) -> None:
    # Found attacking: a checksum mismatch said what to do, a shard deleted after the commit
    # said only "... does not exist".
    async with _committed_posix(tmp_path) as (root, backend):
        (root / shard_key(JOB, 100, "optim/rank0.pt")).unlink()
        with pytest.raises(RestoreError,
                           match=r"optim/rank0\.pt does not exist.*restore an older generation"):
            await restore(backend, JOB, 100, tmp_path / "restored", concurrency=1)


@contextlib.asynccontextmanager
async def _committed_posix(tmp_path: Path) -> AsyncIterator[tuple[Path, PosixBackend]]:
    """Generation 100 of JOB committed to a file:// destination: (its root, the backend)."""
    root = tmp_path / "dest"
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), "gpu1")
    try:
        await commit(backend, tmp_path, 100, PATHS)
        yield root, backend
    finally:
        await backend.aclose()


@pytest.mark.asyncio
async def test_a_generation_removed_while_it_is_restored_says_to_restore_a_newer_one(
    tmp_path: Path
) -> None:
    # Found attacking: retention removed the generation (manifest first, then the shards)
    # while it was restored, and the restore said "does not exist; the generation at the
    # destination is damaged: restore an older generation", which retention removes first.
    async with _committed_posix(tmp_path) as (root, backend):
        real = type(backend).copy_into

        async def removed_meanwhile(self: PosixBackend, key: str, *args: Any, **kw: Any) -> Any:
            (root / manifest_key(JOB, 100)).unlink(missing_ok=True)
            (root / key).unlink(missing_ok=True)
            return await real(self, key, *args, **kw)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PosixBackend, "copy_into", removed_meanwhile)
            with pytest.raises(RestoreError, match=r"does not exist; the generation was removed "
                                                   r"while it was restored.*restore a newer one"):
                await restore(backend, JOB, 100, tmp_path / "restored", concurrency=1)


@pytest.mark.asyncio
async def test_a_shard_damaged_on_the_way_is_read_again_before_the_destination_is_blamed(
    dest: tuple[Backend, Corrupt], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found attacking: bytes damaged on the way (a resumed range's, a proxy's) failed the
    # restore with "the shard at the destination is damaged", and an operator would go back
    # to an older checkpoint for nothing. The shard is read once more first. The damage in
    # transit is injected in the first read of one shard; the object itself is intact.
    backend, _ = dest
    await commit(backend, tmp_path, 100, PATHS)
    real = type(backend).copy_into
    reads: list[str] = []

    async def damaged_once(self: Backend, key: str, fd: int, **kw: object) -> tuple[int, str]:
        reads.append(key)
        got = await real(self, key, fd, **kw)  # type: ignore[arg-type]
        if key.endswith("optim/rank0.pt") and reads.count(key) == 1:
            os.pwrite(fd, b"\0", 0)
            return got[0], "crc64nvme:0000000000000000"
        return got

    monkeypatch.setattr(type(backend), "copy_into", damaged_once)
    target = tmp_path / "restored"
    progress: list[int] = []
    report = await restore(backend, JOB, 100, target, concurrency=1,
                                   progress=progress.append)
    assert (target / "optim/rank0.pt").read_bytes() == shard_bytes(100, "optim/rank0.pt")
    assert sum(key.endswith("optim/rank0.pt") for key in reads) == 2
    assert sum(progress) == report.bytes  # the second read is not counted again


@pytest.mark.asyncio
async def test_restore_refuses_a_longer_shard_and_reads_no_further_than_its_size(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    # Found attacking restore: an object far longer than its shard was read to its end into
    # the target's temp file (48 MiB for a shard listed as 1 byte) before the size was
    # compared: a full disk for nothing.
    backend, corrupt = dest
    await commit(backend, tmp_path, 100)
    for tail in (b"x", b"x" * (8 << 20)):
        corrupt(shard_key(JOB, 100, "model/rank0.pt"), shard_bytes(100, "model/rank0.pt") + tail)
        moved: list[int] = []
        with pytest.raises(RestoreError, match="longer than"):
            await restore(backend, JOB, 100, tmp_path / "restored", progress=moved.append)
        assert sum(moved) <= len(shard_bytes(100, "model/rank0.pt")), sum(moved)


@pytest.mark.asyncio
async def test_restore_refuses_a_symlink_that_leads_outside(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, _ = dest
    await commit(backend, tmp_path, 100)
    target = tmp_path / "restored"
    outside = tmp_path / "outside"
    outside.mkdir()
    target.mkdir()
    (target / "model").symlink_to(outside)
    with pytest.raises(RestoreError, match="model is a symbolic link"):
        await restore(backend, JOB, 100, target)
    assert list(outside.iterdir()) == []


@pytest.mark.asyncio
async def test_restore_of_an_uncommitted_generation_is_refused(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    backend, _ = dest
    await backend.put_bytes(shard_key(JOB, 400, "model/rank0.pt"), b"orphan")
    with pytest.raises(catalog.NotCommitted):
        await restore(backend, JOB, 400, tmp_path / "restored")
    assert not (tmp_path / "restored").exists()


@pytest.mark.asyncio
async def test_a_streamed_copy_writes_at_offsets_from_zero_not_at_the_files_position(
        tmp_path: Path) -> None:
    # The copy of a backend without a bulk path of its own (and S3's for a small or a sha256
    # shard) wrote each chunk at the file's position: into a reader's fd left at its end by
    # an earlier attempt, the shard landed after the old bytes, reported as fetched.
    backend = MemoryBackend("gpu1")
    data = os.urandom(3 * 1024 * 1024 + 5)
    await backend.put_bytes("job/00000000000000000001/a.bin", data)
    target = tmp_path / "into.bin"
    target.write_bytes(b"x" * 100)
    fd = os.open(target, os.O_RDWR)
    try:
        os.lseek(fd, 0, os.SEEK_END)
        size, _ = await backend.copy_into("job/00000000000000000001/a.bin", fd)
    finally:
        os.close(fd)
    assert size == len(data)
    assert target.read_bytes() == data


@pytest.mark.asyncio
async def test_a_failed_restore_over_an_earlier_one_leaves_no_manifest(
    dest: tuple[Backend, Corrupt], tmp_path: Path
) -> None:
    # Found attacking restore: restoring over an earlier restore (--overwrite) and failing
    # half-way left the earlier MANIFEST.json beside files that were partly the new
    # generation's: a directory that looked like a whole checkpoint and was none.
    backend, corrupt = dest
    await commit(backend, tmp_path, 100, PATHS)
    await commit(backend, tmp_path, 200, PATHS)
    into = tmp_path / "restored"
    await restore(backend, JOB, 100, into)
    assert (into / "MANIFEST.json").exists()
    corrupt(shard_key(JOB, 200, PATHS[-1]), b"damaged")
    with pytest.raises(RestoreError):
        await restore(backend, JOB, 200, into, concurrency=1)
    assert not (into / "MANIFEST.json").exists()


@pytest.mark.asyncio
async def test_a_failed_restore_removes_nothing_through_a_link_swapped_in_meanwhile(
    tmp_path: Path
) -> None:
    # Found attacking restore: a failed restore removed what it had made by path, so a
    # directory it made, swapped for a link while a later shard was read (a target others
    # may write in), led its undo out of the target: it unlinked the file of the shard's name
    # where the link led, and left the shard it had restored. The undo reaches each file as
    # the restore does, from the target's descriptor and never through a link.
    backend = MemoryBackend("gpu1", store=MemoryStore())
    await commit(backend, tmp_path, 100, PATHS)
    backend.store.objects[shard_key(JOB, 100, "optim/rank0.pt")] = b"damaged"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank0.pt").write_text("not the restore's")
    target = tmp_path / "restored"
    held = backend.hold("read_chunks", "optim/rank0.pt")
    # One shard at a time, in the manifest's order: model/rank0.pt is in place when
    # optim/rank0.pt's read is held.
    task = asyncio.create_task(restore(backend, JOB, 100, target, concurrency=1))
    await held.wait_reached()
    assert (target / "model" / "rank0.pt").is_file()
    (target / "model").rename(tmp_path / "moved")
    (target / "model").symlink_to(elsewhere)
    held.release()
    with pytest.raises(RestoreError, match="the shard at the destination is damaged"):
        await task
    assert (elsewhere / "rank0.pt").read_text() == "not the restore's"
