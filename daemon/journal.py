"""The crash-safe record of every generation, rank, shard and upload this node holds.

SQLite in WAL mode with ``synchronous=FULL``: a committed transaction survives a daemon crash
and a power loss, it is in the standard library, and one file holds everything a restart needs.
All SQLite calls run on one dedicated thread, so the event loop never waits on an fsync and
the connection is never shared between threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ckptdrain.daemon.journalfaults import (
    JournalError,
    JournalTooOld,
    damaged,
    is_damaged,
    is_full,
)
from ckptdrain.daemon.journalrows import SCHEMA, upgrade
from ckptdrain.daemon.journalwrites import JournalWrites, QueuedWrite
from ckptdrain.daemon.logs import log_event

T = TypeVar("T")
log = logging.getLogger(__name__)

# The write-ahead log's size after a checkpoint: its blocks are kept for the next writes (the
# journal's reserve on a full staging disk is this large, journalroom.py).
WAL_KEPT_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the journal holds, read once at start-up for recovery."""

    jobs: dict[str, int]
    generations: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    shards: list[dict[str, Any]]
    uploads: dict[int, str]


class Journal(JournalWrites):
    """Async facade over one SQLite connection owned by one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._db: sqlite3.Connection | None = None
        # Writes waiting for the journal's thread (group commit, see write()).
        self._queue: list[QueuedWrite] = []
        self._queue_lock = threading.Lock()
        self._flush_scheduled = False
        # Set by the journal's thread while its disk is full and records wait for room: a new
        # record is refused at once meanwhile (write(new=True)) instead of queueing behind.
        self.full = False
        # While ``full``: what the journal's file said if it refused writes rather than
        # ran out of room (_unwritable), for the refusals and the log.
        self._unwritable = ""
        # Set when the journal closes: records still waiting for room give up then.
        self._closing = threading.Event()
        # Counted for tests and benchmarks: write() batches, and SQLite transactions committed
        # (each one fsync of the write-ahead log).
        self.batches = 0
        self.transactions = 0
        # shard id -> (upload id, when begun, monotonic): multipart uploads not yet completed or aborted,
        # kept beside the uploads table so `status` answers from memory.
        self.open_uploads: dict[int, tuple[str, float]] = {}
        self.fresh = False  # made (or found empty) by open(): it knew nothing
        self._said_not_remade = False  # keep_linked's failure is logged once

    # -- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        try:
            await self._run(self._open)
        except sqlite3.DatabaseError as exc:
            if is_damaged(exc):
                # A journal cut short (a truncated copy, a partial restore) or damaged in its
                # first pages said "check the disk for I/O errors and free space", and not
                # that its records are nowhere else, nor how to recover them (found attacking).
                raise damaged(self.path, exc) from None
            raise self._unopened(exc) from None
        except (sqlite3.Error, OSError) as exc:
            raise self._unopened(exc) from None

    def _unopened(self, exc: BaseException) -> JournalError:
        return JournalError(
            f"cannot open the journal {self.path}: {exc}; check the staging disk "
            "(staging_dir) for I/O errors and free space, then start the daemon again")

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # A journal made (or found empty) now knows nothing: recovery then sets staged shard
        # files aside rather than removing them as strays (Staging.set_aside).
        try:
            self.fresh = os.stat(self.path).st_size == 0
        except FileNotFoundError:
            self.fresh = True
        # Private whatever the umask: it names every user's jobs and their errors. SQLite
        # gives its -wal and -shm files the database file's mode.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        for side in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f"{self.path}{side}", 0o600)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
            # Incremental: compact() can then give freed pages back without a full VACUUM.
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._vacuum(db)
        db.execute("PRAGMA journal_mode=WAL")
        # A WAL reset after a checkpoint is cut back to this, never to nothing (compact).
        db.execute(f"PRAGMA journal_size_limit={WAL_KEPT_BYTES}")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=OFF")
        db.executescript(SCHEMA)
        try:
            added = upgrade(db)
        except ValueError as exc:
            db.close()
            raise JournalTooOld(
                f"the journal {self.path} was written by an older ckptdrain that this version "
                f"cannot upgrade in place: {exc}; start the version that wrote it, let it "
                "drain what it holds (`ckptdrain drain --wait`), stop it, then move the "
                "journal aside and start this version") from None
        if added:
            log_event(log, logging.WARNING, "journal_upgraded", path=str(self.path),
                      columns=",".join(added),
                      action="the journal was written by an older ckptdrain: its tables gained "
                      "the columns this version records (an older version still reads it)")
        self._db = db

    def _vacuum(self, db: sqlite3.Connection) -> None:
        """Rewrite the journal with its new auto_vacuum mode: a journal an older version made
        has none. The rewrite needs room for a copy of the journal, which a full staging disk
        has not: it failed the start (exit 75, retried for as long as the disk stayed full)
        of a daemon upgraded onto it, whose acknowledged shards only it can drain and so make
        room (found attacking upgrades). The mode is no record: the journal opens without it,
        and a later start with room rewrites it."""
        try:
            db.execute("VACUUM")
        except sqlite3.Error as exc:
            if not is_full(exc):
                raise  # a read-only or failing disk: no room is not the cause, the open fails
            log_event(log, logging.WARNING, "journal_not_vacuumed", path=str(self.path),
                      error=str(exc), action="the staging filesystem has no room to rewrite "
                      "the journal an older version made; it is used as it is (its file does "
                      "not shrink as it forgets) until a start with room rewrites it")

    async def close(self) -> None:
        self._closing.set()
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._executor.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    async def keep_linked(self) -> bool:
        """Write the journal again at its path if something removed it (with its -wal and
        -shm) under the running daemon, and go on in that file; True if it did. SQLite
        writes on into the files it holds open, unlinked: every record since, and all before,
        went with them at the next stop, and the restart found no journal (the generations
        in flight lost, their shards set aside: found attacking restarts). The copy is made
        in the journal's thread, between writes, so it holds every record made so far."""
        try:
            return await self._run(self._keep_linked)
        except (sqlite3.Error, OSError) as exc:  # (staging_dir itself gone) tried again later
            if not self._said_not_remade:  # tried every second: said once
                self._said_not_remade = True
                log_event(log, logging.ERROR, "journal_not_remade", path=str(self.path),
                          error=str(exc), action="the journal was removed under the running "
                          "daemon and cannot be written again there: make staging_dir "
                          "writable (records go on into the removed file meanwhile)")
            return False

    def _keep_linked(self) -> bool:
        if self._db is None or os.path.lexists(self.path):
            return False
        tmp = self.path.with_name(f"{self.path.name}.remade")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        self._db.execute("VACUUM INTO ?", (str(tmp),))
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)  # never a journal cut short at the path
        old, self._db = self._db, None
        with contextlib.suppress(sqlite3.Error):
            old.close()
        self._open()  # the new file's own -wal and -shm
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        log_event(log, logging.ERROR, "journal_removed_remade", path=str(self.path),
                  action="something removed the journal under the running daemon; it was "
                  "written again from the open one, no record lost: keep tmp cleaners and "
                  "people out of staging_dir")
        return True

    async def compact(self) -> None:
        """Give back the pages of forgotten rows and checkpoint the write-ahead log, so the
        journal's size follows what the node holds now, not everything it ever held. The WAL
        keeps its blocks, up to WAL_KEPT_BYTES: emptied (TRUNCATE), a full staging disk's
        other user took them at once, and the journal could write nothing more, nor its
        reserve be kept at the stop (found attacking the journal's reserve)."""
        def run() -> None:
            assert self._db is not None
            # Run to completion: through execute() the pragma frees a single page.
            self._db.executescript("PRAGMA incremental_vacuum;")
            self._db.execute("PRAGMA wal_checkpoint(RESTART)")

        await self._run(run)

    # -- reads -------------------------------------------------------------------------------
    async def load(self) -> Snapshot:
        try:
            return self._note_uploads(await self._run(self._load))
        except sqlite3.DatabaseError as exc:
            # Damage past the header opens fine and fails here (found attacking: a page of
            # zeros ended start-up in a traceback).
            raise damaged(self.path, exc) from None

    def _load(self) -> Snapshot:
        assert self._db is not None
        db = self._db
        return Snapshot(
            jobs={r["job"]: r["uid"] for r in db.execute("SELECT job, uid FROM jobs")},
            generations=[dict(r) for r in db.execute("SELECT * FROM generations ORDER BY created_at")],
            ranks=[dict(r) for r in db.execute("SELECT * FROM ranks")],
            shards=[dict(r) for r in db.execute("SELECT * FROM shards ORDER BY id")],
            uploads={r["shard_id"]: r["upload_id"] for r in db.execute("SELECT * FROM uploads")},
        )

    def _note_uploads(self, snap: Snapshot) -> Snapshot:
        # Uploads begun before a restart are open until they complete or are aborted; their
        # age is counted from this start (on the monotonic clock, as every age).
        now = time.monotonic()
        for shard_id, upload_id in snap.uploads.items():
            self.open_uploads.setdefault(shard_id, (upload_id, now))
        return snap

    async def upload_parts(self, shard_id: int) -> dict[int, tuple[str, str]]:
        def read() -> dict[int, tuple[str, str]]:
            assert self._db is not None
            rows = self._db.execute(
                "SELECT number, etag, checksum FROM upload_parts WHERE shard_id = ?", (shard_id,)
            )
            return {r["number"]: (r["etag"], r["checksum"]) for r in rows}

        return await self._run(read)

    async def next_shard_id(self) -> int:
        def read() -> int:
            assert self._db is not None
            row = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM shards").fetchone()
            return int(row[0]) + 1

        return await self._run(read)
