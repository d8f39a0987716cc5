"""Aborts of this node's journalled multipart uploads that can no longer complete, and the
ones still owed: an abort that failed (the destination down at that moment) is tried again,
with backoff, until the destination answers, instead of waiting for the orphan sweep, which
skips uploads younger than ``destination.orphan_grace_s`` (an hour by default).

One owner: every abort of a shard's journalled upload goes through :class:`UploadAborts`,
and one task (:meth:`UploadAborts.run`, in the daemon's TaskGroup) tries the owed ones again.
What is owed is also durable: the journal keeps an upload's row until its abort is confirmed,
and a restart owes again every upload journalled for a shard that will not drain again
(recovery.py).

An abort never runs under a drain that resumes the same upload (``ckptdrain retry`` of the
failed generation reuses its journalled upload through ListParts): an abort is only begun
while no drain may take the shard (:func:`wanted`), and a drain about to send a shard first
waits for an abort of it in flight to end (:meth:`UploadAborts.settled`), each try being
bounded. The drain then finds the upload gone and its journal row cleared (a new upload), or
still there (resumed), never aborted under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ckptdrain.client.manifest import shard_key
from ckptdrain.daemon.backends.base import Backend, BackendError, UploadLog
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord

# The scheduler's: abort_failed lines keep the name they were logged under.
log = logging.getLogger("ckptdrain.scheduler")

# An owed abort is tried again after FIRST_RETRY_S, then twice as long each time it fails,
# up to MAX_RETRY_S: after an outage of any length it is done within about a minute of the
# destination answering again (and the rest at once, once one is).
FIRST_RETRY_S = 2.0
MAX_RETRY_S = 60.0
# Bound on one try, beyond the backend's own (an S3 abort-and-confirm is bounded by its
# cleanup timeout): a drain waiting for the try waits no longer than this.
TRY_TIMEOUT_S = 90.0

_OWED = ("owed: tried again with backoff (at least once a minute) until the destination "
         "answers, well before the orphan sweep's grace")


def wanted(gen: GenerationRecord, shard: ShardRecord) -> bool:
    """Whether the upload of ``shard`` may be aborted now: unless a drain may still take (or
    has taken) the shard, which resumes the same upload."""
    return gen.terminal or shard.state not in (ShardState.STAGED, ShardState.DRAINING)


@dataclass
class _Owed:
    gen: GenerationRecord
    shard: ShardRecord
    upload_id: str
    since: float  # time.monotonic() when first owed
    due: float  # time.monotonic() of the next try
    backoff: float = 0.0  # the wait before that try (doubled at each failure)
    tries: int = 0  # failed tries so far
    # When last tried (UploadAborts' count of tries): among aborts due together the one tried
    # longest ago goes first, so one that fails every time (refused for its key, or never
    # confirmed) is not the one that stands for all at every round.
    turn: int = 0
    recorded: bool = False  # in the journal's owed_aborts (OwedRecord)


class OwedRecord(Protocol):
    """Where owed aborts are kept across a restart, by upload id with the shard's key
    (journalrows.JournalOwedAborts): the ``uploads`` row goes when the generation is
    forgotten, and an abort owed then was lost with it at the next start."""

    async def owe(self, upload_id: str, job: str, step: int, path: str) -> None: ...

    async def done(self, upload_id: str) -> None: ...


class _Pinned:
    """``inner`` (a shard's journal log), for the abort of one known upload: the abort reads
    that upload's id, and clears the journal's row only while it still names it (an owed
    abort's generation may have been forgotten meanwhile, its rows with it)."""

    def __init__(self, inner: UploadLog, upload_id: str) -> None:
        self.inner = inner
        self.upload_id = upload_id

    async def load(self) -> tuple[str | None, dict[int, tuple[str, str]]]:
        return self.upload_id, {}

    async def begun(self, upload_id: str) -> None:
        raise AssertionError("an abort begins no upload")

    async def part_done(self, number: int, etag: str, checksum: str) -> None:
        raise AssertionError("an abort sends no part")

    async def finished(self) -> None:
        current, _ = await self.inner.load()
        if current == self.upload_id:
            await self.inner.finished()

    def is_open(self) -> bool:
        return self.inner.is_open()


class UploadAborts:
    """The aborts of shards' journalled uploads, and those owed (see the module's doc)."""

    def __init__(self, backend: Backend,
                 upload_log_for: Callable[[ShardRecord], UploadLog | None] | None) -> None:
        self.backend = backend
        self._upload_log_for = upload_log_for
        self._owed: dict[int, _Owed] = {}  # by shard id
        self._busy: dict[int, asyncio.Event] = {}  # shard id -> set when its abort ends
        self._wake = asyncio.Event()
        self._turns = 0
        # Set by the daemon (its journal); None: owed aborts are kept in memory alone.
        self.record: OwedRecord | None = None

    @property
    def owed(self) -> int:
        return len(self._owed)

    def owe(self, gen: GenerationRecord, shard: ShardRecord, upload_id: str, *,
            recorded: bool = False) -> None:
        """Owe the abort of ``upload_id`` (journalled for ``shard``), due now: a restart's, of
        an upload whose shard will not drain again (``recorded``: in the journal's
        owed_aborts already)."""
        now = time.monotonic()
        self._owed[shard.id] = _Owed(gen, shard, upload_id, since=now, due=now,
                                     recorded=recorded)
        self._wake.set()

    async def leave(self, gen: GenerationRecord, shard: ShardRecord) -> None:
        """Owe the abort of the upload journalled for ``shard``, for a caller that must not
        wait for the destination (a begin replacing ``gen``, under its step's lock): run()
        tries it at once, or with the others already owed while the destination is down.
        Tried here, a destination answering nothing held the new attempt's begin for the
        abort's cleanup timeout per failed shard (found attacking an outage)."""
        upload_log = self._upload_log_for(shard) if self._upload_log_for else None
        if upload_log is None or not upload_log.is_open():
            return
        upload_id, _ = await upload_log.load()
        if upload_id is None:
            return
        entry = self._owed.get(shard.id)
        if entry is None or entry.upload_id != upload_id:
            self.owe(gen, shard, upload_id)
        # Recorded before the caller forgets the generation, its journal rows with it.
        await self._note(shard, entry)

    async def leave_all(self, gen: GenerationRecord) -> None:
        """:meth:`leave` for every shard of ``gen``, about to be forgotten (Ledger.forgetting:
        a new attempt at its step, retention.keep_failed, forget_after_s), its journal rows
        with it. Every shard, not only the failed ones: the end's abort of a shard not yet
        drained (queued on the publisher, or a drain's own once its copy is cancelled) ran
        after the delete, found nothing journalled, and the upload waited for the orphan
        sweep's grace. A dict lookup per shard with no upload open."""
        for shard in gen.shards.values():
            await self.leave(gen, shard)

    async def _note(self, shard: ShardRecord, before: _Owed | None) -> None:
        """Keep the journal's owed_aborts as ``shard``'s owed abort now is (``before``: as it
        was): a row while owed, none once done or a retry's upload again."""
        after = self._owed.get(shard.id)
        if self.record is None:
            return
        try:
            if (before is not None and before.recorded
                    and (after is None or after.upload_id != before.upload_id)):
                await self.record.done(before.upload_id)
            if after is not None and not after.recorded:
                await self.record.owe(after.upload_id, shard.job, shard.step, shard.path)
                after.recorded = True
        except Exception as exc:  # the journal's own failure: said where it happens
            log_event(log, logging.WARNING, "owed_abort_not_journalled", job=shard.job,
                      step=shard.step, path=shard.path, error=str(exc) or type(exc).__name__,
                      action="tried again while the daemon runs; after a restart, left to "
                             "the orphan sweep")

    async def settled(self, shard: ShardRecord) -> None:
        """Return once no abort of ``shard``'s upload is in flight (each try is bounded)."""
        while (done := self._busy.get(shard.id)) is not None:
            await done.wait()

    async def abort(self, gen: GenerationRecord, shard: ShardRecord, *,
                    upload_id: str | None = None) -> bool:
        """Abort the upload journalled for ``shard`` (``upload_id``, or the journal's) and clear
        its row; True when nothing is left. One that fails is owed, and tried again; one a
        drain may resume now is not aborted (False)."""
        await self.settled(shard)
        before = self._owed.get(shard.id)
        done = await self._abort(gen, shard, upload_id)
        await self._note(shard, before)
        return done

    async def _abort(self, gen: GenerationRecord, shard: ShardRecord,
                     upload_id: str | None) -> bool:
        owed = self._owed.get(shard.id)
        if not wanted(gen, shard):
            self._owed.pop(shard.id, None)  # a retry drains it: its upload is the drain's
            return False
        upload_log = self._upload_log_for(shard) if self._upload_log_for else None
        if upload_log is None or (upload_id is None and owed is None
                                  and not upload_log.is_open()):
            # None journalled (the usual case, and every shard of a destination without
            # resumable uploads): asked of memory, not of the journal, shard by shard.
            self._owed.pop(shard.id, None)
            return True
        done = asyncio.Event()
        self._busy[shard.id] = done  # with nothing awaited since wanted() was asked
        aborted = False
        try:
            if upload_id is None:
                upload_id, _ = await upload_log.load()
            if upload_id is None:
                # Nothing journalled, but an abort owed: its generation was forgotten (the
                # rows deleted) after it was owed. That upload is still open: a cancelled
                # drain's abort coming after the forget dropped the owed one.
                if owed is None or self._owed.get(shard.id) is not owed:
                    return True
                upload_id = owed.upload_id
            try:
                async with asyncio.timeout(TRY_TIMEOUT_S):
                    aborted = await self.backend.abort_upload(
                        shard_key(shard.job, shard.step, shard.path),
                        _Pinned(upload_log, upload_id))
            except (BackendError, TimeoutError) as exc:
                log_event(log, logging.WARNING, "abort_failed", job=shard.job, step=shard.step,
                          path=shard.path, upload_id=upload_id,
                          error=str(exc) or "timed out", action=_OWED)
        finally:
            del self._busy[shard.id]
            done.set()
        if self._owed.get(shard.id) is owed:
            self._owed.pop(shard.id, None)
        if aborted:
            if owed is not None and owed.tries:
                log_event(log, logging.INFO, "owed_abort_done", job=shard.job,
                          step=shard.step, path=shard.path, upload_id=upload_id,
                          tries=owed.tries + 1,
                          owed_s=round(time.monotonic() - owed.since, 1))
                self._all_due()  # the destination answers again: the rest need not wait
            return True
        if wanted(gen, shard) and shard.id not in self._owed:
            self._owe_again(gen, shard, upload_id, owed)
        return False

    def _owe_again(self, gen: GenerationRecord, shard: ShardRecord, upload_id: str,
                   before: _Owed | None) -> None:
        now = time.monotonic()
        if before is None or before.upload_id != upload_id:
            before = _Owed(gen, shard, upload_id, since=now, due=now)
        backoff = min(max(before.backoff * 2, FIRST_RETRY_S), MAX_RETRY_S)
        self._owed[shard.id] = _Owed(gen, shard, upload_id, since=before.since,
                                     due=now + backoff, backoff=backoff,
                                     tries=before.tries + 1, turn=before.turn,
                                     recorded=before.recorded)
        if before.tries == 0:
            log_event(log, logging.INFO, "abort_owed", job=shard.job, step=shard.step,
                      path=shard.path, upload_id=upload_id, action=_OWED)
        self._wake.set()

    def _all_due(self) -> None:
        now = time.monotonic()
        for entry in self._owed.values():
            entry.due = min(entry.due, now)
        self._wake.set()

    async def run(self) -> None:
        """Try the owed aborts as they fall due, the one tried longest ago first. A try that
        fails puts the others off till its next one: the destination is still down, and one
        try at a time says so (a try against an endpoint that answers nothing takes up to its
        timeout). The next round begins with another: an abort refused every time while the
        destination answers (a bucket policy on its key) held every other owed abort back for
        good when the oldest went first at every round (found attacking)."""
        while True:
            self._wake.clear()
            if not self._owed:
                await self._wake.wait()
                continue
            delay = min(entry.due for entry in self._owed.values()) - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                continue
            await self._round()

    async def _round(self) -> None:
        now = time.monotonic()
        for entry in sorted((e for e in self._owed.values() if e.due <= now),
                            key=lambda e: (e.due, e.turn, e.since)):
            if self._owed.get(entry.shard.id) is not entry:
                continue  # done, given to a retry, or owed again meanwhile
            self._turns += 1
            entry.turn = self._turns
            try:
                await self.abort(entry.gen, entry.shard, upload_id=entry.upload_id)
            except Exception:
                # The boundary (a journal that cannot be read, a bug): this abort waits for
                # its next try, and the daemon, whose task this is, carries on.
                log.exception("owed abort of %s (upload %s) failed", entry.shard.path,
                              entry.upload_id)
                if self._owed.get(entry.shard.id) is entry:
                    self._owe_again(entry.gen, entry.shard, entry.upload_id, entry)
            again = self._owed.get(entry.shard.id)
            if again is not None and again is not entry:
                for other in self._owed.values():
                    other.due = max(other.due, again.due)
                return
