"""What the daemon writes into the journal: its tables (:data:`SCHEMA`), one statement
builder per kind of row, so that callers compose them into one transaction, and the two
writers built on them: the upload log of one shard (:class:`JournalUploadLog`) and the group
commit that acknowledges hand-offs (:class:`GroupCommit`).

Apart from journal.py, which owns the connection, its thread and the durability of each
write; this module owns what the rows say.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptdrain.daemon.journal import Journal

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY,
    uid INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS generations (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    state TEXT NOT NULL,
    ack TEXT NOT NULL,
    created_at REAL NOT NULL,
    handoff_at REAL,
    staged_at REAL,
    drained_at REAL,
    committed_at REAL,
    error TEXT NOT NULL DEFAULT '',
    attempt TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job, step)
);
CREATE TABLE IF NOT EXISTS ranks (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    state TEXT NOT NULL,
    PRIMARY KEY (job, step, rank)
);
CREATE TABLE IF NOT EXISTS shards (
    id INTEGER PRIMARY KEY,
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    staged_name TEXT NOT NULL,
    state TEXT NOT NULL,
    checksum TEXT NOT NULL DEFAULT '',
    handed_at REAL NOT NULL,
    staged_at REAL NOT NULL,
    drained_at REAL,
    error TEXT NOT NULL DEFAULT '',
    deferred INTEGER NOT NULL DEFAULT 0,
    UNIQUE (job, step, path)
);
CREATE TABLE IF NOT EXISTS uploads (
    shard_id INTEGER PRIMARY KEY,
    upload_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS upload_parts (
    shard_id INTEGER NOT NULL,
    number INTEGER NOT NULL,
    etag TEXT NOT NULL,
    checksum TEXT NOT NULL,
    PRIMARY KEY (shard_id, number)
);
CREATE TABLE IF NOT EXISTS owed_aborts (
    upload_id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL
);
"""


def upgrade(db: sqlite3.Connection) -> list[str]:
    """Add to a journal an older version wrote the columns :data:`SCHEMA` gained since
    (``CREATE TABLE IF NOT EXISTS`` leaves an existing table as it was); returns them as
    ``table.column``. A column added to the schema takes a DEFAULT (or NULL), so the rows
    already there read as they meant. Without this, a journal from before ``attempt`` or
    ``deferred`` existed failed the upgraded daemon's start as "a row this version cannot read
    ... written by a newer ckptdrain", whose advice (move the journal aside) set its
    acknowledged shards aside (found attacking upgrades). A missing column with no default
    cannot be added in place: :class:`ValueError` naming it."""
    want = sqlite3.connect(":memory:")
    try:
        want.executescript(SCHEMA)
        tables = [r[0] for r in want.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        missing = []
        for table in tables:
            have = {r[1] for r in db.execute(f'PRAGMA table_info("{table}")')}
            for _, name, kind, notnull, default, pk in want.execute(
                    f'PRAGMA table_info("{table}")'):
                if name in have:
                    continue
                if pk or (notnull and default is None):
                    raise ValueError(f"table {table!r} lacks column {name!r}, which has no "
                                     "default to give the rows already there")
                missing.append((table, name, f'"{name}" {kind}' + (" NOT NULL" if notnull else "")
                                + ("" if default is None else f" DEFAULT {default}")))
    finally:
        want.close()
    if missing:
        db.execute("BEGIN IMMEDIATE")  # all of them or none, should the daemon die meanwhile
        try:
            for table, _, column in missing:
                db.execute(f'ALTER TABLE "{table}" ADD COLUMN {column}')
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
    return [f"{table}.{name}" for table, name, _ in missing]


# Statement builders: keep SQL in one place so callers compose them into one transaction.


def claim_job(job: str, uid: int) -> tuple[str, tuple[Any, ...]]:
    return ("INSERT OR IGNORE INTO jobs (job, uid) VALUES (?, ?)", (job, uid))


def forget_job(job: str) -> tuple[str, tuple[Any, ...]]:
    return ("DELETE FROM jobs WHERE job = ?", (job,))


def put_generation(g: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT OR REPLACE INTO generations (job, step, world_size, state, ack, created_at,"
        " handoff_at, staged_at, drained_at, committed_at, error, attempt)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            g["job"], g["step"], g["world_size"], g["state"], g["ack"], g["created_at"],
            g["handoff_at"], g["staged_at"], g["drained_at"], g["committed_at"], g["error"],
            g["attempt"],
        ),
    )


def put_rank(job: str, step: int, rank: int, state: str) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT OR REPLACE INTO ranks (job, step, rank, state) VALUES (?, ?, ?, ?)",
        (job, step, rank, state),
    )


def put_shard(s: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT OR REPLACE INTO shards (id, job, step, rank, path, size, staged_name, state,"
        " checksum, handed_at, staged_at, drained_at, error, deferred)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            s["id"], s["job"], s["step"], s["rank"], s["path"], s["size"], s["staged_name"],
            s["state"], s["checksum"], s["handed_at"], s["staged_at"], s["drained_at"], s["error"],
            int(s["deferred"]),
        ),
    )


def delete_generation(job: str, step: int, attempt: str) -> list[tuple[str, tuple[Any, ...]]]:
    """Forget one attempt at a step. Keyed by the attempt: the rows at ``(job, step)`` go
    only while the generation row there is still that attempt's, so forgetting an old attempt
    late can never take a newer attempt's rows with it."""
    ours = "step IN (SELECT step FROM generations WHERE job = ? AND step = ? AND attempt = ?)"
    key = (job, step, job, step, attempt)
    shard_ids = f"SELECT id FROM shards WHERE job = ? AND step = ? AND {ours}"
    return [
        (f"DELETE FROM upload_parts WHERE shard_id IN ({shard_ids})", key),
        (f"DELETE FROM uploads WHERE shard_id IN ({shard_ids})", key),
        (f"DELETE FROM shards WHERE job = ? AND step = ? AND {ours}", key),
        (f"DELETE FROM ranks WHERE job = ? AND step = ? AND {ours}", key),
        ("DELETE FROM generations WHERE job = ? AND step = ? AND attempt = ?", (job, step, attempt)),
    ]


def begin_upload(shard_id: int, upload_id: str) -> list[tuple[str, tuple[Any, ...]]]:
    return [
        ("DELETE FROM upload_parts WHERE shard_id = ?", (shard_id,)),
        ("INSERT OR REPLACE INTO uploads (shard_id, upload_id) VALUES (?, ?)", (shard_id, upload_id)),
    ]


def part_done(shard_id: int, number: int, etag: str, checksum: str) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT OR REPLACE INTO upload_parts (shard_id, number, etag, checksum) VALUES (?, ?, ?, ?)",
        (shard_id, number, etag, checksum),
    )


def end_upload(shard_id: int) -> list[tuple[str, tuple[Any, ...]]]:
    return [
        ("DELETE FROM upload_parts WHERE shard_id = ?", (shard_id,)),
        ("DELETE FROM uploads WHERE shard_id = ?", (shard_id,)),
    ]


def owe_abort(upload_id: str, job: str, step: int, path: str) -> tuple[str, tuple[Any, ...]]:
    return ("INSERT OR REPLACE INTO owed_aborts (upload_id, job, step, path) VALUES (?, ?, ?, ?)",
            (upload_id, job, step, path))


def drop_owed_abort(upload_id: str) -> tuple[str, tuple[Any, ...]]:
    return ("DELETE FROM owed_aborts WHERE upload_id = ?", (upload_id,))


class JournalOwedAborts:
    """The journal's record of the aborts owed (owedaborts.py), by upload id with the shard's
    key: unlike the ``uploads`` row, it outlives the generation's rows when the generation is
    forgotten (a new attempt at its step, retention.keep_failed), so a restart still owes the
    abort."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    async def owe(self, upload_id: str, job: str, step: int, path: str) -> None:
        await self.journal.write(owe_abort(upload_id, job, step, path))

    async def done(self, upload_id: str) -> None:
        await self.journal.write(drop_owed_abort(upload_id))

    async def load(self) -> list[tuple[str, str, int, str]]:
        def read() -> list[tuple[str, str, int, str]]:
            assert self.journal._db is not None
            rows = self.journal._db.execute("SELECT upload_id, job, step, path FROM owed_aborts")
            return [(str(r[0]), str(r[1]), int(r[2]), str(r[3])) for r in rows]

        return await self.journal._run(read)


class JournalUploadLog:
    """The journal-backed :class:`~ckptdrain.daemon.backends.base.UploadLog` of one shard:
    where a multipart upload records its id and finished parts, so a restarted daemon resumes
    it (ListParts) instead of sending every part again, and the orphan sweep knows it is ours."""

    def __init__(self, journal: Journal, shard_id: int) -> None:
        self.journal = journal
        self.shard_id = shard_id

    async def load(self) -> tuple[str | None, dict[int, tuple[str, str]]]:
        snap_id = await self.journal._run(self._upload_id)
        if snap_id is None:
            return None, {}
        return snap_id, await self.journal.upload_parts(self.shard_id)

    def _upload_id(self) -> str | None:
        assert self.journal._db is not None
        row = self.journal._db.execute(
            "SELECT upload_id FROM uploads WHERE shard_id = ?", (self.shard_id,)
        ).fetchone()
        return None if row is None else str(row[0])

    async def begun(self, upload_id: str) -> None:
        await self.journal.write(*begin_upload(self.shard_id, upload_id))
        self.journal.open_uploads[self.shard_id] = (upload_id, time.monotonic())

    async def part_done(self, number: int, etag: str, checksum: str) -> None:
        await self.journal.write(part_done(self.shard_id, number, etag, checksum))

    async def finished(self) -> None:
        await self.journal.write(*end_upload(self.shard_id))
        self.journal.open_uploads.pop(self.shard_id, None)

    def is_open(self) -> bool:
        return self.shard_id in self.journal.open_uploads


class GroupCommit:
    """Acknowledging a staged shard takes three fsyncs: the staged file's (its bytes), the
    staging directory's (its rename) and the journal's (its record). Hand-offs that finish
    together share them: every journal write queued while the journal is busy goes in one
    transaction (:meth:`Journal.write`), the staged files of the batch are fsynced one after
    the other in the journal's thread (their writeback was started when each was renamed, so
    the first fsync's filesystem commit serves the rest), and the directory once.
    """

    def __init__(self, journal: Journal, before: Callable[[], None]) -> None:
        self.journal = journal
        self.before = before
        self.batches = 0  # for tests and status: how many commits served the hand-offs

    def _before(self) -> None:
        self.batches += 1
        self.before()

    async def __call__(self, *statements: tuple[str, tuple[Any, ...]],
                       before: Sequence[Callable[[], None]] = (), new: bool = False) -> None:
        """Journal ``statements`` once ``before`` (this hand-off's own fsyncs) and the
        shared directory fsync are done."""
        await self.journal.write(*statements, before=(*before, self._before), new=new)
