"""The daemon's lifecycle: start-up, serve, shutdown, signals and reload.

Start-up: the journal is replayed (:mod:`.recovery`) before the socket is served. Serving: the
listener (:mod:`.listener`) hands each client to a :class:`~.connection.ClientHandler`; hand-off
bytes move in the data plane (:mod:`.dataplane`, :mod:`.handoff`); the scheduler drains; work
that outlives a request belongs to the supervisor. Shutdown, in uvicorn's order: stop
accepting, let hand-offs in flight finish within a bounded grace, persist (or give up) held
memfds, flush the journal, exit 0 — well inside the unit's TimeoutStopSec.

Failing a generation is here too (``Daemon.fail``); opening, replacing, superseding and
giving one up, and what an ended one gives back, are :mod:`.generations`'; retention after a
publish is :mod:`.retention_runs`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from ckptdrain.daemon import (
    __version__,
    collector,
    logs,
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
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import Config
from ckptdrain.daemon.connection import ClientHandler
from ckptdrain.daemon.copies import LocalCopies
from ckptdrain.daemon.dataplane import DataPlane, io_threads
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.expiry import Expiry
from ckptdrain.daemon.fetcher import Fetchers
from ckptdrain.daemon.generations import Generations
from ckptdrain.daemon.handoff import Handoffs
from ckptdrain.daemon.heldhandoffs import HeldHandoffs
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.journalroom import JournalReserve, open_journal
from ckptdrain.daemon.journalrows import GroupCommit, JournalOwedAborts, JournalUploadLog
from ckptdrain.daemon.ledger import GenerationRecord, Ledger
from ckptdrain.daemon.listener import Listener, bind
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.metrics import Metrics
from ckptdrain.daemon.recovery import recover, sweep_forever
from ckptdrain.daemon.retention_runs import RetentionRuns
from ckptdrain.daemon.scheduler import Scheduler
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import GenerationEvent
from ckptdrain.daemon.supervisor import Supervisor, report_slow_stop
from ckptdrain.daemon.systemd import Notifier

__all__ = ["Daemon", "RequestError"]

log = logging.getLogger("ckptdrain.server")

# Hand-offs in flight get this long to finish on SIGTERM, then held memfds the same again to
# reach local storage: both well inside the unit's TimeoutStopSec (120 s).
STOP_GRACE_S = 10.0
# Starting the S3 upload workers (a process spawn each) must not hold up start-up for long.
BACKEND_START_TIMEOUT_S = 10.0


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
        self.generations = Generations(self)
        self.retention_runs = RetentionRuns(self)
        self.admission.supersede = self.generations.supersede
        self.scheduler = Scheduler(
            config=config, ledger=self.ledger, staging=self.staging, backend=self.backend,
            committer=self.committer, metrics=self.metrics, on_drained=self.copies.drained,
            on_terminal=self.generations.after_terminal, on_published=self.retention_runs.published,
            on_vanished=self.copies.vanished,
            upload_log_for=lambda shard: JournalUploadLog(self.journal, shard.id),
        )
        # Owed aborts kept across a restart, even once their generation is forgotten.
        self.scheduler.aborts.record = JournalOwedAborts(self.journal)
        # Before any forget deletes a generation's rows, its uploads' aborts are owed.
        self.ledger.forgetting = self.scheduler.aborts.leave_all
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
        # limits.max_staged_bytes as configured, when the staging filesystem's room clamped it
        # (startup.fit_staged_limit): `status` says the limit it shows is not the one written.
        self.staged_limit_clamped_from: int | None = None
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()  # served, and READY=1 sent
        self._listener: Listener | None = None
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
        self.staged_limit_clamped_from = startup.clamped_from(self.config, fitted)
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
                        tg.create_task(self.scheduler.aborts.run(), name="owed-aborts"),
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
                              metrics=status_view.metrics_url(self.metrics_address))
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
    async def fail(self, gen: GenerationRecord, reason: str, *, kind: str,
                   event: GenerationEvent = GenerationEvent.FAILED,
                   record_first: bool = True) -> None:
        await self.scheduler.fail_generation(gen, reason, kind=kind, event=event,
                                             record_first=record_first)

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
