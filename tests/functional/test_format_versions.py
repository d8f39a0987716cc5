"""Manifests of every format at one destination: format 1 (sha256) beside format 2, and one a
newer ckptdrain wrote, which readers name as such instead of passing it by as damage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client.errors import DestinationError, DrainError, NotFound
from ckptdrain.client.keys import latest_key, manifest_key, part_key, shard_key
from ckptdrain.client.manifest import FORMAT_VERSION, Manifest, NewerFormat, PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.restore import restore
from tests.conftest import CKPTDRAIN, DaemonProcess

JOB = "llama"
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0, "committed": 4.0}
XATTR = "user.ckptdrain.checksum"


def committed(root: Path, step: int, files: dict[str, bytes], *, version: int) -> Manifest:
    """Generation ``step`` as a daemon writing format ``version`` left it: the shards, each
    with its checksum in the extended attribute (sha256 in format 1), then the manifest."""
    entries = []
    for path, data in files.items():
        file = root / shard_key(JOB, step, path)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data)
        checksum = (f"sha256:{hashlib.sha256(data).hexdigest()}" if version == 1
                    else of_bytes(data))
        os.setxattr(file, XATTR, checksum.encode())
        entries.append(ShardEntry(path, len(data), checksum, 0, "gpu1"))
    manifest = Manifest(JOB, step, 1, tuple(entries), ("gpu1",), CLOCKS, format_version=version)
    (root / manifest_key(JOB, step)).write_bytes(manifest.to_json())
    return manifest


def newer(root: Path, step: int) -> None:
    """What a ckptdrain two format versions ahead might write at ``step``: a field this
    version does not know (the format grows by fields and a raised version)."""
    committed(root, step, {"w.bin": b"w" * 100}, version=FORMAT_VERSION)
    key = root / manifest_key(JOB, step)
    body = json.loads(key.read_bytes())
    body.update(format_version=FORMAT_VERSION + 2, compression="zstd")
    key.write_bytes(json.dumps(body).encode())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "dest"


@pytest.mark.asyncio
async def test_format_1_and_format_2_generations_list_verify_and_restore_side_by_side(
        root: Path, tmp_path: Path) -> None:
    v1 = {"model/rank0.pt": os.urandom(300_000), ".metadata": b"m" * 64}
    v2 = {"model/rank0.pt": os.urandom(200_000)}
    committed(root, 100, v1, version=1)
    committed(root, 200, v2, version=2)
    committed(root, 300, {"x": b"x" * 10}, version=1)
    (root / latest_key(JOB)).write_text("200\n")  # a hint an older writer left behind
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), "gpu9")
    try:
        assert [g.step for g in await catalog.list_generations(backend, JOB)] == [300, 200, 100]
        assert await catalog.latest(backend, JOB) == 300
        for step in (100, 200, 300):
            for read in (False, True):
                report = await catalog.verify(backend, JOB, step, read=read)
                assert report.ok, (step, read, report.bad)
        for step, files in ((100, v1), (200, v2)):
            to = tmp_path / f"restored-{step}"
            await restore(backend, JOB, step, to)
            assert {p: (to / p).read_bytes() for p in files} == files
        # A format 1 shard with other bytes is found by its own algorithm.
        (root / shard_key(JOB, 100, ".metadata")).write_bytes(b"n" * 64)
        report = await catalog.verify(backend, JOB, 100, read=True)
        assert [path for path, _ in report.bad] == [".metadata"]
        assert "sha256:" in report.bad[0][1]
    finally:
        await backend.aclose()


def test_a_newer_format_with_fields_this_version_does_not_know_says_upgrade() -> None:
    # Found attacking upgrades: the fields were checked before the version, so a newer
    # format's record (which grows by fields) read as damage, "unknown field(s)".
    entry = ShardEntry("w.bin", 1, of_bytes(b"w"), 0, "gpu1")
    manifest = json.loads(Manifest(JOB, 1, 1, (entry,), ("gpu1",), CLOCKS).to_json())
    part = json.loads(PartRecord(JOB, 1, 1, "gpu1", (0,), (entry,),
                                 {"handoff": 1.0, "staged": 2.0, "drained": 3.0}).to_json())
    for body, parse in ((manifest, Manifest.from_json), (part, PartRecord.from_json)):
        body.update(format_version=FORMAT_VERSION + 2, compression="zstd")
        with pytest.raises(NewerFormat, match="upgrade ckptdrain") as caught:
            parse(json.dumps(body).encode())
        assert caught.value.version == FORMAT_VERSION + 2


@pytest.mark.asyncio
@pytest.mark.parametrize("hinted", [True, False])
async def test_latest_never_answers_an_older_step_than_one_a_newer_version_committed(
        root: Path, hinted: bool) -> None:
    # Found attacking upgrades: a newer version's manifest was passed by as damage, so
    # `latest` (Client.latest, DrainReader, `restore --generation latest`) answered the step
    # below it, and a step named outright was "not committed".
    committed(root, 100, {"a": b"a" * 10}, version=1)
    committed(root, 200, {"a": b"b" * 10}, version=2)
    newer(root, 300)
    (root / latest_key(JOB)).write_text("300\n" if hinted else "200\n")
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), "gpu9")
    try:
        with pytest.raises(catalog.NeedsUpgrade, match=r"generation 300 .* newer ckptdrain.*"
                           r"upgrade ckptdrain"):
            await catalog.latest(backend, JOB)
        for generation in ("latest", 300):
            with pytest.raises(catalog.NeedsUpgrade, match="generation 300"):
                await catalog.resolve(backend, JOB, generation)  # type: ignore[arg-type]
        # The generations this version reads are still listed, verified and restored.
        assert [g.step for g in await catalog.list_generations(backend, JOB)] == [200, 100]
        assert (await catalog.resolve(backend, JOB, 200)).format_version == 2
        assert (await catalog.verify(backend, JOB, 100, read=True)).ok
    finally:
        await backend.aclose()


def test_client_latest_says_upgrade_rather_than_answer_an_older_step(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon()
    root = d.dest
    committed(root, 100, {"a": b"a" * 10}, version=1)
    assert d.client().latest(JOB) == 100
    newer(root, 300)
    with pytest.raises(DestinationError, match=r"generation 300 .* newer ckptdrain.*upgrade"):
        d.client().latest(JOB)
    out = subprocess.run([CKPTDRAIN, "restore", f"file://{root}", "--job", JOB, "--generation",
                          "latest", "--to", str(root.parent / "restored")],
                         capture_output=True, text=True, timeout=60, env=d.env())
    assert out.returncode == 1 and "upgrade ckptdrain" in out.stderr, out.stderr
    assert not (root.parent / "restored").exists()


def test_a_format_1_generation_is_fetched_through_the_daemon_checked_by_sha256(
        make_daemon: Any, tmp_path: Path) -> None:
    # What DrainReader does for a shard this node holds no copy of.
    d: DaemonProcess = make_daemon()
    data = os.urandom(300_000)
    committed(d.dest, 100, {"model/rank0.pt": data}, version=1)
    out = tmp_path / "fetched"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        got = d.client().fetch_from_destination(JOB, 100, "model/rank0.pt", fd)
    finally:
        os.close(fd)
    assert got["checksum"] == f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert out.read_bytes() == data
    with pytest.raises(NotFound):
        d.client().open_local(JOB, 100, "model/rank0.pt")  # no copy here: the destination's
    # Damaged at the destination: refused by its own algorithm, not passed.
    (d.dest / shard_key(JOB, 100, "model/rank0.pt")).write_bytes(os.urandom(300_000))
    fd = os.open(out, os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        with pytest.raises(DrainError, match="sha256"):
            d.client().fetch_from_destination(JOB, 100, "model/rank0.pt", fd)
    finally:
        os.close(fd)


def test_a_rolling_upgrade_commits_an_older_nodes_format_1_part_beside_a_new_one(
        make_daemon: Any) -> None:
    # Node gpu-old still runs a version writing format 1: sha256 checksums (in its record
    # and its shards' attribute), no owner_uid. Node new, upgraded, drains rank 1 and
    # commits both, each shard with its own checksum.
    d: DaemonProcess = make_daemon("new", CKPTDRAIN_ATTEMPT="")
    old = os.urandom(70_000)
    path = shard_key(JOB, 5, "rank0.bin")
    (d.dest / path).parent.mkdir(parents=True)
    (d.dest / path).write_bytes(old)
    checksum = f"sha256:{hashlib.sha256(old).hexdigest()}"
    os.setxattr(d.dest / path, XATTR, checksum.encode())
    record = json.loads(PartRecord(JOB, 5, 2, "gpu-old", (0,),
                                   (ShardEntry("rank0.bin", len(old), checksum, 0, "gpu-old"),),
                                   {"handoff": 1.0, "staged": 2.0, "drained": 3.0}).to_json())
    record["format_version"] = 1
    (d.dest / part_key(JOB, 5, "gpu-old")).parent.mkdir(parents=True)
    (d.dest / part_key(JOB, 5, "gpu-old")).write_bytes(json.dumps(record).encode())
    new = os.urandom(50_000)
    with d.client().generation(JOB, 5, rank=1, world_size=2, attempt="") as gen:
        gen.put("rank1.bin", new)
    d.client().wait(JOB, 5, timeout_s=60, attempt="")
    manifest = Manifest.from_json((d.dest / manifest_key(JOB, 5)).read_bytes())
    assert {s.path: s.checksum for s in manifest.shards} == {
        "rank0.bin": checksum, "rank1.bin": of_bytes(new)}
    assert d.client().latest(JOB) == 5


def test_a_wait_on_a_step_a_newer_version_committed_says_upgrade_not_damaged(
        make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon()
    newer(d.dest, 300)
    with pytest.raises(DestinationError, match="newer ckptdrain") as caught:
        d.client().wait(JOB, 300, timeout_s=5)
    assert "damaged" not in str(caught.value)


def test_a_begin_on_a_step_a_newer_version_committed_says_upgrade_not_damaged(
        make_daemon: Any) -> None:
    # Reported by the helper attacking upgrades: the refusal was right, its words not ("a
    # damaged MANIFEST.json ... inspect it").
    d: DaemonProcess = make_daemon()
    newer(d.dest, 301)
    with (pytest.raises(DrainError, match="committed by a newer ckptdrain") as caught,
          d.client().generation(JOB, 301, rank=0, world_size=1) as gen):
        gen.put("w.bin", b"w")
    assert "damaged" not in str(caught.value)
