"""`--generation latest` finds the newest commit once, and goes on with the manifest in hand.

`restore` and `verify --generation latest` turned "latest" into a step, then read that step's
manifest again (restore read it three times): retention removing the step between the reads,
once a newer one committed, failed the command with "generation 30 is not committed; pick one
listed by `ckptdrain ls`".

Each test runs on a real directory, through a backend that records every manifest read and
changes the destination at one chosen call, as another node would at that moment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client.keys import manifest_key, shard_key
from ckptdrain.client.manifest import PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import cli_destination
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.cli import main
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.tombstone import tombstone_json

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


async def recorded(committer: Committer, tmp_path: Path, step: int,
                   owner_uid: int | None = None) -> None:
    """One rank of ``step`` drained and its part record written; not yet published."""
    data = f"step {step}".encode()
    staged = tmp_path / f"staged-{step}"
    staged.write_bytes(data)
    fd = os.open(staged, os.O_RDONLY)
    try:
        checksum = await committer.backend.put_file(shard_key(JOB, step, "w.bin"), fd, len(data))
    finally:
        os.close(fd)
    entry = ShardEntry("w.bin", len(data), checksum, 0, committer.node_id)
    await committer.record_part(PartRecord(JOB, step, 1, committer.node_id, (0,), (entry,),
                                           CLOCKS, owner_uid=owner_uid))


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
