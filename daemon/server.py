"""The daemon: start-up and recovery, the Unix socket, one handler per client, shutdown.

Start-up replays the journal before the socket is served: acknowledged shards go back on the
drain queue, temp files and shards the journal never acknowledged are deleted, and ranks that
were still open when the daemon died are aborted (their clients saw the connection drop).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import grp
import logging
import os
import signal
import socket
import stat
import time
from typing import Any

from ckptdrain.client import wire
from ckptdrain.client.wire import Message, PayloadChunk, PayloadEnd, ProtocolError
from ckptdrain.daemon import __version__, catalog
from ckptdrain.daemon.backends.base import open_backend
from ckptdrain.daemon.budget import Budget, BudgetFull, TooLarge
from ckptdrain.daemon.channel import Channel, IdleTimeout
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import Config
from ckptdrain.daemon.journal import GroupCommit, Journal, JournalUploadLog
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.metrics import Metrics, Snapshot
from ckptdrain.daemon.retention import apply_retention
from ckptdrain.daemon.scheduler import Scheduler
from ckptdrain.daemon.staging import Staging, StagingFull, start_writeback
from ckptdrain.daemon.state import GenerationState, RankState, ShardState
from ckptdrain.daemon.systemd import Notifier

log = logging.getLogger("ckptdrain.server")

RECV_BUFFER_BYTES = 1 << 20
WRITEBACK_KICK_BYTES = 32 << 20
COPY_CHUNK_BYTES = 64 << 20
STOP_GRACE_S = 10.0
ACK_STRENGTH = {"memory": 0, "local": 1}


class RequestError(Exception):
    """An expected refusal: sent to the client as a typed error; the daemon carries on."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}


class Daemon:
    def __init__(self, config: Config, *, inherited: socket.socket | None = None,
                 notifier: Notifier | None = None, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.node_id = config.node_id
        self.notifier = notifier or Notifier()
        self._inherited = inherited
        self.staging = Staging(config.staging_dir)
        self.journal = Journal(config.journal_path)
        self.acknowledge = GroupCommit(self.journal, before=self.staging.fsync_dir)
        self.ledger = Ledger(self.journal, acknowledge=self.acknowledge)
        self.metrics = Metrics(config.node_id, __version__)
        self.backend = open_backend(config.destination, config.node_id)
        self.committer = Committer(self.backend, config.node_id)
        limits = config.limits
        self.staged_budget = Budget("max_staged_bytes", limits.max_staged_bytes)
        self.shard_budget = Budget("max_queued_shards", limits.max_queued_shards)
        self.memory_budget = Budget("max_memory_bytes", limits.max_memory_bytes)
        self._gen_slots: dict[str, Budget] = {}
        self._retention_locks: dict[str, asyncio.Lock] = {}
        self.scheduler = Scheduler(
            config=config, ledger=self.ledger, staging=self.staging, backend=self.backend,
            committer=self.committer, metrics=self.metrics, on_drained=self._on_drained,
            on_terminal=self._after_terminal,
            upload_log_for=lambda shard: JournalUploadLog(self.journal, shard.id),
        )
        self.started_at = time.time()
        self._stop = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._listener: socket.socket | None = None
        self._connections: dict[asyncio.Task[None], ClientHandler] = {}
        self.metrics_address: tuple[str, int] | None = None
        self.splice_ok = True  # cleared the first time splice is refused
        self.stopping = False

    # -- lifecycle ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self._run()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    def reload(self) -> None:
        """SIGHUP: take new limits and log level from the config; keep everything else.

        A config that does not load is logged and ignored: the daemon keeps running as it was.
        """
        from ckptdrain.daemon.config import ConfigError, load_config
        from ckptdrain.daemon.logs import setup_logging

        self.notifier.reloading("reloading limits")
        try:
            loaded = load_config(self.config_path)
            new = self.config.with_limits_from(loaded)
            # The drain's pace is a limit too: an operator slows or frees it without a restart.
            new = new.model_copy(update={"drain": new.drain.model_copy(update={
                "max_bandwidth_bytes_per_s": loaded.drain.max_bandwidth_bytes_per_s})})
        except ConfigError as exc:
            log_event(log, logging.ERROR, "reload_failed", error=str(exc))
            self.notifier.ready(self._status_line())
            return
        self.config = new
        self.scheduler.config = new
        self.staged_budget.set_limit(new.limits.max_staged_bytes)
        self.memory_budget.set_limit(new.limits.max_memory_bytes)
        self.shard_budget.set_limit(new.limits.max_queued_shards)
        for budget in self._gen_slots.values():
            budget.set_limit(new.limits.max_generations_in_flight)
        self.scheduler.set_bandwidth(new.drain.max_bandwidth_bytes_per_s)
        setup_logging(new.log_level)
        log_event(log, logging.INFO, "reloaded", max_staged_bytes=new.limits.max_staged_bytes,
                  on_full=new.limits.on_full, log_level=new.log_level)
        self.notifier.ready(self._status_line())

    async def _run(self) -> None:
        self.staging.prepare()
        await self.journal.open()
        try:
            async with contextlib.AsyncExitStack() as stack:
                stack.push_async_callback(self.backend.aclose)
                await self._recover()
                # Leftovers of this node's interrupted writes go before any new drain starts.
                await self._sweep_once(timeout_s=60.0)
                if self.config.metrics.listen:
                    self.metrics_address = await self.metrics.serve(
                        self.config.metrics.host, self.config.metrics.port)
                    stack.push_async_callback(self.metrics.aclose)
                self._listener = self._listen()
                stack.callback(self._close_listener)
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    background = [
                        tg.create_task(self.scheduler.run(), name="scheduler"),
                        tg.create_task(self._refresh_loop(), name="refresh"),
                        tg.create_task(self._sweep_orphans(), name="orphan-sweep"),
                    ]
                    for gen in list(self.ledger.generations.values()):
                        if not gen.terminal:
                            tg.create_task(self.scheduler.advance(gen))
                    acceptor = tg.create_task(self._accept_loop(), name="accept")
                    self.refresh_snapshot()
                    log_event(log, logging.INFO, "ready", node=self.node_id,
                              socket=str(self.config.socket), destination=self.config.destination.uri,
                              metrics=self.metrics_address)
                    self.notifier.ready(self._status_line())
                    await self._stop.wait()
                    self.stopping = True
                    self.notifier.stopping("finishing in-flight hand-offs")
                    log_event(log, logging.INFO, "stopping", connections=len(self._connections))
                    acceptor.cancel()
                    self._close_listener()
                    await self._drain_connections()
                    for task in background:
                        task.cancel()
        finally:
            await self.journal.close()
            log_event(log, logging.INFO, "stopped", node=self.node_id)

    async def _drain_connections(self) -> None:
        """Let hand-offs in flight finish (their clients get an answer); connections waiting
        for their next request go at once; whatever is left after the grace period is cut."""
        for task, handler in list(self._connections.items()):
            if not handler.busy:
                task.cancel()
        if self._connections:
            _, pending = await asyncio.wait(list(self._connections), timeout=STOP_GRACE_S)
            for task in pending:
                task.cancel()

    def _listen(self) -> socket.socket:
        if self._inherited is not None:
            self._inherited.setblocking(False)
            return self._inherited
        path = self.config.socket
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(f"{path} exists and is not a socket; remove it or choose another socket path")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                os.unlink(path)  # stale socket of a dead daemon
            else:
                raise OSError(f"another daemon is already serving {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # No window where the socket is wider than configured.
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        access = self.config.access
        os.chmod(path, access.mode_int)
        if access.socket_group:
            os.chown(path, -1, grp.getgrnam(access.socket_group).gr_gid)
        sock.listen(1024)
        sock.setblocking(False)
        return sock

    def _close_listener(self) -> None:
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        if self._inherited is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None and self._tg is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            if len(self._connections) >= self.config.limits.max_clients:
                conn.close()
                self.metrics.backpressure("rejected", "max_clients")
                continue
            handler = ClientHandler(self, conn)
            task = self._tg.create_task(handler.run())
            self._connections[task] = handler
            task.add_done_callback(lambda t: self._connections.pop(t, None))

    # -- recovery ----------------------------------------------------------------------------
    async def _recover(self) -> None:
        await self.ledger.load()
        keep: set[str] = set()
        requeue: list[tuple[GenerationRecord, ShardRecord]] = []
        for gen in sorted(self.ledger.generations.values(), key=lambda g: g.created_at):
            if not gen.terminal:
                self._gen_budget(gen.job).used += 1
            open_ranks = [r for r, st in gen.ranks.items() if st is RankState.OPEN]
            for shard in gen.shards.values():
                if shard.state in (ShardState.STAGED, ShardState.FAILED, ShardState.DRAINED):
                    if self.staging.exists(shard.staged_name):
                        keep.add(shard.staged_name)
                    else:
                        shard.local_copy = False
                if shard.state in (ShardState.STAGED, ShardState.FAILED) and shard.local_copy:
                    # Held against the limits exactly as while running (_release_shard gives
                    # it back), whatever the generation's state: a failed one keeps its copy.
                    self.staged_budget.used += shard.size
                    self.shard_budget.used += 1
            if gen.terminal:
                continue
            held = [s.path for s in gen.shards.values() if s.state is ShardState.HELD]
            if held:
                for shard in gen.shards.values():
                    if shard.state is ShardState.HELD:
                        await self.ledger.set_shard(shard, ShardState.DISCARDED)
                await self._fail(gen, f"the daemon stopped before {held[:3]} (ack=memory) reached "
                                      "local storage; memory hand-offs do not survive a daemon "
                                      "crash; save this generation again", kind="aborted")
                continue
            if open_ranks:
                for r in open_ranks:
                    await self.ledger.set_rank(gen, r, RankState.ABORTED)
                await self._fail(gen, f"the daemon restarted while rank(s) {open_ranks} were still "
                                      "handing off; save this generation again", kind="aborted")
                continue
            for shard in gen.shards.values():
                if shard.state is ShardState.STAGED:
                    if not shard.local_copy:
                        await self._fail(gen, f"staged copy of {shard.path!r} is missing", kind="drain")
                        break
                    requeue.append((gen, shard))
        removed = self.staging.sweep(keep)
        for gen, shard in requeue:
            if not gen.terminal and not shard.deferred:
                self.scheduler.enqueue(gen, shard)
        log_event(log, logging.INFO, "recovered", generations=len(self.ledger.generations),
                  requeued=len(requeue), removed_files=removed)

    async def _sweep_once(self, *, timeout_s: float) -> None:
        try:
            owned = await self._owned_upload_ids()
            aborted = await asyncio.wait_for(
                self.backend.sweep_orphans(owned, self.config.destination.orphan_grace_s), timeout_s)
            if aborted:
                log_event(log, logging.INFO, "orphans_swept", removed=aborted)
        except Exception as exc:  # the destination may be down; draining retries on its own
            log_event(log, logging.WARNING, "orphan_sweep_failed", error=str(exc) or type(exc).__name__)

    async def _sweep_orphans(self) -> None:
        interval = max(60.0, self.config.destination.orphan_grace_s / 4)
        while True:
            await asyncio.sleep(interval)
            await self._sweep_once(timeout_s=interval)

    async def _owned_upload_ids(self) -> set[str]:
        snap = await self.journal.load()
        return set(snap.uploads.values())

    # -- state helpers -----------------------------------------------------------------------
    def _gen_budget(self, job: str) -> Budget:
        budget = self._gen_slots.get(job)
        if budget is None:
            budget = Budget("max_generations_in_flight", self.config.limits.max_generations_in_flight)
            self._gen_slots[job] = budget
        return budget

    async def _fail(self, gen: GenerationRecord, reason: str, *, kind: str,
                    state: GenerationState = GenerationState.FAILED) -> None:
        await self.scheduler.fail_generation(gen, reason, kind=kind, state=state)

    def _after_terminal(self, gen: GenerationRecord) -> None:
        """Free what a finished generation held on this node."""
        self._gen_budget(gen.job).release(1)
        if gen.state is GenerationState.COMMITTED:
            self._drop_older_local_copies(gen)
            if self._tg is not None:
                self._tg.create_task(self._retain(gen.job))
        elif gen.state is GenerationState.CANCELLED or any(
            st is RankState.ABORTED for st in gen.ranks.values()
        ):
            # Superseded, or an aborted rank: never retried, nothing of it is worth keeping.
            for shard in gen.shards.values():
                self._release_shard(shard, delete=True)

    def _release_shard(self, shard: ShardRecord, *, delete: bool) -> None:
        if shard.state in (ShardState.STAGED, ShardState.DRAINING, ShardState.FAILED) and shard.local_copy:
            self.staged_budget.release(shard.size)
            self.shard_budget.release(1)
        if delete and shard.local_copy:
            self.staging.discard(shard.staged_name)
            shard.local_copy = False

    def _on_drained(self, shard: ShardRecord) -> None:
        # The bytes are safe at the destination: give the room back to hand-offs. The file
        # itself stays as the local copy until a newer generation of the job commits, when
        # keep_local_copy asks for it.
        self.staged_budget.release(shard.size)
        self.shard_budget.release(1)
        if not self.config.retention.keep_local_copy:
            self.staging.discard(shard.staged_name)
            shard.local_copy = False

    async def persist_held(self, gen: GenerationRecord, shard: ShardRecord, fd: int) -> None:
        """Write an ack=memory shard from its memfd to local storage, then queue it."""
        limits = self.config.limits
        name = shard.staged_name
        staged = queued = False
        tmp_fd: int | None = None
        try:
            await self.shard_budget.acquire(1, block=True, timeout_s=limits.block_timeout_s)
            queued = True
            await self.staged_budget.acquire(shard.size, block=True, timeout_s=limits.block_timeout_s)
            staged = True
            if gen.terminal or shard.state is not ShardState.HELD:
                return
            self.staging.check_room(shard.size)
            tmp_fd = self.staging.open_tmp(name)
            await asyncio.to_thread(_kernel_copy, fd, tmp_fd, shard.size)
            out, tmp_fd = tmp_fd, None
            await asyncio.to_thread(self.staging.finish, out, name)
            if shard.deferred:
                shard.checksum = await asyncio.to_thread(self.staging.checksum, name)
            if gen.terminal or shard.state is not ShardState.HELD:
                return
            await self.ledger.set_shard(shard, ShardState.STAGED, staged_at=time.time())
            staged = queued = False  # owned by the shard until it drains
            if shard.deferred:
                await self.scheduler.advance(gen)
            else:
                self.scheduler.enqueue(gen, shard)
        except (BudgetFull, TooLarge, OSError) as exc:
            await self._fail(gen, f"could not write the memory hand-off {shard.path!r} to local "
                                  f"storage: {exc}", kind="drain")
        finally:
            if tmp_fd is not None:
                os.close(tmp_fd)
            if staged:
                self.staged_budget.release(shard.size)
                self.staging.discard(name)
            if queued:
                self.shard_budget.release(1)
            self.memory_budget.release(shard.size)
            os.close(fd)  # drops our record lock: the client's pool may reuse the memfd

    async def replace_generation(self, gen: GenerationRecord, attempt: str) -> None:
        """A new attempt at an uncommitted step: end the old attempt on this node, drop what it
        staged, and forget it. Its part record at the destination names the old attempt, so
        no node counts it; this node rewrites it for the new attempt."""
        reason = (f"replaced by a new attempt at this step ({attempt or 'unnamed'}); "
                  f"the old attempt was {gen.attempt or 'unnamed'}")
        if not gen.terminal:
            await self._fail(gen, reason, kind="aborted", state=GenerationState.CANCELLED)
        else:
            for shard in gen.shards.values():
                if shard.state is ShardState.FAILED:
                    await self.scheduler.abort_upload(shard)
                self._release_shard(shard, delete=True)
        for shard in gen.shards.values():
            if shard.state is not ShardState.DISCARDED:
                # Still queued, perhaps: a worker must never take it for the new attempt's.
                await self.ledger.set_shard(shard, ShardState.DISCARDED, persist=False)
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
            await self._fail(victim, f"superseded by step {step}: {budget.name} was full and "
                                     "on_full = \"supersede\" keeps the newest checkpoint",
                             kind="superseded", state=GenerationState.CANCELLED)
            for shard in victim.shards.values():
                if shard.state is not ShardState.DISCARDED:
                    await self.ledger.set_shard(shard, ShardState.DISCARDED)
        return True

    async def _retain(self, job: str) -> None:
        """Retention after a commit: keep the newest ``keep_last`` committed generations.
        Every node does this; the steps are idempotent, so they may overlap safely."""
        lock = self._retention_locks.setdefault(job, asyncio.Lock())
        if lock.locked():
            return  # a run for this job is under way and will see this commit's listing
        async with lock:
            retention = self.config.retention
            try:
                report = await apply_retention(self.backend, job, keep_last=retention.keep_last,
                                               abandoned_grace_s=retention.abandoned_grace_s)
            except Exception as exc:  # a destination hiccup: the next commit runs it again
                log_event(log, logging.WARNING, "retention_failed", job=job, error=str(exc))
                return
            if report.deleted or report.abandoned_deleted or report.failed:
                log_event(log, logging.INFO, "retention", job=job, kept=report.kept,
                          deleted=report.deleted, abandoned=report.abandoned_deleted,
                          failed=[step for step, _ in report.failed])
            # Forget what retention removed, and failed or cancelled generations older than
            # the newest commit once the grace period is over (nobody will retry them now):
            # the journal and the local copies stay bounded.
            newest = max(report.kept, default=None)
            cutoff = time.time() - retention.abandoned_grace_s
            gone = set(report.deleted) | set(report.abandoned_deleted)
            for old in [g for g in self.ledger.generations.values() if g.job == job]:
                stale = (old.state in (GenerationState.FAILED, GenerationState.CANCELLED)
                         and newest is not None and old.step < newest and old.created_at < cutoff)
                if old.terminal and (old.step in gone or stale):
                    for shard in old.shards.values():
                        self._release_shard(shard, delete=True)
                    await self.ledger.forget(old)

    def _drop_older_local_copies(self, gen: GenerationRecord) -> None:
        for other in self.ledger.generations.values():
            if other.job != gen.job or other is gen or other.step > gen.step:
                continue
            if other.state is GenerationState.COMMITTED:
                for shard in other.shards.values():
                    if shard.local_copy:
                        self.staging.discard(shard.staged_name)
                        shard.local_copy = False

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        gens = sorted(self.ledger.generations.values(), key=lambda g: (g.job, g.step))
        oldest: dict[str, float] = {}
        now = time.time()
        for g in gens:
            since = g.oldest_undrained_since()
            if since is not None:
                oldest[g.job] = max(oldest.get(g.job, 0.0), round(now - since, 3))
        free_bytes, free_inodes = self.staging.free()
        return {
            "node_id": self.node_id,
            "version": __version__,
            "uptime_s": round(now - self.started_at, 3),
            "ack": self.config.ack,
            "destination": self.config.destination.uri,
            "metrics": f"http://{self.metrics_address[0]}:{self.metrics_address[1]}/metrics"
            if self.metrics_address else None,
            "staged_bytes": self.staged_budget.used,
            "memory_bytes": self.memory_budget.used,
            "limits": {
                "max_staged_bytes": self.staged_budget.limit,
                "max_memory_bytes": self.memory_budget.limit,
                "max_queued_shards": self.shard_budget.limit,
                "max_generations_in_flight": self.config.limits.max_generations_in_flight,
                "on_full": self.config.limits.on_full,
            },
            "queued_shards": self.shard_budget.used,
            "staging_free_bytes": free_bytes,
            "staging_free_inodes": free_inodes,
            "drain_rate_bytes_per_s": round(self.scheduler.drain_rate_bytes_per_s(), 1),
            "blocked_handoffs": self.staged_budget.waiting + self.shard_budget.waiting
            + self.memory_budget.waiting + sum(b.waiting for b in self._gen_slots.values()),
            "oldest_undrained_age_s": oldest,
            # What blocked hand-offs wait for: hand-offs waiting per limit.
            "blocked_by_limit": {
                name: waiting for name, waiting in (
                    ("max_staged_bytes", self.staged_budget.waiting),
                    ("max_memory_bytes", self.memory_budget.waiting),
                    ("max_queued_shards", self.shard_budget.waiting),
                    ("max_generations_in_flight",
                     sum(b.waiting for b in self._gen_slots.values())),
                ) if waiting
            },
            "generations": [g.summary() for g in gens],
        }

    def refresh_snapshot(self) -> None:
        shards_by_state: dict[str, int] = {}
        oldest: dict[str, float | None] = {}
        in_flight: dict[str, int] = {}
        for g in self.ledger.generations.values():
            oldest.setdefault(g.job, None)
            since = g.oldest_undrained_since()
            if since is not None:
                cur = oldest[g.job]
                oldest[g.job] = since if cur is None else min(cur, since)
            if not g.terminal:
                in_flight[g.job] = in_flight.get(g.job, 0) + 1
            for s in g.shards.values():
                shards_by_state[s.state] = shards_by_state.get(s.state, 0) + 1
        free_bytes, free_inodes = self.staging.free()
        self.metrics.set_snapshot(Snapshot(
            oldest_undrained_since=oldest,
            shards_by_state=shards_by_state,
            staged_bytes={"local": self.staged_budget.used, "memory": self.memory_budget.used},
            limit_bytes={"local": self.staged_budget.limit,
                         "memory": self.config.limits.max_memory_bytes},
            queued_shards=self.shard_budget.used,
            max_queued_shards=self.shard_budget.limit,
            staging_free_bytes=free_bytes,
            staging_free_inodes=free_inodes,
            generations_in_flight=in_flight,
            blocked_handoffs=self.staged_budget.waiting + self.shard_budget.waiting
            + self.memory_budget.waiting + sum(b.waiting for b in self._gen_slots.values()),
            drain_rate_bytes_per_s=self.scheduler.drain_rate_bytes_per_s(),
        ))

    def _status_line(self) -> str:
        return (f"{self.shard_budget.used} shards / {self.staged_budget.used} bytes staged, "
                f"{sum(not g.terminal for g in self.ledger.generations.values())} generations in flight")

    async def _refresh_loop(self) -> None:
        interval = self.notifier.watchdog_interval_s()
        period = min(1.0, interval) if interval else 1.0
        counted_aborts = 0
        while True:
            aborted = self.backend.aborted_uploads
            if aborted > counted_aborts:
                self.metrics.upload_aborted(aborted - counted_aborts)
                counted_aborts = aborted
            self.refresh_snapshot()
            self.notifier.status(self._status_line())
            if interval:
                self.notifier.watchdog()
            await asyncio.sleep(period)

    def backpressure_error(self, exc: BudgetFull | TooLarge, job: str) -> RequestError:
        oldest_path, oldest_age = "", 0.0
        now = time.time()
        for g in self.ledger.generations.values():
            for s in g.undrained():
                if now - s.staged_at > oldest_age:
                    oldest_age, oldest_path = now - s.staged_at, f"{g.job}/{g.step}/{s.path}"
        rate = self.scheduler.drain_rate_bytes_per_s()
        retry_after = 1.0
        if isinstance(exc, BudgetFull) and rate > 0 and exc.name == "max_staged_bytes":
            retry_after = max(1.0, exc.requested / rate)
        details = {
            "limit": exc.name,
            "limit_value": exc.limit,
            "current": getattr(exc, "used", None),
            "requested": exc.requested,
            "oldest_undrained": oldest_path,
            "oldest_undrained_age_s": round(oldest_age, 3),
            "drain_rate_bytes_per_s": round(rate, 1),
            "retry_after_s": round(retry_after, 1),
        }
        if isinstance(exc, TooLarge):
            return RequestError(wire.BAD_REQUEST, f"{exc}; raise limits.{exc.name} or split the shard",
                                details)
        action = "timed_out" if exc.timed_out else "rejected"
        self.metrics.backpressure(action, exc.name)
        message = (
            f"backpressure: {exc}; oldest undrained shard {oldest_path or '-'} is "
            f"{oldest_age:.1f} s old, draining at {rate / 1e6:.1f} MB/s; retry in about "
            f"{retry_after:.0f} s or checkpoint less often"
        )
        return RequestError(wire.BACKPRESSURE, message, details)


class ClientHandler:
    """One client connection: a SERVER-role wire machine fed from a :class:`Channel`."""

    def __init__(self, daemon: Daemon, sock: socket.socket) -> None:
        self.d = daemon
        self.channel = Channel(sock, idle_timeout_s=daemon.config.limits.client_idle_timeout_s)
        self.conn = wire.Connection(wire.Role.SERVER)
        self.buf = bytearray(RECV_BUFFER_BYTES)
        self.view = memoryview(self.buf)
        self.uid = -1
        self.gid = -1
        self.gen: GenerationRecord | None = None
        self.rank: int | None = None
        self.busy = False  # serving a hand-off request right now (see Daemon._drain_connections)
        self.ack: str = daemon.config.ack  # the boundary in force for this connection's rank

    async def run(self) -> None:
        try:
            await self._serve()
        except IdleTimeout as exc:
            log_event(log, logging.INFO, "client_dropped", uid=self.uid, reason=str(exc))
            # Said before hanging up, so the client's next request reads why.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.channel.sendall(self.conn.send_error(
                    wire.TIMEOUT, f"the daemon closed this connection: {exc}; raise "
                    "limits.client_idle_timeout_s or limits.open_rank_idle_timeout_s")), 1.0)
        except (ConnectionError, TimeoutError) as exc:
            log_event(log, logging.INFO, "client_dropped", uid=self.uid, reason=str(exc) or type(exc).__name__)
        except ProtocolError as exc:
            log_event(log, logging.INFO, "client_protocol_error", uid=self.uid, code=exc.code, error=exc.message)
            with contextlib.suppress(Exception):
                await self.channel.sendall(self.conn.send_error(exc.code, exc.message))
        finally:
            try:
                await self._abandon()
            finally:
                self.channel.close()

    async def _abandon(self) -> None:
        """A client that leaves without sealing aborts its rank: the rank is incomplete."""
        gen, rank = self.gen, self.rank
        if gen is None or rank is None or gen.ranks.get(rank) is not RankState.OPEN:
            return
        await self._abort_rank(gen, rank, "the client disconnected before sealing the rank")

    async def _send(self, kind: str, fields: dict[str, Any] | None = None) -> None:
        await self.channel.sendall(self.conn.send(kind, fields or {}))

    async def _next_message(self) -> Message | None:
        limits = self.d.config.limits
        while True:
            event = self.conn.next_event()
            if event is wire.NEED_DATA:
                # Between requests, a rank in progress may wait long (its process is busy
                # computing the next shard); anything else, or a stall mid-frame, may not.
                between = self.conn.buffered == 0 and self.gen is not None and not self.gen.terminal
                self.channel.idle_timeout_s = (limits.open_rank_idle_timeout_s if between
                                               else limits.client_idle_timeout_s)
                n = await self.channel.recv_into(self.view)
                self.conn.receive_data(self.view[:n])
                continue
            if isinstance(event, wire.ConnectionClosed):
                return None
            if isinstance(event, Message):
                return event
            raise ProtocolError(wire.BAD_REQUEST, f"unexpected {type(event).__name__}")

    async def _serve(self) -> None:
        _, self.uid, self.gid = self.channel.peer_credentials()
        hello = await self._next_message()
        if hello is None:
            return
        if hello.fields.get("version") != wire.PROTOCOL_VERSION:
            raise ProtocolError(wire.UNSUPPORTED_VERSION,
                                f"this daemon speaks protocol version {wire.PROTOCOL_VERSION}, "
                                f"the client {hello.fields.get('version')}; upgrade the older side")
        if not self._allowed():
            await self.channel.sendall(self.conn.send_error(
                wire.PERMISSION_DENIED,
                f"uid {self.uid} gid {self.gid} may not use this ckptdrain daemon; ask the "
                "operator to add it to [access] allowed_uids or allowed_gids"))
            return
        await self._send("welcome", {"version": wire.PROTOCOL_VERSION, "node_id": self.d.node_id})
        while True:
            msg = await self._next_message()
            if msg is None:
                return
            # A hand-off in progress is let finish on shutdown; a long `wait` is not one.
            self.busy = msg.kind not in ("wait", "status", "latest")
            try:
                reply = await self._dispatch(msg)
            except RequestError as exc:
                await self.channel.sendall(self.conn.send_error(exc.code, exc.message, exc.details or None))
                if self.conn.payload_remaining or self.conn.awaiting_data is not None:
                    # Failed part-way through a shard's bytes: the rest of them are still on
                    # the way and cannot be told apart from the next frame. Hang up.
                    return
                continue
            finally:
                self.busy = False
            await self._send("ok", reply)

    def _allowed(self) -> bool:
        access = self.d.config.access
        if self.uid in (0, os.getuid()) or self.uid in access.allowed_uids:
            return True
        return self.gid in access.allowed_gids

    async def _dispatch(self, msg: Message) -> dict[str, Any]:
        f = msg.fields
        kind = msg.kind
        if kind == "begin":
            return await self._begin(f["job"], f["step"], f["rank"], f["world_size"], f.get("ack"),
                                     f.get("attempt") or "")
        if kind in ("put", "put_fd", "put_memfd"):
            return await self._put(kind, f["job"], f["step"], f["rank"], f["path"], f["size"],
                                   bool(f.get("deferred", False)))
        if kind == "seal":
            return await self._seal(self._own_rank(f))
        if kind == "abort":
            gen, rank = self._own_rank(f)
            await self._abort_rank(gen, rank, f"the client aborted: {f['reason']}")
            return {}
        if kind == "wait":
            return await self._wait(f["job"], f["step"], float(f["timeout_s"]))
        if kind == "latest":
            return {"job": f["job"], "generation": await catalog.latest(self.d.backend, f["job"])}
        if kind == "status":
            return self.d.status()
        if kind == "retry":
            return await self._retry(f["job"], f["step"])
        if kind == "fetch":
            fd = self.channel.take_fd()
            if fd is None:
                raise RequestError(wire.BAD_REQUEST, "fetch arrived without a file descriptor")
            try:
                return await self._fetch(f["job"], f["step"], f["path"], fd)
            finally:
                os.close(fd)
        raise RequestError(wire.BAD_REQUEST, f"{kind!r} is not a request a client may send")

    # -- requests ----------------------------------------------------------------------------
    def _check_job_owner(self, job: str) -> None:
        owner = self.d.ledger.jobs.get(job)
        if owner is not None and owner != self.uid and self.uid != 0:
            raise RequestError(wire.PERMISSION_DENIED,
                               f"job {job!r} belongs to uid {owner}; uid {self.uid} may not write it")

    async def _begin(self, job: str, step: int, rank: int, world_size: int, ack: str | None,
                     attempt: str) -> dict[str, Any]:
        if self.gen is not None:
            raise RequestError(wire.BAD_REQUEST, "this connection already began a rank; "
                               "use one connection per generation and rank")
        if rank >= world_size:
            raise RequestError(wire.BAD_REQUEST, f"rank {rank} is outside world_size {world_size}")
        self._check_job_owner(job)
        effective: str = self.d.config.ack
        if ack is not None and ACK_STRENGTH[ack] > ACK_STRENGTH[effective]:
            effective = ack
        gen = self.d.ledger.get(job, step)
        if gen is not None and gen.attempt != attempt and gen.state is not GenerationState.COMMITTED:
            # A restarted job saving this step again: the new attempt replaces the old one here.
            await self.d.replace_generation(gen, attempt)
            gen = self.d.ledger.get(job, step)
        if gen is None:
            budget = self.d._gen_budget(job)
            await self._admit(budget, 1, job, step)
            gen = self.d.ledger.get(job, step)
            if gen is None:
                try:
                    gen = await self.d.ledger.open_generation(job, step, world_size, effective,
                                                              self.uid, attempt)
                except BaseException:
                    budget.release(1)
                    raise
            else:
                budget.release(1)
        if gen.world_size != world_size:
            raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} began with world_size "
                               f"{gen.world_size}, not {world_size}")
        if gen.state is GenerationState.COMMITTED:
            raise RequestError(wire.DUPLICATE, f"step {step} of job {job!r} is already committed")
        if gen.terminal:
            raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} is "
                               f"{gen.state}: {gen.error}; save a new step")
        if rank in gen.ranks:
            raise RequestError(wire.DUPLICATE, f"rank {rank} of step {step} of job {job!r} already "
                               f"began on this node ({gen.ranks[rank]})")
        if gen.state is GenerationState.RECORDED:
            await self.d.ledger.save_generation(gen, GenerationState.OPEN)
        await self.d.ledger.set_rank(gen, rank, RankState.OPEN)
        self.gen, self.rank, self.ack = gen, rank, effective
        return {"job": job, "step": step, "rank": rank, "ack": effective, "node_id": self.d.node_id}

    def _own_rank(self, f: dict[str, Any]) -> tuple[GenerationRecord, int]:
        gen, rank = self.gen, self.rank
        if gen is None or rank is None:
            raise RequestError(wire.BAD_REQUEST, "send begin before handing off shards")
        if (f["job"], f["step"], f["rank"]) != (gen.job, gen.step, rank):
            raise RequestError(wire.BAD_REQUEST, f"this connection began job {gen.job!r} step "
                               f"{gen.step} rank {rank}, not job {f['job']!r} step {f['step']} "
                               f"rank {f['rank']}")
        if gen.terminal:
            raise RequestError(wire.GENERATION_FAILED, f"step {gen.step} of job {gen.job!r} is "
                               f"{gen.state}: {gen.error}")
        if gen.ranks.get(rank) is not RankState.OPEN:
            raise RequestError(wire.GENERATION_FAILED, f"rank {rank} is {gen.ranks.get(rank)}: "
                               f"{gen.error or 'no more shards accepted'}")
        return gen, rank

    def _still_open(self, gen: GenerationRecord, rank: int) -> None:
        if gen.terminal or gen.ranks.get(rank) is not RankState.OPEN:
            raise RequestError(wire.GENERATION_FAILED, f"step {gen.step} of job {gen.job!r} "
                               f"ended while this shard was handed off ({gen.state}: {gen.error})")

    async def _admit(self, budget: Budget, amount: int, job: str, step: int) -> None:
        """Reserve ``amount`` of ``budget`` per limits.on_full, or raise the backpressure error."""
        limits = self.d.config.limits
        try:
            if limits.on_full == "supersede" and await self.d.supersede(job, step, budget, amount):
                return
            await budget.acquire(amount, block=limits.on_full != "reject",
                                 timeout_s=limits.block_timeout_s)
        except (BudgetFull, TooLarge) as exc:
            raise self.d.backpressure_error(exc, job) from None

    async def _put(self, kind: str, job: str, step: int, rank: int, path: str, size: int,
                   deferred: bool) -> dict[str, Any]:
        fd = self.channel.take_fd() if wire.needs_fd(kind) else None
        try:
            gen, rank = self._own_rank({"job": job, "step": step, "rank": rank})
            if fd is None and wire.needs_fd(kind):
                raise RequestError(wire.BAD_REQUEST, f"{kind} arrived without a file descriptor")
            if kind == "put_memfd" and self.ack == "memory" and fd is not None:
                reply = await self._hold(gen, rank, path, size, fd, deferred)
                fd = None  # owned by the background writer now
                return reply
            return await self._stage(gen, rank, path, size, fd, deferred)
        finally:
            if fd is not None:
                os.close(fd)

    async def _stage(self, gen: GenerationRecord, rank: int, path: str, size: int,
                     src_fd: int | None, deferred: bool) -> dict[str, Any]:
        started = time.perf_counter()
        handed_at = time.time()
        self._check_new_shard(gen, path, size)
        if src_fd is not None:
            st = os.fstat(src_fd)
            if not stat.S_ISREG(st.st_mode):
                raise RequestError(wire.BAD_REQUEST, f"the descriptor passed for {path!r} is not a regular file")
            if st.st_size != size:
                raise RequestError(wire.SIZE_MISMATCH, f"shard {path!r} declared {size} bytes but "
                                   f"the file passed holds {st.st_size}")
        gen.receiving.add(path)
        reserved_bytes = reserved_shard = False
        promised = 0
        name = self.d.staging.new_name()
        tmp_fd: int | None = None
        try:
            await self._admit(self.d.shard_budget, 1, gen.job, gen.step)
            reserved_shard = True
            await self._admit(self.d.staged_budget, size, gen.job, gen.step)
            reserved_bytes = True
            try:
                self.d.staging.check_room(size)
                self.d.staging.pending_bytes += size
                promised = size
            except StagingFull as exc:
                self.d.metrics.backpressure("rejected", "staging_filesystem")
                raise RequestError(wire.BACKPRESSURE, f"{exc.strerror}; free space on the staging "
                                   "disk or lower limits.max_staged_bytes",
                                   {"limit": "staging_filesystem", "retry_after_s": 5.0}) from None
            tmp_fd = self.d.staging.open_tmp(name)
            if src_fd is None:
                await self._send("ok", {"ready": True})
                await self._receive_payload(tmp_fd, size, path)
            else:
                await asyncio.to_thread(_kernel_copy, src_fd, tmp_fd, size)
            fd, tmp_fd = tmp_fd, None
            # The directory fsync that makes the rename durable is shared with the journal
            # commit of concurrent hand-offs (GroupCommit, in add_shard below).
            await asyncio.to_thread(self.d.staging.finish, fd, name, fsync_dir=False)
            # The generation may have ended while this hand-off waited for room or bytes
            # (another rank aborted, a newer one superseded it): then nothing is kept.
            self._still_open(gen, rank)
            # A deferred shard is listed in the part record before it drains, so its
            # checksum is needed now (deferred shards are small: DCP's .metadata).
            checksum = await asyncio.to_thread(self.d.staging.checksum, name) if deferred else ""
            shard = ShardRecord(
                id=self.d.ledger.shard_ids(), job=gen.job, step=gen.step, rank=rank, path=path,
                size=size, staged_name=name, state=ShardState.STAGED, handed_at=handed_at,
                staged_at=time.time(), deferred=deferred, checksum=checksum,
            )
            await self.d.ledger.add_shard(gen, shard)
            reserved_bytes = reserved_shard = False  # now owned by the shard until it drains
            if not deferred:
                self.d.scheduler.enqueue(gen, shard)
        except OSError as exc:
            if exc.errno in (28, 122):  # ENOSPC, EDQUOT
                self.d.metrics.backpressure("rejected", "staging_filesystem")
                raise RequestError(wire.BACKPRESSURE, f"staging disk full while receiving {path!r}; "
                                   "free space on the staging disk or lower limits.max_staged_bytes",
                                   {"limit": "staging_filesystem", "retry_after_s": 5.0}) from None
            raise RequestError(wire.INTERNAL, f"could not stage {path!r}: {exc}") from None
        finally:
            gen.receiving.discard(path)
            self.d.staging.pending_bytes -= promised
            if tmp_fd is not None:
                os.close(tmp_fd)
            if reserved_bytes or reserved_shard or tmp_fd is not None:
                self.d.staging.discard(name)
            if reserved_bytes:
                self.d.staged_budget.release(size)
            if reserved_shard:
                self.d.shard_budget.release(1)
        seconds = time.perf_counter() - started
        self.d.metrics.handoff(gen.job, seconds, size, "fd" if src_fd is not None else "socket")
        return {"path": path, "size": size, "ack": gen.ack}

    async def _hold(self, gen: GenerationRecord, rank: int, path: str, size: int, fd: int,
                    deferred: bool) -> dict[str, Any]:
        """ack=memory: keep the client's memfd and acknowledge at once; a background task
        writes it to local storage and queues it for the drain."""
        started = time.perf_counter()
        self._check_new_shard(gen, path, size)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise RequestError(wire.SIZE_MISMATCH, f"shard {path!r} declared {size} bytes but the "
                               f"memfd passed holds {st.st_size}")
        await self._admit(self.d.memory_budget, size, gen.job, gen.step)
        try:
            self._still_open(gen, rank)
            # Marks the memfd busy for the client's pool until we close it (memfd.py).
            fcntl.lockf(fd, fcntl.LOCK_SH)
            shard = ShardRecord(
                id=self.d.ledger.shard_ids(), job=gen.job, step=gen.step, rank=rank, path=path,
                size=size, staged_name=self.d.staging.new_name(), state=ShardState.HELD,
                handed_at=time.time(), staged_at=time.time(), deferred=deferred,
            )
            await self.d.ledger.add_shard(gen, shard)
        except BaseException:
            self.d.memory_budget.release(size)
            raise
        assert self.d._tg is not None
        self.d._tg.create_task(self.d.persist_held(gen, shard, fd))
        self.d.metrics.handoff(gen.job, time.perf_counter() - started, size, "memfd")
        return {"path": path, "size": size, "ack": "memory"}

    def _check_new_shard(self, gen: GenerationRecord, path: str, size: int) -> None:
        if path in gen.shards or path in gen.receiving:
            raise RequestError(wire.DUPLICATE, f"shard {path!r} was already handed off in step "
                               f"{gen.step} of job {gen.job!r}; shard paths are unique per generation")
        if size > self.d.config.limits.max_shard_bytes:
            raise RequestError(wire.BAD_REQUEST, f"shard {path!r} is {size} bytes, over "
                               f"limits.max_shard_bytes ({self.d.config.limits.max_shard_bytes})")

    async def _receive_payload(self, fd: int, size: int, path: str) -> None:
        msg = await self._next_message()
        if msg is None:
            raise ConnectionError(f"client left before sending the bytes of {path!r}")
        if msg.kind != "data":
            raise ProtocolError(wire.BAD_REQUEST, f"expected the data frame of {path!r}, got {msg.kind!r}")
        if msg.payload_len != size:
            raise ProtocolError(wire.SIZE_MISMATCH, f"shard {path!r} declared {size} bytes but the "
                                f"data frame carries {msg.payload_len}")
        conn, view = self.conn, self.view
        written = kicked = 0
        while True:
            if conn.buffered or conn.payload_remaining == 0:
                event = conn.next_event()
                if isinstance(event, PayloadChunk):
                    _write_all(fd, event.data)
                    written += len(event.data)
                    continue
                if isinstance(event, PayloadEnd):
                    return
                raise ProtocolError(wire.BAD_REQUEST, f"unexpected {event!r} inside a payload")
            want = conn.payload_remaining
            n = 0
            if self.d.splice_ok:
                try:
                    # Socket to staging file inside the kernel: no copy through our buffers.
                    n = await self.channel.splice_to(fd, want)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    self.d.splice_ok = False  # this kernel or filesystem cannot: recv it is
                    continue
            else:
                n = await self.channel.recv_into(view[:min(want, len(view))])
                if n:
                    _write_all(fd, view[:n])
            if n == 0:
                conn.receive_data(b"")
                conn.next_event()  # raises the truncated-frame error
                raise ConnectionError("client left mid-shard")
            conn.payload_consumed(n)
            written += n
            if written - kicked >= WRITEBACK_KICK_BYTES:
                # Start writing back what has arrived, so the fsync before the
                # acknowledgement waits for the tail only, not the whole shard.
                start_writeback(fd, kicked, written - kicked)
                kicked = written

    async def _seal(self, owned: tuple[GenerationRecord, int]) -> dict[str, Any]:
        gen, rank = owned
        await self.d.ledger.set_rank(gen, rank, RankState.SEALED)
        shards = [s for s in gen.shards.values() if s.rank == rank]
        assert self.d._tg is not None
        self.d._tg.create_task(self._advance(gen))
        return {"job": gen.job, "step": gen.step, "rank": rank, "shards": len(shards),
                "bytes": sum(s.size for s in shards)}

    async def _advance(self, gen: GenerationRecord) -> None:
        await self.d.scheduler.advance(gen)

    async def _abort_rank(self, gen: GenerationRecord, rank: int, reason: str) -> None:
        if gen.ranks.get(rank) in (RankState.OPEN, RankState.SEALED):
            await self.d.ledger.set_rank(gen, rank, RankState.ABORTED)
        if not gen.terminal:
            await self.d._fail(gen, f"rank {rank}: {reason}", kind="aborted")
            for shard in gen.shards.values():
                if shard.state is not ShardState.DISCARDED:
                    await self.d.ledger.set_shard(shard, ShardState.DISCARDED)

    async def _wait(self, job: str, step: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        poll = self.d.config.drain.commit_poll_interval_s
        while True:
            gen = self.d.ledger.get(job, step)
            if gen is not None:
                if gen.state is GenerationState.COMMITTED:
                    return {"job": job, "step": step, "committed": True, "committed_at": gen.committed_at}
                if gen.terminal:
                    raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} "
                                       f"{gen.state}: {gen.error}")
            else:
                manifest = await self.d.committer.committed(job, step)
                if manifest is not None:
                    return {"job": job, "step": step, "committed": True,
                            "committed_at": manifest.clocks.get("committed")}
            left = deadline - time.monotonic()
            if left <= 0:
                state = gen.summary() if gen is not None else {"state": "unknown to this node"}
                raise RequestError(wire.TIMEOUT, f"step {step} of job {job!r} is not committed after "
                                   f"{timeout_s:g} s (state: {state['state']})", {"generation": state})
            if gen is None:
                await asyncio.sleep(min(poll, left))
                continue
            async with gen.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gen.changed.wait(), min(left, max(poll, 1.0)))

    async def _fetch(self, job: str, step: int, path: str, out_fd: int) -> dict[str, Any]:
        """Restore's fast path: copy this node's local copy of a committed shard into the
        client's file. The client checks the checksum against the manifest: a local copy is
        never trusted on its own."""
        self._check_job_owner(job)
        gen = self.d.ledger.get(job, step)
        shard = gen.shards.get(path) if gen is not None else None
        if (gen is None or shard is None or gen.state is not GenerationState.COMMITTED
                or not shard.local_copy or not self.d.staging.exists(shard.staged_name)):
            raise RequestError(wire.NOT_FOUND, f"this node holds no local copy of {path!r} of "
                               f"step {step} of job {job!r}; read it from the destination")
        st = os.fstat(out_fd)
        if not stat.S_ISREG(st.st_mode):
            raise RequestError(wire.BAD_REQUEST, "fetch needs a regular file opened for writing")
        try:
            size, checksum = await asyncio.to_thread(self.d.staging.copy_out, shard.staged_name, out_fd)
        except OSError as exc:
            raise RequestError(wire.BAD_REQUEST, f"could not write {path!r} to the file passed: "
                               f"{exc.strerror or exc}") from None
        return {"path": path, "size": size, "checksum": checksum}

    async def _retry(self, job: str, step: int) -> dict[str, Any]:
        self._check_job_owner(job)
        gen = self.d.ledger.get(job, step)
        if gen is None:
            raise RequestError(wire.NOT_FOUND, f"this node holds no step {step} of job {job!r}")
        if gen.state is not GenerationState.FAILED:
            raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} is {gen.state}, not failed")
        if any(st is RankState.ABORTED for st in gen.ranks.values()):
            raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} had an aborted "
                               "rank; it cannot be retried, save a new step")
        lost = [s.path for s in gen.shards.values()
                if s.state in (ShardState.HELD, ShardState.DISCARDED)]
        if lost:
            raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} lost shards "
                               f"{lost[:5]} before they reached local storage; save a new step")
        missing = [s.path for s in gen.shards.values()
                   if s.state is ShardState.FAILED and not self.d.staging.exists(s.staged_name)]
        if missing:
            raise RequestError(wire.GENERATION_FAILED, f"local copies are gone for {missing[:5]}")
        try:
            await self.d._gen_budget(job).acquire(1, block=False, timeout_s=0)
        except (BudgetFull, TooLarge) as exc:
            raise self.d.backpressure_error(exc, job) from None
        await self.d.ledger.save_generation(gen, GenerationState.OPEN, error="")
        requeued = 0
        for shard in gen.shards.values():
            if shard.state is ShardState.FAILED:
                await self.d.ledger.set_shard(shard, ShardState.STAGED, error="")
            if shard.state is ShardState.STAGED:
                self.d.scheduler.enqueue(gen, shard)
                requeued += 1
        assert self.d._tg is not None
        self.d._tg.create_task(self._advance(gen))
        return {"job": job, "step": step, "requeued": requeued}


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _kernel_copy(src: int, dst: int, size: int) -> None:
    """Copy with copy_file_range (in-kernel, no user-space bounce), sendfile as fallback."""
    offset = 0
    while offset < size:
        want = min(COPY_CHUNK_BYTES, size - offset)
        try:
            n = os.copy_file_range(src, dst, want, offset)
        except OSError as exc:
            if exc.errno not in (18, 22, 38, 95):  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP
                raise
            n = os.sendfile(dst, src, offset, want)
        if n == 0:
            raise OSError(5, f"source file ended at {offset} of {size} bytes")
        offset += n
