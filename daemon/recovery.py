"""Start-up recovery: rebuild what this node had acknowledged, clean up what it had not.

Runs before the socket is served. Acknowledged shards go back on the drain queue, temp files
and shards the journal never acknowledged are deleted, every kept file is counted against the
limits again, and generations that cannot go on (a rank still open at the crash or already
aborted, a memory hand-off that never reached local storage) fail here. The uploads journalled
for shards that will not drain again (their generation ended, or they drained another way) are
owed an abort (owedaborts.py), tried once the daemon runs and again until the destination
answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon.errors import StartupError
from ckptdrain.daemon.journalrows import JournalOwedAborts, drop_owed_abort
from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.records import SAVE_AGAIN
from ckptdrain.daemon.state import (
    UNDRAINED_SHARD,
    GenerationState,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.recovery")


async def _give_up(d: Daemon, gen: GenerationRecord) -> None:
    """``gen`` failed, and the copies kept for its ``retry`` are gone (removed while the daemon
    was down): its undrained shards are discarded, as where a generation that cannot be
    retried ends (Endings._end), and its copies go. Left "failed", they were the job's oldest
    undrained shards for good (CkptdrainOldestUndrainedTooOld fired until the job committed a
    newer step, or for a day), `ckptdrain drain` counted them as kept for `retry`, while
    `retry` refused them and `abort` said there was nothing to abort (found attacking what
    operators see)."""
    undrained: list[tuple[ShardRecord, dict[str, Any]]] = [
        (s, {}) for s in gen.shards.values() if s.state in UNDRAINED_SHARD]
    if undrained:
        await d.ledger.apply_shards(undrained, ShardEvent.DISCARDED)
    d.copies.discard_generation(gen)


async def recover(d: Daemon) -> None:
    """Rebuild from the journal and sweep the staging directory; what the staging directory
    does not let it do ends the start naming ``staging_dir`` (any OSError escaping here was
    reported as "socket: cannot serve": found attacking restarts)."""
    try:
        await _recover(d)
    except OSError as exc:
        raise StartupError("staging_dir", f"cannot recover what {d.config.staging_dir} holds "
                           f"({exc.strerror or exc}: {exc.filename or ''}); make it a "
                           "directory of the daemon's own files, writable by it") from None


async def _recover(d: Daemon) -> None:
    uploads = await d.ledger.load()
    keep: set[str] = set()
    requeue: list[tuple[GenerationRecord, ShardRecord]] = []
    exists = await d.dataplane.call(_existing, d.staging.dir)
    for gen in sorted(d.ledger.generations.values(), key=lambda g: g.created_at):
        if not gen.terminal:
            d.admission.adopt_generation(gen)
        open_ranks = [r for r, st in gen.ranks.items() if st is RankState.OPEN]
        # Aborting a rank and failing its generation are two journal writes (at run time, and
        # below for a rank open at the crash): a crash between them leaves an aborted rank
        # in a generation that is not failed, which would wait for good for that rank.
        aborted = [r for r, st in gen.ranks.items() if st is RankState.ABORTED]
        # Ended for good (cancelled, or failed with nothing a retry could save): what it staged
        # goes now. Giving a generation up is several journal writes, and a kill between them
        # left its shards staged across every restart (found racing aborts with kill -9).
        given_up = gen.state is GenerationState.CANCELLED or (
            gen.state is GenerationState.FAILED and bool(gen.why_not_retryable()))
        for shard in gen.shards.values():
            if given_up and shard.state is not ShardState.DISCARDED:
                await d.ledger.apply(shard, ShardEvent.DISCARDED)
                shard.local_copy = False
                continue
            if shard.state in (ShardState.STAGED, ShardState.FAILED, ShardState.DRAINED):
                # A drained copy with keep_local_copy off was on its way out (dropped, its
                # unlink not done when the daemon stopped): the sweep below removes it.
                wanted = shard.state is not ShardState.DRAINED or d.copies.keep_after_drain
                if wanted and shard.staged_name in exists:
                    keep.add(shard.staged_name)
                    # Held against the limits exactly as while running, whatever the
                    # generation's state: a failed one keeps its copy for retry.
                    d.copies.recovered(shard)
                else:
                    shard.local_copy = False
        if gen.state is GenerationState.FAILED and not given_up and gen.why_not_retryable():
            # Its copies kept for `retry` are gone (removed while the daemon was down): left,
            # its shards stayed "failed" across every restart, the job's oldest undrained for
            # good, that `retry` and `abort` both refused (found attacking). Given up now.
            await _give_up(d, gen)
            continue
        if gen.terminal:
            continue
        held = [s.path for s in gen.shards.values() if s.state is ShardState.HELD]
        if held:
            for shard in gen.shards.values():
                if shard.state is ShardState.HELD:
                    await d.ledger.apply(shard, ShardEvent.DISCARDED)
            await d.fail(gen, f"the daemon stopped before {held[:3]} (ack=memory) reached "
                              "local storage; memory hand-offs do not survive a daemon "
                              f"crash; {SAVE_AGAIN}", kind="interrupted", record_first=False)
            continue
        if open_ranks or aborted:
            for r in open_ranks:
                await d.ledger.apply((gen, r), RankEvent.ABORTED)
            why = (f"the daemon restarted while rank(s) {open_ranks} were still handing off"
                   if open_ranks else f"rank(s) {aborted} had been aborted when the daemon "
                   "stopped")
            await d.fail(gen, f"{why}; {SAVE_AGAIN}", kind="interrupted", record_first=False)
            continue
        failed = [s for s in gen.shards.values() if s.state is ShardState.FAILED]
        if failed:
            # Failing a shard and its generation are two journal writes too: a crash between
            # them left a generation that waited for good on a shard that never drains
            # (chaos seed 39036). It fails now as it would have; `retry` resends the copy.
            await d.fail(gen, failed[0].error or f"shard {failed[0].path!r} could not drain",
                         kind="drain", record_first=False)
            continue
        for shard in gen.shards.values():
            if shard.state is ShardState.STAGED:
                if not shard.local_copy:
                    await d.fail(gen, f"staged copy of {shard.path!r} is missing", kind="drain",
                                 record_first=False)
                    break
                requeue.append((gen, shard))
    # Uploads of generations that ended (here, or before the crash; an abort that failed
    # then is still journalled), and of shards that drained another way (a PutObject after
    # multipart_threshold_bytes was raised), are owed their abort now: tried as soon as the
    # daemon runs, and again until the destination answers. The orphan sweep cannot do it:
    # it skips anything younger than orphan_grace_s. A `ckptdrain retry` of a failed one
    # before then takes its upload back (UploadAborts.abort: not wanted any more).
    recorded = await JournalOwedAborts(d.journal).load()
    recorded_ids = {row[0] for row in recorded}
    owed: set[str] = set()
    for gen in d.ledger.generations.values():
        for shard in gen.shards.values():
            upload_id = uploads.get(shard.id)
            if upload_id is not None and (gen.terminal or shard.state is ShardState.DRAINED):
                d.scheduler.aborts.owe(gen, shard, upload_id,
                                       recorded=upload_id in recorded_ids)
                owed.add(upload_id)
    await _owe_forgotten(d, recorded, owed, set(uploads.values()))
    # Whether a copy is still kept is not journalled: an older committed generation's copy,
    # dropped before the restart but still read then (a lent copy), came back as a kept copy
    # charged to no one (found attacking). Dropped again, as at its newer one's commit.
    newest: dict[str, GenerationRecord] = {}
    for gen in d.ledger.generations.values():
        if gen.state is GenerationState.COMMITTED and (
                gen.job not in newest or gen.step > newest[gen.job].step):
            newest[gen.job] = gen
    for gen in newest.values():
        d.copies.drop_older_committed(gen)
        d.metrics.recovered_commit(gen.job, gen.step, gen.committed_at or gen.created_at)
    # A journal that knows no generation knows nothing: every hand-off journals its
    # generation before its first shard file is staged, so a stray left by a crash always has
    # its generation's row. Only the size of the journal's file was asked, and one whose
    # -wal and -shm were removed after a kill -9 (taken for SQLite's leftovers) is the
    # database header alone: the shards it had acknowledged went as strays, with one info
    # line (found attacking restarts). A journal that knows older generations lost only the
    # newest records with its -wal (JournalReserve.tail_lost): the files it does not know go
    # aside likewise.
    lost = d.journal.fresh or not d.ledger.generations
    unknown = exists - keep
    if unknown and (lost or d.journal_reserve.tail_lost):
        aside = d.staging.dir.parent / "journal-lost" / time.strftime("%Y%m%dT%H%M%SZ",
                                                                     time.gmtime())
        moved = await d.dataplane.call(d.staging.set_aside, aside, frozenset(keep))
        why = (f"the journal {d.journal.path} was new, or held no generation (its -wal "
               "removed after a crash?), while staging held shard files (hand-offs not yet "
               "drained, or copies kept of drained ones): its records of them are lost, and "
               "so is every generation it had not committed yet" if lost else
               f"the journal's -wal ({d.journal.path}-wal) was missing after a daemon that "
               "did not stop cleanly (removed as SQLite's leftovers? it held the newest "
               "records): staging held shard files it does not know, acknowledged hand-offs "
               "whose records went with it (their generations fail)")
        log_event(log, logging.ERROR, "journal_lost_shards_set_aside", files=moved,
                  directory=str(aside),
                  action=f"{why}; the files are kept there, outside max_staged_bytes, for "
                         "inspection: delete them when done")
        removed, still_read = 0, list[tuple[str, int, int | None]]()
    else:
        removed, still_read = await d.dataplane.call(d.staging.sweep, keep)
    for name, size, owner in still_read:  # lent before the restart, a reader holds it still
        d.copies.held_from_before(name, size, owner)
    for gen, shard in requeue:
        if not gen.terminal and not shard.deferred:
            d.scheduler.enqueue(gen, shard)
    log_event(log, logging.INFO, "recovered", generations=len(d.ledger.generations),
              requeued=len(requeue), removed_files=removed)


async def _owe_forgotten(d: Daemon, recorded: list[tuple[str, str, int, str]], owed: set[str],
                         journalled: set[str]) -> None:
    """Owe again the aborts recorded as owed whose generation was forgotten before the
    restart (a new attempt at its step, retention.keep_failed, forget_after_s): their
    ``uploads`` rows went with it, and so did the abort (left to the orphan sweep's grace,
    found attacking). Each gets a stand-in record of its shard (a negative id, which no
    shard has); one whose upload a live shard holds again (a retry's) is that drain's."""
    now = time.time()
    stand_in = 0
    for upload_id, job, step, path in recorded:
        if upload_id in owed:
            continue
        if upload_id in journalled:  # a retried shard's, which its drain resumes
            await d.journal.write(drop_owed_abort(upload_id))
            continue
        stand_in -= 1
        gen = GenerationRecord(job, step, 1, "local", now, state=GenerationState.FAILED)
        shard = ShardRecord(stand_in, job, step, 0, path, 0, "", ShardState.FAILED, now, now)
        gen.shards[path] = shard
        d.scheduler.aborts.owe(gen, shard, upload_id, recorded=True)


def _existing(directory: Path) -> set[str]:
    """Names of the staged files present: one directory scan, not a stat per shard."""
    return {entry.name[: -len(".data")] for entry in os.scandir(directory)
            if entry.name.endswith(".data")}


async def owned_upload_ids(d: Daemon) -> set[str]:
    """Uploads this node will still resume: those of shards in generations in flight. A
    failed or finished generation's upload is an orphan like any other, for the sweep."""
    snap = await d.journal.load()
    live = {s.id for g in d.ledger.generations.values() if not g.terminal for s in g.shards.values()}
    return {upload for shard_id, upload in snap.uploads.items() if shard_id in live}


async def sweep_once(d: Daemon, *, timeout_s: float) -> None:
    try:
        owned = await owned_upload_ids(d)
        async with asyncio.timeout(timeout_s):
            aborted = await d.backend.sweep_orphans(owned, d.config.destination.orphan_grace_s)
        if aborted:
            log_event(log, logging.INFO, "orphans_swept", removed=aborted)
    except Exception as exc:  # the destination may be down; draining retries on its own
        log_event(log, logging.WARNING, "orphan_sweep_failed", error=str(exc) or type(exc).__name__)


async def sweep_forever(d: Daemon) -> None:
    """Leftovers of interrupted writes (this node's and, after their grace, other nodes'),
    first at start-up, in the background: awaited before the socket was served, a destination
    that answered nothing kept every hand-off out for the sweep's minute (found attacking an
    S3 outage). A sweep passes over what this process is writing (the backends' live temps
    and uploads), so drains may start before it."""
    interval = max(60.0, d.config.destination.orphan_grace_s / 4)
    await sweep_once(d, timeout_s=60.0)
    while True:
        await asyncio.sleep(interval)
        await sweep_once(d, timeout_s=interval)
