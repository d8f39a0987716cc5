"""`--generation latest` and the owner lookup find the newest commit once, manifest in hand.

`restore` and `verify --generation latest` turned "latest" into a step, then read that step's
manifest again (restore read it three times): retention removing the step between the reads,
once a newer one committed, failed the command with "generation 30 is not committed; pick one
listed by `ckptdrain ls`". The owner lookup scanned as `latest` does but took an answer even
when retention had removed a commit above it during the scan, or removed the answer itself
before its part records were read, and named an older generation's owner or none (which let
another user's begin of the job through).

Each test runs on a real directory, through a backend that records every manifest read and
changes the destination at one chosen call, as another node would at that moment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client.keys import latest_key, manifest_key, part_key
from ckptdrain.daemon import cli_destination
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.cli import main
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.retention import apply_retention
from ckptdrain.daemon.tombstone import tombstone_json
from tests.functional.test_latest_race import recorded

JOB = "llama"
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}


class RacingPosix(PosixBackend):
    """A real directory whose manifest reads are recorded; ``when_absent`` runs once, right
    after the first read that finds nothing at its key (another node acting then)."""

    def __init__(self, root: Path, node_id: str, absent_key: str,
                 when_absent: Callable[[], Awaitable[None]]) -> None:
        super().__init__(DestinationConfig(uri=f"file://{root}"), node_id)
        self.reads: list[str] = []
        self._absent_key = absent_key
        self._when_absent: Callable[[], Awaitable[None]] | None = when_absent

    async def get_bytes(self, key: str, **kw: Any) -> bytes | None:
        data = await super().get_bytes(key, **kw)
        self.reads.append(key)
        if key == self._absent_key and data is None and self._when_absent is not None:
            act, self._when_absent = self._when_absent, None
            await act()
        return data


async def published(committer: Committer, tmp_path: Path, step: int,
                    owner_uid: int | None = None) -> None:
    await recorded(committer, tmp_path, step, owner_uid)
    assert (await committer.try_publish(JOB, step, 1)).committed


def writer(dest: Path) -> Committer:
    return Committer(PosixBackend(DestinationConfig(uri=f"file://{dest}"), "n1"), "n1")


@pytest.mark.parametrize("command", ["restore", "verify"])
def test_latest_removed_after_it_was_found_is_still_the_one_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """LATEST says 30; 31 is in flight. Right after the lookup reads 31's manifest key (still
    empty), 31 commits and retention puts its tombstone over 30's manifest (its first write;
    the shards go after it). The command found 30 the newest and holds its manifest: it
    restores or verifies 30, and reads its manifest once."""
    dest = tmp_path / "dest"
    dest.mkdir()
    node = writer(dest)

    async def setup() -> None:
        await published(node, tmp_path, 30)
        await recorded(node, tmp_path, 31)

    asyncio.run(setup())

    async def commit_31_and_remove_30() -> None:
        # The CLI's own event loop runs this: a fresh writer backend on it.
        other = writer(dest)
        try:
            assert (await other.try_publish(JOB, 31, 1)).committed
            tomb = tombstone_json(JOB, 30, "n1", time.time(), was_committed=True,
                                  committed_by=(1, ["n1"]))
            await other.backend.put_bytes(manifest_key(JOB, 30), tomb)
        finally:
            await other.backend.aclose()

    racing: list[RacingPosix] = []

    def backend(ns: argparse.Namespace, uri: str) -> RacingPosix:
        racing.append(RacingPosix(dest, "reader", manifest_key(JOB, 31), commit_31_and_remove_30))
        return racing[0]

    monkeypatch.setattr(cli_destination, "_backend", backend)
    extra = ["--to", str(tmp_path / "out"), "--no-local"] if command == "restore" else []
    try:
        code = main([command, f"file://{dest}", "--job", JOB, "--json", *extra])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["generation"] == 30
    if command == "restore":
        assert (tmp_path / "out" / "w.bin").read_bytes() == b"step 30"
    else:
        assert json.loads(out)["ok"] is True
    # The race did happen: 31 committed and 30's manifest key holds a tombstone.
    assert (dest / manifest_key(JOB, 31)).is_file()
    assert b"was_committed" in (dest / manifest_key(JOB, 30)).read_bytes()
    assert racing[0].reads.count(manifest_key(JOB, 30)) == 1, racing[0].reads


def test_restore_of_a_named_step_reads_its_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    node = writer(dest)
    asyncio.run(published(node, tmp_path, 7))

    async def nothing() -> None:
        raise AssertionError("no key is read as absent here")

    racing: list[RacingPosix] = []

    def backend(ns: argparse.Namespace, uri: str) -> RacingPosix:
        racing.append(RacingPosix(dest, "reader", "none", nothing))
        return racing[0]

    monkeypatch.setattr(cli_destination, "_backend", backend)
    code = main(["restore", f"file://{dest}", "--job", JOB, "--generation", "7",
                 "--to", str(tmp_path / "out"), "--no-local", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["generation"] == 7
    assert racing[0].reads == [manifest_key(JOB, 7)]


@pytest.mark.asyncio
async def test_the_owner_lookup_scans_again_when_a_commit_above_its_answer_was_removed(
    tmp_path: Path,
) -> None:
    """30 was committed by an older version (its part record names no owner), 31 by uid 1000,
    and LATEST lags at 30 (a lowered hint). The lookup takes 30 as its floor and scans above
    it: 32 is still in flight; then 32 commits (uid 1000) and retention (keep_last 1) removes
    30 and 31, and the scan meets 31's tombstone. A commit above the answer was removed, so a
    newer one exists: the owner is 32's, 1000, not "nobody" (which let another user's begin
    of the job through)."""
    dest = tmp_path / "dest"
    dest.mkdir()
    node = writer(dest)
    try:
        await published(node, tmp_path, 30)
        await published(node, tmp_path, 31, owner_uid=1000)
        await node.backend.put_bytes(latest_key(JOB), b"30\n")  # lowered by a stale writer
        await recorded(node, tmp_path, 32, owner_uid=1000)

        async def commit_32_and_apply_retention() -> None:
            assert (await node.try_publish(JOB, 32, 1)).committed
            report = await apply_retention(node.backend, JOB, keep_last=1,
                                           abandoned_grace_s=60)
            assert report.deleted == [31, 30]

        reader = RacingPosix(dest, "n2", manifest_key(JOB, 32), commit_32_and_apply_retention)
        try:
            assert await Committer(reader, "n2").owners.owner(JOB) == 1000
            assert manifest_key(JOB, 31) in reader.reads  # the scan met the tombstone
        finally:
            await reader.aclose()
    finally:
        await node.backend.aclose()


@pytest.mark.asyncio
async def test_the_owner_lookup_asks_again_when_its_answer_is_removed_before_its_records_are_read(
    tmp_path: Path,
) -> None:
    """30 and 31 are committed by uid 1000 and LATEST says 31; 32 is in flight. The lookup
    reads 31's manifest and finds 32's key empty; then 32 commits and retention (keep_last 1)
    removes 30 and 31, part records too, before the lookup reads 31's records. None of them
    is there: the generation went after its manifest was read, and the lookup asks again
    (it answered "no owner")."""
    dest = tmp_path / "dest"
    dest.mkdir()
    node = writer(dest)
    try:
        await published(node, tmp_path, 30, owner_uid=1000)
        await published(node, tmp_path, 31, owner_uid=1000)
        await recorded(node, tmp_path, 32, owner_uid=1000)

        async def commit_32_and_apply_retention() -> None:
            assert (await node.try_publish(JOB, 32, 1)).committed
            report = await apply_retention(node.backend, JOB, keep_last=1,
                                           abandoned_grace_s=60)
            assert report.deleted == [31, 30]

        reader = RacingPosix(dest, "n2", manifest_key(JOB, 32), commit_32_and_apply_retention)
        try:
            assert await Committer(reader, "n2").owners.owner(JOB) == 1000
            assert part_key(JOB, 31, "n1") in reader.reads  # read after the removal
        finally:
            await reader.aclose()
    finally:
        await node.backend.aclose()
