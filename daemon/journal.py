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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ckptdrain.daemon.journalfaults import (
    JournalError,
    JournalFull,
    JournalTooOld,
    cannot_write,
    damaged,
    is_damaged,
    is_full,
    unwritable,
)
from ckptdrain.daemon.journalrows import SCHEMA, upgrade
from ckptdrain.daemon.logs import log_event

T = TypeVar("T")
log = logging.getLogger(__name__)

# While the journal's disk is full, a record of what already happened is tried again this
# often (doubling from the first), until it is written or the daemon stops.
FULL_RETRY_FIRST_S = 0.05
FULL_RETRY_MAX_S = 1.0



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


@dataclass(slots=True)
class _Write:
    statements: tuple[tuple[str, tuple[Any, ...]], ...]
    before: tuple[Callable[[], None], ...]
    done: asyncio.Future[None]
    new: bool  # it records something new (see Journal.write)


def _settle(batch: list[_Write], outcomes: list[BaseException | None]) -> None:
    for w, outcome in zip(batch, outcomes, strict=True):
        if w.done.done():
            continue  # its waiter was cancelled
        if outcome is None:
            w.done.set_result(None)
        else:
            w.done.set_exception(outcome)


class Journal:
    """Async facade over one SQLite connection owned by one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._db: sqlite3.Connection | None = None
        # Writes waiting for the journal's thread (group commit, see write()).
        self._queue: list[_Write] = []
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

    def _tx(self, statements: Iterable[tuple[str, tuple[Any, ...]]]) -> None:
        assert self._db is not None, "journal is not open"
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                db.execute(sql, params)
            db.execute("COMMIT")  # where a full disk shows: the write-ahead log grows here
        except BaseException:
            # SQLite may have rolled back already (a full disk does); a transaction left open
            # would fail every later BEGIN ("within a transaction").
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
        self.transactions += 1

    async def write(self, *statements: tuple[str, tuple[Any, ...]],
                    before: Sequence[Callable[[], None]] = (), new: bool = False) -> None:
        """Apply ``statements`` in one durable transaction; the ``before`` calls run (in the
        journal's thread) ahead of it, and must all succeed for the statements to be written
        (the fsyncs that make what the rows describe durable).

        Group commit: every write queued while the journal's thread is busy is committed with
        the others in one transaction (one fsync of the write-ahead log), in the order they
        were queued. A ``before`` call shared by several writes (the same callable) runs once
        per batch, and every write's first call runs before any write's second: a batch of
        acknowledgements fsyncs all its staged files, then their directory once. A write that
        cannot be committed with the batch (its own statement failed) is retried alone, so it
        fails only itself. Whoever awaits may be cancelled; the write still happens, in its
        turn.

        A full disk fails no record of what already happened (a shard drained, a generation
        ended): the ledger has moved in memory, and a daemon whose journal lags behind what
        it did can lose acknowledged work at its next start (found with the staging disk
        filled by another user: a drained shard's staged copy was removed while its row still
        said staged). Such a write waits for room, tried again until it is written or the
        journal closes. ``new`` marks a record that starts something (a generation, a rank,
        a shard's acknowledgement): it fails with :class:`JournalFull` instead, at once while
        others wait, and its caller takes back what it added."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._queue_lock:
            # Under the lock the journal's thread takes to set ``full`` and clear the queue
            # of new records: checked outside it, a new record could slip in behind the
            # waiting ones and wait with them (found attacking it: 2 in 600 tries).
            if new and self.full:
                raise JournalFull(self.path, self._unwritable)
            self._queue.append(_Write(statements, tuple(before), done, new))
            if self._flush_scheduled:
                submit = False
            else:
                self._flush_scheduled = submit = True
        if submit:
            self._executor.submit(self._flush, asyncio.get_running_loop())
        await done

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the journal's thread: commit everything queued so far as one batch."""
        with self._queue_lock:
            batch, self._queue = self._queue, []
            self._flush_scheduled = False
        if not batch:
            return  # refused while the disk was full (_wait_for_room)
        outcomes = self._commit_batch(batch, loop)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody awaits any more
            loop.call_soon_threadsafe(_settle, batch, outcomes)

    def _commit_batch(self, batch: list[_Write],
                      loop: asyncio.AbstractEventLoop) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(batch)
        ran: dict[Callable[[], None], BaseException | None] = {}
        for k in range(max(len(w.before) for w in batch)):
            for i, w in enumerate(batch):
                if k >= len(w.before) or outcomes[i] is not None:
                    continue
                hook = w.before[k]
                if hook not in ran:
                    try:
                        hook()
                        ran[hook] = None
                    except Exception as exc:
                        ran[hook] = exc
                outcomes[i] = ran[hook]
        todo = [i for i, o in enumerate(outcomes) if o is None]
        if not todo:
            return outcomes
        try:
            self._tx([s for i in todo for s in batch[i].statements])
            self.batches += 1
            return outcomes
        except Exception as exc:
            if cannot_write(exc):
                return self._wait_for_room(batch, todo, outcomes, loop, unwritable(exc))
            if len(todo) == 1:
                outcomes[todo[0]] = exc
                return outcomes
        for k, i in enumerate(todo):  # isolate the write that failed the batch: each alone
            try:
                self._tx(batch[i].statements)
            except Exception as exc:
                if cannot_write(exc):
                    # This one and every one after it wait, in order: a later write made
                    # durable before an earlier one waiting for room broke the queue's order
                    # (found attacking it).
                    return self._wait_for_room(batch, todo[k:], outcomes, loop,
                                               unwritable(exc))
                outcomes[i] = exc
        return outcomes

    def _wait_for_room(self, batch: list[_Write], todo: list[int],
                       outcomes: list[BaseException | None],
                       loop: asyncio.AbstractEventLoop,
                       unwritable: str = "") -> list[BaseException | None]:
        """The disk is full: refuse the new records, this batch's and those queued behind it,
        now (their callers hold slots and room, and must hear at once), and write the rest
        once it has room (see :meth:`write`), trying again with a growing pause; the journal
        closing ends the wait. Each record is written on its own, as a failed batch's are.
        ``unwritable``: the journal's file refused the write (:func:`~ckptdrain.daemon.journalfaults.unwritable`) rather than
        ran out of room; it waits the same way, until it takes writes again."""
        refused = [batch[i] for i in todo if batch[i].new]
        with self._queue_lock:
            self._unwritable = unwritable
            self.full = True  # from here write(new=True) refuses without queueing
            refused += [w for w in self._queue if w.new]
            self._queue = [w for w in self._queue if not w.new]
        if refused:
            errors: list[BaseException | None] = [JournalFull(self.path, unwritable)
                                                  for _ in refused]
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody awaits
                loop.call_soon_threadsafe(_settle, refused, errors)
        for i in todo:
            if batch[i].new:
                outcomes[i] = JournalFull(self.path, unwritable)  # settled above
        waiting = [i for i in todo if not batch[i].new]
        if not waiting:
            self.full, self._unwritable = False, ""
            return outcomes
        if unwritable:
            log_event(log, logging.ERROR, "journal_unwritable", path=str(self.path),
                      waiting=len(waiting), error=unwritable,
                      action="the staging filesystem (staging_dir) refuses writes: read-only "
                      "after a disk error? (dmesg) Records of what the daemon did wait until "
                      "it takes them, and new hand-offs are refused until then; make it "
                      "writable, or restart the daemon once it is")
        else:
            log_event(log, logging.ERROR, "journal_full", path=str(self.path),
                      waiting=len(waiting), action="free space on the staging filesystem "
                      "(staging_dir): records of what the daemon did wait for room, and new "
                      "hand-offs are refused until then")
        pause = FULL_RETRY_FIRST_S
        try:
            while waiting:
                i = waiting[0]
                try:
                    self._tx(batch[i].statements)
                except Exception as exc:
                    if not cannot_write(exc):
                        outcomes[i] = exc
                    elif self._closing.wait(pause):
                        for k in waiting:
                            outcomes[k] = JournalError(
                                f"the journal {self.path} stayed "
                                f"{'unwritable' if unwritable else 'full'} until the daemon "
                                "stopped; "
                                "this record was not written (the next start goes by the last "
                                "one that was)")
                        return outcomes
                    else:
                        pause = min(pause * 2, FULL_RETRY_MAX_S)
                        continue
                waiting.pop(0)
                pause = FULL_RETRY_FIRST_S
        finally:
            self.full = False
            self._unwritable = ""
        log_event(log, logging.INFO, "journal_writable", path=str(self.path))
        return outcomes

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
