"""The journal's writes: group commit and a full disk.

Every write queued while the journal's thread is busy is committed with the others in one
transaction (one fsync of the write-ahead log), in queue order, after the calls that make
what its rows describe durable (``before``); a write whose own statement fails the batch is
tried again alone, failing only itself. On a full disk (or one that refuses writes) the
records of what already happened wait for room, in order, and new ones are refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptdrain.daemon.journalfaults import (
    JournalError,
    JournalFull,
    cannot_write,
    unwritable,
)
from ckptdrain.daemon.logs import log_event

# The journal's: its lines keep the name they were logged under.
log = logging.getLogger("ckptdrain.daemon.journal")

# While the journal's disk is full, a record of what already happened is tried again this
# often (doubling from the first), until it is written or the daemon stops.
FULL_RETRY_FIRST_S = 0.05
FULL_RETRY_MAX_S = 1.0


@dataclass(slots=True)
class QueuedWrite:
    statements: tuple[tuple[str, tuple[Any, ...]], ...]
    before: tuple[Callable[[], None], ...]
    done: asyncio.Future[None]
    new: bool  # it records something new (see Journal.write)


def _settle(batch: list[QueuedWrite], outcomes: list[BaseException | None]) -> None:
    for w, outcome in zip(batch, outcomes, strict=True):
        if w.done.done():
            continue  # its waiter was cancelled
        if outcome is None:
            w.done.set_result(None)
        else:
            w.done.set_exception(outcome)


class JournalWrites:
    """The journal's writes (its base; :class:`~ckptdrain.daemon.journal.Journal` sets
    these: its file, its connection and thread, and the queue's state)."""

    path: Path
    _executor: ThreadPoolExecutor
    _db: sqlite3.Connection | None
    _queue: list[QueuedWrite]
    _queue_lock: threading.Lock
    _flush_scheduled: bool
    full: bool
    _unwritable: str
    _closing: threading.Event
    batches: int
    transactions: int

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
            self._queue.append(QueuedWrite(statements, tuple(before), done, new))
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

    def _commit_batch(self, batch: list[QueuedWrite],
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

    def _wait_for_room(self, batch: list[QueuedWrite], todo: list[int],
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
