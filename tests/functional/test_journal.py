"""The journal: durable records in SQLite, and group commit of concurrent acknowledgements."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ckptdrain.daemon import journal as j
from ckptdrain.daemon.journal import GroupCommit, Journal


def shard_row(i: int) -> dict[str, object]:
    return {"id": i, "job": "j", "step": 1, "rank": 0, "path": f"s{i}", "size": i,
            "staged_name": f"n{i}", "state": "staged", "checksum": "", "handed_at": 1.0,
            "staged_at": 2.0, "drained_at": None, "error": "", "deferred": False}


@pytest.mark.asyncio
async def test_concurrent_acknowledgements_share_commits(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    fsyncs: list[int] = []
    group = GroupCommit(journal, before=lambda: fsyncs.append(1))
    try:
        await asyncio.gather(*(group(j.put_shard(shard_row(i))) for i in range(1, 101)))
    finally:
        snap = await journal.load()
        await journal.close()
    assert sorted(s["id"] for s in snap.shards) == list(range(1, 101))
    assert 1 <= group.batches < 100, "every acknowledgement paid its own fsyncs"
    assert len(fsyncs) == group.batches


@pytest.mark.asyncio
async def test_a_failed_commit_fails_its_whole_batch_and_the_next_one_works(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    calls = 0

    def before() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(28, "No space left on device")

    group = GroupCommit(journal, before=before)
    try:
        with pytest.raises(OSError, match="No space"):
            await group(j.put_shard(shard_row(1)))
        await group(j.put_shard(shard_row(2)))
        snap = await journal.load()
    finally:
        await journal.close()
    assert [s["id"] for s in snap.shards] == [2]
