"""A daemon upgraded onto a journal an older version wrote: its tables gain the columns added
since, and every shard it had acknowledged drains and commits."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.daemon import journalrows as j
from ckptdrain.daemon.errors import OperatorNeeded
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.journalfaults import JournalError
from ckptdrain.daemon.ledger import Ledger
from tests.conftest import DaemonProcess, fill_up
from tests.functional.test_startup import MiB, destination_not_mounted, small_filesystem

# The tables as the first version wrote them: `generations.attempt` and `shards.deferred`
# came later, with defaults, and `CREATE TABLE IF NOT EXISTS` leaves a table as it was.
FIRST_GENERATIONS = """CREATE TABLE generations (
    job TEXT NOT NULL, step INTEGER NOT NULL, world_size INTEGER NOT NULL, state TEXT NOT NULL,
    ack TEXT NOT NULL, created_at REAL NOT NULL, handoff_at REAL, staged_at REAL,
    drained_at REAL, committed_at REAL, error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job, step))"""
FIRST_SHARDS = """CREATE TABLE shards (
    id INTEGER PRIMARY KEY, job TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL,
    path TEXT NOT NULL, size INTEGER NOT NULL, staged_name TEXT NOT NULL, state TEXT NOT NULL,
    checksum TEXT NOT NULL DEFAULT '', handed_at REAL NOT NULL, staged_at REAL NOT NULL,
    drained_at REAL, error TEXT NOT NULL DEFAULT '', UNIQUE (job, step, path))"""


def as_first_version(journal: Path) -> None:
    """Rewrite ``journal``'s generations and shards tables as the first version made them,
    keeping every row (the columns added since go)."""
    db = sqlite3.connect(journal, isolation_level=None)
    db.execute("BEGIN")
    for table, ddl in (("generations", FIRST_GENERATIONS), ("shards", FIRST_SHARDS)):
        db.execute(f"ALTER TABLE {table} RENAME TO {table}_new")
        db.execute(ddl)
        columns = ", ".join(r[1] for r in db.execute(f"PRAGMA table_info({table})"))
        db.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table}_new")
        db.execute(f"DROP TABLE {table}_new")
    db.execute("COMMIT")
    db.close()


def test_an_upgrade_onto_a_first_version_journal_drains_its_acknowledged_shards(
        make_daemon: Any) -> None:
    # Found attacking upgrades: the new daemon refused the journal as "a row this version
    # cannot read ('attempt'): it was written by a newer ckptdrain", and its advice, to move
    # the journal aside, set the acknowledged shards aside with it.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    blobs = {f"s{i}": os.urandom(5000 + i) for i in range(3)}
    with d.client().generation("old", 1) as gen:
        for path, data in blobs.items():
            gen.put(path, data)  # acknowledged: staged, held back from draining at 1 B/s
    d.kill()
    as_first_version(d.staging / "journal.sqlite3")
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    d.client().wait("old", 1, timeout_s=60)
    root = d.dest / "old" / f"{1:020d}"
    for path, data in blobs.items():
        assert (root / path).read_bytes() == data
    assert "event=journal_upgraded" in d.log()
    # A later step goes through the upgraded tables as through new ones.
    with d.client().generation("old", 2) as gen:
        gen.put("t", b"t" * 100)
    d.client().wait("old", 2, timeout_s=60)


@pytest.mark.asyncio
async def test_the_upgraded_rows_read_as_they_meant(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal(path)
    await journal.open()
    await journal.write(
        j.put_generation({"job": "j", "step": 1, "world_size": 1, "state": "open",
                          "ack": "local", "created_at": 1.0, "handoff_at": None,
                          "staged_at": None, "drained_at": None, "committed_at": None,
                          "error": "", "attempt": "a1"}),
        j.put_rank("j", 1, 0, "sealed"),
        j.put_shard({"id": 1, "job": "j", "step": 1, "rank": 0, "path": "s", "size": 3,
                     "staged_name": "n1", "state": "staged", "checksum": "", "handed_at": 1.0,
                     "staged_at": 2.0, "drained_at": None, "error": "", "deferred": False}))
    await journal.close()
    as_first_version(path)
    journal = Journal(path)
    await journal.open()
    try:
        ledger = Ledger(journal)
        await ledger.load()
        [gen] = ledger.generations.values()
        assert gen.attempt == "" and not gen.shards["s"].deferred  # the defaults
        assert gen.shards["s"].size == 3
    finally:
        await journal.close()


@pytest.mark.asyncio
async def test_a_journal_missing_a_column_with_no_default_is_refused_for_the_operator(
        tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE uploads (shard_id INTEGER PRIMARY KEY)")  # no upload_id
    db.commit()
    db.close()
    journal = Journal(path)
    with pytest.raises(JournalError) as caught:
        await journal.open()
    await journal.close()
    assert isinstance(caught.value, OperatorNeeded)  # exit 78: no restart mends it
    assert "'upload_id'" in str(caught.value) and "older ckptdrain" in str(caught.value)


def test_an_upgrade_onto_a_full_staging_disk_drains_an_older_journals_shards(
        make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking upgrades: a journal an older version made has no auto_vacuum mode, and
    # setting it rewrote the whole journal at the start, which a full staging disk has no room
    # for: exit 75, retried for as long as the disk stayed full, while the acknowledged shards
    # that only the daemon could drain (and so make room) waited. A journal of the same size
    # made by this version started.
    d, root = destination_not_mounted(make_daemon, tmp_path)
    with small_filesystem(d.staging, 64):
        d.start()
        with d.client().generation("job", 1) as g:
            g.put("w.bin", b"w" * (4 * MiB))
        assert d.stop() == 0
        db = sqlite3.connect(d.staging / "journal.sqlite3", isolation_level=None)
        db.execute("PRAGMA auto_vacuum=NONE")  # as versions before it made journals
        db.execute("CREATE TABLE padding (b BLOB)")  # a journal grown over months of work
        for _ in range(20):
            db.execute("INSERT INTO padding VALUES (?)", (b"p" * MiB,))
        db.execute("VACUUM")
        db.close()
        fill_up(d.staging)  # another user's files
        d.start()
        assert "event=journal_not_vacuumed" in d.log()
        (tmp_path / "lustre" / "proj").mkdir()  # the destination mounted
        d.client().wait("job", 1, timeout_s=60)
        assert (root / "job" / f"{1:020d}" / "w.bin").read_bytes() == b"w" * (4 * MiB)
        assert d.stop() == 0
