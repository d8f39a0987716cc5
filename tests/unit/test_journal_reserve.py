"""The journal's reserve (daemon/journalroom.py): it leaves shards the same room, it becomes
the journal's missing side files at start with nothing of an old WAL replayed, and a stop
keeps the side files' blocks for it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.daemon.journal import WAL_KEPT_BYTES, Journal
from ckptdrain.daemon.journalroom import SHM_RESERVE_BYTES, JournalReserve, wal_reserve_bytes
from ckptdrain.daemon.staging import Staging


def _room_for_shards(staging: Staging) -> int:
    free_bytes, _, reserve = staging.room()
    return free_bytes - reserve


def test_the_reserve_leaves_shards_the_same_room(small_tmpfs: Path) -> None:
    reserve = JournalReserve(small_tmpfs / "journal.sqlite3")
    staging = Staging(small_tmpfs, reserve)
    staging.prepare()
    before = _room_for_shards(staging)
    reserve.remake()
    wal = wal_reserve_bytes(os.statvfs(small_tmpfs))
    assert reserve.wal.stat().st_size == wal and reserve.shm.stat().st_size == SHM_RESERVE_BYTES
    assert reserve.held == wal + SHM_RESERVE_BYTES
    assert _room_for_shards(staging) == before


@contextlib.contextmanager
def _journal(path: Path) -> Iterator[sqlite3.Connection]:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
        yield db
    finally:
        db.close()


def test_the_reserve_becomes_the_missing_side_files_and_no_old_frame_is_replayed(
        tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    with _journal(path) as db:
        db.execute("INSERT INTO t VALUES (1)")
    assert not Path(f"{path}-wal").exists()  # a clean close deleted it
    reserve = JournalReserve(path)
    reserve.remake()
    # A reserve that kept an old WAL, its header valid: frames of a journal that moved on.
    with _journal(tmp_path / "other.sqlite3") as other:
        other.execute("INSERT INTO t VALUES (99)")
        os.link(tmp_path / "other.sqlite3-wal", tmp_path / "old-wal")
    os.replace(tmp_path / "old-wal", reserve.wal)
    assert reserve.wal.read_bytes()[:4] != bytes(4)
    reserve.hand_over()
    assert not reserve.wal.exists() and not reserve.shm.exists() and reserve.held == 0
    assert Path(f"{path}-wal").read_bytes()[:32] == bytes(32)
    with _journal(path) as db:
        assert db.execute("SELECT x FROM t").fetchall() == [(1,)]
        db.execute("INSERT INTO t VALUES (2)")
    reserve.hand_over()  # once per start: a second call gives nothing up
    with _journal(path) as db:
        assert db.execute("SELECT x FROM t ORDER BY x").fetchall() == [(1,), (2,)]


def test_a_stop_keeps_the_side_files_blocks_for_the_reserve(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    reserve = JournalReserve(path)
    with _journal(path) as db:
        db.execute("INSERT INTO t VALUES (1)")
        reserve.keep_side_files()
        # Linked to the live files: the journal's, not held for shards' room.
        assert os.stat(reserve.wal).st_ino == os.stat(f"{path}-wal").st_ino
        assert reserve.held == 0
    assert not Path(f"{path}-wal").exists() and reserve.wal.stat().st_size > 0
    assert reserve.count() > 0
    reserve.hand_over()
    with _journal(path) as db:
        assert db.execute("SELECT x FROM t").fetchall() == [(1,)]


@pytest.mark.asyncio
async def test_a_compaction_keeps_the_write_ahead_logs_blocks(tmp_path: Path) -> None:
    # Found attacking the journal's reserve: on a staging disk full for the whole run, the
    # reserve had become the journal's WAL, and a compaction (after retention forgot a
    # generation) emptied it (wal_checkpoint(TRUNCATE)): another user took its blocks, the
    # journal could write nothing more (journal_full), and the stop kept an empty reserve.
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    try:
        for n in range(200):
            await journal.write(("INSERT INTO jobs (job, uid) VALUES (?, ?)", (f"j{n}", n)))
        wal = Path(f"{journal.path}-wal")
        written = wal.stat().st_size
        assert written > 0
        await journal.compact()
        assert wal.stat().st_size == written  # checkpointed, its blocks kept for the next writes
        await journal.write(("INSERT INTO jobs (job, uid) VALUES (?, ?)", ("after", 1)))
        assert wal.stat().st_size <= max(written, WAL_KEPT_BYTES)
    finally:
        await journal.close()


def test_a_sparse_reserve_counts_what_it_holds_on_the_disk(tmp_path: Path) -> None:
    # Found attacking: counted at its length, a sparse 1 GiB journal.reserve-wal (a staging
    # directory copied with rsync -S) read as the whole free-space reserve already held, and
    # shards took the room the reserve was to keep free.
    reserve = JournalReserve(tmp_path / "journal.sqlite3")
    with open(reserve.wal, "wb") as f:
        f.truncate(1 << 30)
    assert reserve.count() == reserve.wal.stat().st_blocks * 512 < 1 << 20
