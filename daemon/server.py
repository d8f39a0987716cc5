"""The daemon's lifecycle: start-up, serve, shutdown, signals and reload.

Start-up: the journal is replayed (:mod:`.recovery`) before the socket is served. Serving: the
listener (:mod:`.listener`) hands each client to a :class:`~.connection.ClientHandler`; hand-off
bytes move in the data plane (:mod:`.dataplane`, :mod:`.handoff`); the scheduler drains; work
that outlives a request belongs to the supervisor. Shutdown, in uvicorn's order: stop
accepting, let hand-offs in flight finish within a bounded grace, persist (or give up) held
memfds, flush the journal, exit 0 — well inside the unit's TimeoutStopSec.

This module also owns the few decisions that span rooms: opening or replacing a generation,
failing one, and what a finished generation gives back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ckptdrain.daemon import (
    __version__,
    collector,
    logs,
    maintenance,
    owners,
    reloads,
    startup,
    waits,
)
from ckptdrain.daemon import status as status_view
from ckptdrain.daemon.access import Peer, is_operator
from ckptdrain.daemon.admission import Admission
from ckptdrain.daemon.allowance import ClientAllowance
from ckptdrain.daemon.backends.base import open_backend
from ckptdrain.daemon.backends.beneath import ROOT_DEVICES
from ckptdrain.daemon.beginchecks import BeginChecks
from ckptdrain.daemon.budget import Budget, Reservation
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import Config
from ckptdrain.daemon.connection import ClientHandler
from ckptdrain.daemon.copies import LocalCopies
from ckptdrain.daemon.dataplane import DataPlane, io_threads
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.expiry import Expiry
from ckptdrain.daemon.fetcher import Fetchers
from ckptdrain.daemon.handoff import Handoffs
from ckptdrain.daemon.heldhandoffs import HeldHandoffs
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.journalroom import JournalReserve, open_journal
from ckptdrain.daemon.journalrows import GroupCommit, JournalUploadLog
from ckptdrain.daemon.keptmanifests import KeptManifests
from ckptdrain.daemon.ledger import GenerationRecord, Ledger
from ckptdrain.daemon.listener import Listener, bind
from ckptdrain.daemon.locks import CoalescedRuns, KeyedLocks
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.metrics import Metrics
from ckptdrain.daemon.recovery import recover, sweep_forever
from ckptdrain.daemon.retention import apply_retention
from ckptdrain.daemon.scheduler import Scheduler
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
)
from ckptdrain.daemon.supervisor import Supervisor, report_slow_stop
from ckptdrain.daemon.systemd import Notifier

__all__ = ["Daemon", "RequestError"]

log = logging.getLogger("ckptdrain.server")

# A wait run only while its client stays connected (Channel.unless_hung_up).
Connected = Callable[[Awaitable[Reservation], str], Awaitable[Reservation]]

# Hand-offs in flight get this long to finish on SIGTERM, then held memfds the same again to
# reach local storage: both well inside the unit's TimeoutStopSec (120 s).
STOP_GRACE_S = 10.0
# Starting the S3 upload workers (a process spawn each) must not hold up start-up for long.
BACKEND_START_TIMEOUT_S = 10.0
# Retention runs of one job start at least this far apart: a job committing every few
# milliseconds (a test loop, a tiny model) pays for one run a second, not one per commit.
RETENTION_INTERVAL_S = 1.0


class Daemon:
    def __init__(self, config: Config, *, inherited: socket.socket | None = None,
                 notifier: Notifier | None = None, config_path: str | None = None) -> None:
        self.config = config
        self.loaded_config = config  # as loaded: a reload compares against this
        self.config_path = config_path
        self.node_id = config.node_id
        self.notifier = notifier or Notifier()
        self._inherited = inherited
        limits = config.limits
        # Files kept for the journal's next start on a full disk (journalroom.py).
        self.journal_reserve = JournalReserve(config.journal_path)
        self.staging = Staging(config.staging_dir, self.journal_reserve)
        self.journal = Journal(config.journal_path)
        self.acknowledge = GroupCommit(self.journal, before=self.staging.fsync_dir)
        self.ledger = Ledger(self.journal, acknowledge=self.acknowledge)
        self.metrics = Metrics(config.node_id, __version__)
        self.metrics.set_destination(config.destination.scheme)
        self.client_log = logs.per_user()  # clients' errors, per uid
        # ... and what they cost them (limits.client_errors_per_s)
        self.allowance = ClientAllowance(lambda: self.config.limits, self.metrics, self.client_log)
        if config.destination.scheme == "file":
            ROOT_DEVICES.keep_in(config.root_devices_path)
        self.backend = open_backend(config.destination, config.node_id,
                                    workers=config.drain.worker_count)
        self.committer = Committer(self.backend, config.node_id)
        # A reading loop and backend per uid: a client's file may hang its writes.
        self.fetcher = Fetchers(lambda: open_backend(config.destination, config.node_id),
                                close_fd=lambda fd, uid: self.dataplane.close_client_fd(fd, uid))
        self.dataplane = DataPlane(io_threads(limits.io_threads), limits.io_timeout_s,
                                   pumps=limits.max_clients)
        self.supervisor = Supervisor()
        self.supervisor.on_failure = lambda: self.metrics.internal_error("background")
        self.admission = Admission(config, self.metrics, self.ledger,
                                   drain_rate=lambda: self.scheduler.drain_rate_bytes_per_s())
        self.ledger.ended = self.admission.release_generation
        self.copies = LocalCopies(self.staging, self.admission, self.ledger, self.dataplane,
                                  self.supervisor)
        self.copies.keep_after_drain = config.retention.keep_local_copy
        self.admission.make_room = self.copies.make_room
        self.admission.held_for_retry = self.copies.held_for_retry
        self.admission.supersede = self.supersede
        self.scheduler = Scheduler(
            config=config, ledger=self.ledger, staging=self.staging, backend=self.backend,
            committer=self.committer, metrics=self.metrics, on_drained=self.copies.drained,
            on_terminal=self._after_terminal, on_published=self._published,
            on_vanished=self.copies.vanished,
            upload_log_for=lambda shard: JournalUploadLog(self.journal, shard.id),
        )
        self.handoffs = Handoffs(self)
        self.held = HeldHandoffs(self.handoffs)
        self.begin_checks = BeginChecks(self)
        self.expiry = Expiry(self)
        self.retired = waits.Retired()
        self._relinking = False  # a remake of a removed journal is queued (_refresh_free)
        self.reloads = reloads.Reloads(self)
        self.started_at = time.time()
        self.started_mono = time.monotonic()  # what uptime is read from
        self.staging_free: tuple[int, int] = (0, 0)
        self.staging_reserve = 0
        # What the staging filesystem could hold were it empty (startup.staging_size), taken at
        # start: what tells a reload a disk full for now from one too small (reloads.py).
        self.staging_size: int | None = None
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()  # served, and READY=1 sent
        self._listener: Listener | None = None
        self._retention_runs = CoalescedRuns(RETENTION_INTERVAL_S)  # by job
        self._kept_manifests = KeptManifests()
        self._begin_locks = KeyedLocks()
        self.metrics_address: tuple[str, int] | None = None
        self.stopping = False
        self.draining = False  # `ckptdrain drain`: no new generation (daemon/maintenance.py)
        self.on_stopped: Callable[[], None] | None = None  # the CLI bounds the process exit

    # -- lifecycle ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        # An open of a staged file while the daemon holds a lease on it (a dropped copy, looked
        # at before it goes: Staging.discard_unless_open) sends the daemon SIGIO, whose default
        # ends the process (found attacking: a scanner reading the staging directory killed
        # it). Nothing here uses SIGIO.
        before = signal.signal(signal.SIGIO, signal.SIG_IGN)
        try:
            await self._run()
        finally:
            signal.signal(signal.SIGIO, before)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            # Removing the handler restored SIGHUP's default, which ends the process: one
            # arriving before the process has exited made a clean stop a death by signal
            # (found attacking: systemd saw the unit fail).
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def reload(self) -> None:
        """SIGHUP: reload what can change while running (:mod:`.reloads`), in the
        supervisor's scope: the config file is read off the loop, and whatever goes wrong
        ends as one ``reload_failed`` line, never in the loop's exception handler."""
        self.supervisor.spawn(self.reloads.run, what="reload")

    async def _run(self) -> None:
        # Before anything changes: no journal replayed, nothing swept, nothing bound yet.
        fitted, lock = startup.check(self.config, inherited=self._inherited,
                                     journal_reserve=self.journal_reserve)
        self.config = self.scheduler.config = fitted
        self.admission.set_limits(fitted)
        with contextlib.suppress(OSError):  # read a moment ago by the check: not expected
            self.staging_size = startup.staging_size(fitted.staging_dir)
        try:
            await open_journal(self.journal, self.staging, self.journal_reserve)
        except BaseException:
            lock.release()
            raise
        slow_stop: asyncio.TimerHandle | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                stack.push_async_callback(self.backend.aclose)
                stack.push_async_callback(self.fetcher.aclose)  # first: its reads have ended
                await self._start_backend()
                async with asyncio.TaskGroup() as tg:
                    # First, so that what recovery queues (aborts of failed uploads) runs.
                    supervisor = tg.create_task(self.supervisor.run(), name="supervisor")
                    await recover(self)
                    lock.settled = True  # a clean stop may say so now (StagingLock.release)
                    if self.config.access.check_destination_owner:
                        # Whether the journal's owners were checked at the destination is not
                        # journalled: each is asked again at its job's next use (owners.settle).
                        self.committer.owners.unverified.update(
                            job for job, uid in self.ledger.jobs.items()
                            if not is_operator(uid))
                    if self.config.metrics.listen:
                        self.metrics_address = await self.metrics.serve(
                            self.config.metrics.host, self.config.metrics.port)
                        stack.push_async_callback(self.metrics.aclose)
                    owns = None if self._inherited is not None else str(self.config.socket)
                    self._listener = Listener(
                        bind(self.config, self._inherited),
                        limits=lambda: self.config.limits, access=lambda: self.config.access,
                        metrics=self.metrics, handler=lambda conn, peer: ClientHandler(self, conn, peer),
                        charge=self.allowance.charge,
                        close=self.dataplane.close_client_fd,
                        last_gone=self._last_connection_gone,
                        owns_path=owns)
                    stack.callback(self._listener.close)
                    background = [
                        tg.create_task(self.scheduler.run(), name="scheduler"),
                        tg.create_task(self._refresh_loop(), name="refresh"),
                        tg.create_task(sweep_forever(self), name="orphan-sweep"),
                        tg.create_task(self.expiry.run(), name="expiry"),
                    ]
                    for gen in list(self.ledger.generations.values()):
                        if not gen.terminal:
                            self.spawn_advance(gen)
                    await self._refresh_free()
                    status_view.refresh_snapshot(self)
                    collector.freeze_started()
                    log_event(log, logging.INFO, "ready", node=self.node_id,
                              socket=str(self.config.socket), destination=self.config.destination.uri,
                              metrics=self.metrics_address)
                    self.notifier.ready(self.status_line())
                    self.ready.set()  # a reload waits for this (reloads.py)
                    serving = tg.create_task(self._listener.serve(self._stop, STOP_GRACE_S),
                                             name="listener")
                    await self._stop.wait()
                    self.stopping = True
                    self.backend.stopping = True
                    self.notifier.stopping("finishing in-flight hand-offs")
                    log_event(log, logging.INFO, "stopping",
                              connections=len(self._listener.connections))
                    slow_stop = report_slow_stop()
                    await serving
                    left = await self.supervisor.finish(STOP_GRACE_S)
                    if left:
                        log_event(log, logging.WARNING, "stop_grace_over", unfinished=left,
                                  action="memory hand-offs not yet on local storage fail their "
                                  "generation at the next start")
                    for task in (*background, supervisor):
                        task.cancel()
        finally:
            # A clean close deletes the journal's -wal and -shm: without a reserve, their
            # blocks become it (journalroom.py).
            self.journal_reserve.keep_side_files()
            await self.journal.close()
            self.dataplane.close()
            if slow_stop is not None:
                slow_stop.cancel()
            lock.release()
            log_event(log, logging.INFO, "stopped", node=self.node_id)
            if self.on_stopped is not None:
                self.on_stopped()

    async def _start_backend(self) -> None:
        try:
            async with asyncio.timeout(BACKEND_START_TIMEOUT_S):
                await self.backend.start()
        except Exception as exc:  # started again on first use; the drain reports what fails
            log_event(log, logging.WARNING, "destination_start_failed", error=str(exc),
                      action="started again when the first shard drains")

    def _last_connection_gone(self, uid: int) -> None:
        """A uid's last connection ended: its own data-plane lane and fetcher go (each
        keeps what still runs on a file of its own)."""
        self.dataplane.release(uid)
        self.fetcher.release(uid)

    def spawn_advance(self, gen: GenerationRecord) -> None:
        """Queue a commit attempt for ``gen`` to the supervisor (it outlives any request)."""
        self.supervisor.spawn(lambda: self.scheduler.advance(gen),
                              what=f"advance {gen.job}/{gen.step}")

    # -- generations -------------------------------------------------------------------------
    async def begin_generation(self, job: str, step: int, world_size: int, ack: str, uid: int,
                               attempt: str, *, connected: Connected | None = None
                               ) -> GenerationRecord:
        """The generation a rank joins: this node's, a new attempt replacing an old one, or a
        new one with its in-flight slot. One at a time per step, so ranks of one node that
        begin at once all join the same generation. ``connected`` cuts the wait for a slot
        short when the beginning client hangs up (Channel.unless_hung_up): a killed job's
        begin held the step's lock, and its restarted job's begin with it, till
        block_timeout_s."""
        async with self._begin_locks.hold((job, step)):
            gen = self.ledger.get(job, step)
            looked_up: tuple[int, bool] | None = None
            if gen is None or (gen.attempt != attempt
                               and gen.state is not GenerationState.COMMITTED):
                maintenance.refuse_new_generation(self, job, step)
                if gen is None and job not in self.ledger.jobs:
                    # Both ask the destination, each within its own timeout: one after the
                    # other, a destination that answered nothing held a new job's begin for
                    # both (10 s, found attacking an S3 outage).
                    looked_up = await self.begin_checks.new_job(job, step, uid)
                else:
                    await self.begin_checks.refuse_if_committed(job, step)
            if (gen is not None and gen.attempt != attempt
                    and gen.state is not GenerationState.COMMITTED):
                # A restarted job saving this step again: the new attempt replaces the old.
                owners.check_now(self, job, uid)
                await self.replace_generation(gen, attempt)
                gen = self.ledger.get(job, step)
            if gen is not None:
                owners.check_now(self, job, uid)
                self.expiry.touch(job)
                return gen
            verified, owner = True, uid
            if job not in self.ledger.jobs:
                owner, verified = looked_up or await self.begin_checks.job_owner(job, uid)
            self.admission.check_uid_generations(self.ledger.jobs.get(job, owner))
            await self.expiry.make_room_for(job, owner)
            waiting = self.admission.admit(self.admission.slots(job), 1, job, step)
            slot = await (waiting if connected is None else
                          connected(waiting, "its begin waited for a generation slot"))
            try:
                # Checked again with nothing awaited before the job and its generation are
                # tracked: other begins may have opened while this one waited.
                owners.check_now(self, job, uid)
                self.admission.check_uid_generations(self.ledger.jobs.get(job, owner))
                self.expiry.check_room(job, owner)
                gen = await self.ledger.open_generation(job, step, world_size, ack, owner,
                                                        attempt)
            except BaseException:
                slot.release()
                raise
            self.admission.hold_generation(gen, slot)
            if not verified and self.ledger.jobs.get(job) == owner:
                self.committer.owners.unverified.add(job)
            return gen

    async def fail(self, gen: GenerationRecord, reason: str, *, kind: str,
                   event: GenerationEvent = GenerationEvent.FAILED,
                   record_first: bool = True) -> None:
        await self.scheduler.fail_generation(gen, reason, kind=kind, event=event,
                                             record_first=record_first)

    def _after_terminal(self, gen: GenerationRecord) -> None:
        """Free what a finished generation held on this node (its slot was freed the moment
        it ended: Ledger.ended)."""
        if gen.state is GenerationState.COMMITTED:
            self.copies.drop_older_committed(gen)
            job = gen.job
            self.supervisor.spawn(lambda: self._forget_older(job), what=f"forget older {job}")
            return
        job = gen.job
        self.supervisor.spawn(lambda: self.expiry.trim(job), what=f"trim ended {job}")
        if gen.state is GenerationState.CANCELLED or gen.why_not_retryable():
            # Superseded, an aborted rank or a shard lost before local storage: never
            # retried, so nothing of it is worth keeping (every byte it reserved goes back;
            # its shards' records are discarded where it ends, Endings._end).
            self.copies.discard_generation(gen)
        else:
            # Failed: `ckptdrain retry` re-sends only what did not drain, so only those copies
            # are kept; drained ones (all of them, when another node's rank aborted or the
            # commit wait ran out) go now. Except when shards of its recorded ranks vanished
            # at the destination (the only way a recorded rank holds a failed shard): a retry
            # commits it as it is, and its drained copies are that commit's fast-restore
            # copies, and the retry's own if another shard vanishes (found attacking: after
            # such a retry the committed generation had kept copies of the re-sent shards only).
            vanished = (any(s.state is ShardState.FAILED for s in gen.shards.values())
                        and all(st is RankState.RECORDED for st in gen.ranks.values()))
            if not vanished:
                for shard in gen.shards.values():
                    if shard.state is ShardState.DRAINED:
                        self.copies.discard(shard)
            self.copies.kept_for_retry(gen)

    async def give_up(self, gen: GenerationRecord, reason: str,
                      ranks: Iterable[int] | None = None) -> bool:
        """End ``gen`` for good (a rank's or an operator's abort): ``ranks`` (default: every
        one begun here, recorded ones too) are aborted, which no ``retry`` can undo, so every
        shard it staged goes back now, also when it had already ended. False, and nothing
        done, when it committed first.

        Holding the generation's commit point, so never in the middle of this node's manifest
        create (found racing aborts: a manifest written while the abort failed the generation
        left it committed and reported failed), and waiting for nothing longer: holding the
        whole commit's lock instead made an abort wait out a paced drain of deferred shards
        or a part record's retries (and the step then committed). Aborting the ranks is what
        makes it final: an abort that left a rank open, or recorded, left the generation
        retryable (its shards kept for a retry that could never come) or let another node
        commit it from this node's part record."""
        async with gen.commit_point:
            if gen.state is GenerationState.COMMITTED:
                return False
            chosen = list(gen.ranks) if ranks is None else list(ranks)
            for rank in chosen:
                if gen.ranks.get(rank) in (RankState.OPEN, RankState.SEALED,
                                           RankState.RECORDED):
                    await self.ledger.apply((gen, rank), RankEvent.ABORTED)
            if not gen.terminal:
                await self.fail(gen, reason, kind="aborted", event=GenerationEvent.FAILED)
            await self._discard_shards(gen)
            self.copies.discard_generation(gen)
        return True

    async def _discard_shards(self, gen: GenerationRecord, *, persist: bool = True) -> None:
        """Every shard of ``gen`` not yet discarded is (it will never drain)."""
        for shard in gen.shards.values():
            if shard.state is not ShardState.DISCARDED:
                await self.ledger.apply(shard, ShardEvent.DISCARDED, persist=persist)

    async def replace_generation(self, gen: GenerationRecord, attempt: str) -> None:
        """A new attempt at an uncommitted step: end the old attempt on this node, drop what it
        staged, and forget it. Its part record at the destination names the old attempt, so
        no node counts it; this node rewrites it for the new attempt."""
        reason = (f"replaced by a new attempt at this step ({attempt or 'unnamed'}); "
                  f"the old attempt was {gen.attempt or 'unnamed'}")
        if not gen.terminal:
            await self.fail(gen, reason, kind="replaced", event=GenerationEvent.CANCELLED)
        else:
            for shard in gen.shards.values():
                if shard.state is ShardState.FAILED:
                    await self.scheduler.abort_upload(shard)
            self.copies.discard_generation(gen)
        # Still queued, perhaps: a worker must never take it for the new attempt's.
        await self._discard_shards(gen, persist=False)
        log_event(log, logging.INFO, "generation_replaced", job=gen.job, step=gen.step,
                  old_attempt=gen.attempt, attempt=attempt)
        await self.ledger.forget(gen)

    async def supersede(self, job: str, step: int, budget: Budget, amount: int) -> bool:
        """on_full = "supersede": cancel this job's older uncommitted generations, oldest
        first, until ``amount`` fits ``budget``; True when it was acquired. Never touches a
        committed generation, another job's, or one that already drained everything here."""
        while not budget.try_acquire(amount):
            victims = sorted(
                (g for g in self.ledger.generations.values()
                 if g.job == job and g.step < step and g.state is GenerationState.OPEN),
                key=lambda g: g.step,
            )
            if not victims:
                return False
            victim = victims[0]
            self.metrics.backpressure("superseded", budget.name)
            await self.fail(victim, f"superseded by step {step}: {budget.name} was full and "
                                    "on_full = \"supersede\" keeps the newest checkpoint",
                            kind="superseded", event=GenerationEvent.CANCELLED)
            await self._discard_shards(victim)
        return True

    def _published(self, gen: GenerationRecord) -> None:
        job = gen.job
        self.supervisor.spawn(lambda: self._retain(job), what=f"retention {job}")

    async def _retain(self, job: str) -> None:
        """Retention at the destination after this node published a generation of ``job``.

        Only the publishing node runs it: every node of a 100-node job listing the job and
        deleting the same old generation would multiply its requests by 100. A publisher that
        dies before its run leaves the old generation to the next commit's run (or
        ``ckptdrain gc``). One run per job at a time, and a commit during a run asks for one
        more after it (CoalescedRuns): the newest commit is always seen by a run that began
        after it. Runs of a job start at least RETENTION_INTERVAL_S apart.
        """
        await self._retention_runs.run(job, lambda: self._retain_once(job))

    async def _retain_once(self, job: str) -> None:
        retention = self.config.retention
        try:
            report = await apply_retention(self.backend, job, keep_last=retention.keep_last,
                                           abandoned_grace_s=retention.abandoned_grace_s,
                                           kept=self._kept_manifests)
        except Exception as exc:  # a destination hiccup: the next commit runs it again
            log_event(log, logging.WARNING, "retention_failed", job=job, error=str(exc))
            return
        if report.deleted or report.abandoned_deleted or report.failed:
            # A failed removal leaves the destination growing: worth a warning.
            log_event(log, logging.WARNING if report.failed else logging.INFO, "retention",
                      job=job, kept=report.kept,
                      deleted=report.deleted, abandoned=report.abandoned_deleted,
                      failed=[step for step, _ in report.failed],
                      error=report.failed[0][1] if report.failed else None)
        self.committer.manifests.forget(job, [*report.deleted, *report.abandoned_deleted])

    async def _forget_older(self, job: str) -> None:
        """After a commit, on every node: forget this job's committed generations beyond the
        newest ``keep_last`` (retention removes them at the destination), and its failed or
        cancelled ones older than the newest commit once the grace period is over (nobody
        will retry them now), so the journal and the local copies stay bounded."""
        retention = self.config.retention
        mine = [g for g in self.ledger.generations.values() if g.job == job]
        committed = sorted((g.step for g in mine if g.state is GenerationState.COMMITTED),
                           reverse=True)
        if not committed:
            return
        older = set(committed[retention.keep_last:])
        self.committer.manifests.forget(job, older)
        cutoff = time.monotonic() - retention.abandoned_grace_s
        for old in mine:
            stale = (old.state in (GenerationState.FAILED, GenerationState.CANCELLED)
                     and old.step < committed[0] and old.created_mono < cutoff)
            # Another run may have forgotten it while this one waited on the journal.
            if (old.terminal and (old.step in older or stale)
                    and self.ledger.generations.get(old.key) is old):
                self.copies.discard_generation(old)
                if old.state is GenerationState.COMMITTED:
                    self.retired.add(old)
                await self.ledger.forget(old)

    # -- status ------------------------------------------------------------------------------
    def status(self, *, job: str | None = None, peer: Peer | None = None) -> dict[str, Any]:
        return status_view.status(self, job=job, peer=peer)

    def status_line(self) -> str:
        return status_view.status_line(self)

    async def _keep_journal_linked(self) -> None:
        try:
            await self.journal.keep_linked()
        finally:
            self._relinking = False

    async def _refresh_free(self) -> None:
        with contextlib.suppress(Exception):  # a sick disk shows as stale numbers, not a crash
            # Given to the journal at start, or not made yet: made once there is room.
            await self.dataplane.call(self.journal_reserve.remake)
            # Made again in the journal's thread, never awaited here: that thread may wait
            # for room, and this loop is the watchdog's (Journal.keep_linked).
            if not self._relinking and not await self.dataplane.call(os.path.lexists,
                                                                      self.journal.path):
                self._relinking = True
                self.supervisor.spawn(self._keep_journal_linked, what="remake the journal")
            free_bytes, free_inodes, reserve = await self.dataplane.call(self.staging.room)
            self.staging_free = (free_bytes, free_inodes)
            self.staging_reserve = reserve

    async def _refresh_loop(self) -> None:
        interval = self.notifier.watchdog_interval_s()
        period = min(1.0, interval) if interval else 1.0
        counted_aborts = 0
        while True:
            aborted = self.backend.aborted_uploads
            if aborted > counted_aborts:
                self.metrics.upload_aborted(aborted - counted_aborts)
                counted_aborts = aborted
            await self._refresh_free()
            status_view.refresh_snapshot(self)
            self.notifier.status(self.status_line())
            if interval:
                self.notifier.watchdog()
            await asyncio.sleep(period)
