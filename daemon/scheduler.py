"""Drains staged shards to the destination.

Jobs take turns, oldest generation first within a job, at most ``destination.max_concurrency``
copies at once, every task owned by the scheduler's TaskGroup. A shard is retried with backoff
and jitter until its retry budget is spent; then its generation fails and the local copy is
kept for ``ckptdrain retry``. What follows a drain (the part record, the manifest, the end of
every generation) is the :class:`~ckptdrain.daemon.publisher.Publisher`'s, which runs inside
the scheduler's TaskGroup; the methods the server calls stay here and hand over to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptdrain.client.manifest import ManifestError, generation_prefix
from ckptdrain.client.recordfields import parse_checksum
from ckptdrain.daemon.backends.base import Backend, BackendError, UploadLog
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.drainpace import DrainPace
from ckptdrain.daemon.drainqueue import BatchLanes, FairQueue
from ckptdrain.daemon.errors import RUN_OUT
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.logs import OncePerCause, log_event
from ckptdrain.daemon.owedaborts import UploadAborts
from ckptdrain.daemon.publisher import Publisher
from ckptdrain.daemon.records import retrying_note
from ckptdrain.daemon.state import GenerationEvent, ShardEvent, ShardState
from ckptdrain.daemon.threads import in_thread
from ckptdrain.daemon.transfers import Discarded, Transfers

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.metrics import Metrics
    from ckptdrain.daemon.staging import Staging

log = logging.getLogger("ckptdrain.scheduler")


class Scheduler(Transfers):
    def __init__(
        self,
        *,
        config: Config,
        ledger: Ledger,
        staging: Staging,
        backend: Backend,
        committer: Committer,
        metrics: Metrics,
        on_drained: Callable[[ShardRecord], None],
        on_terminal: Callable[[GenerationRecord], None],
        on_published: Callable[[GenerationRecord], None] = lambda gen: None,
        on_vanished: Callable[[ShardRecord], None] = lambda shard: None,
        upload_log_for: Callable[[ShardRecord], UploadLog | None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.staging = staging
        self.backend = backend
        self.metrics = metrics
        self._on_drained = on_drained
        self._on_terminal = on_terminal
        self._upload_log_for = upload_log_for
        # Every abort of a journalled upload, and those a down destination left owed (its
        # run() is a task of the daemon's, beside the scheduler's).
        self.aborts = UploadAborts(backend, upload_log_for)
        self.publisher = Publisher(
            config=config, ledger=ledger, committer=committer, metrics=metrics,
            drain=self._drain_deferred, on_terminal=self._terminal, on_ended=self._discard_copies,
            on_published=on_published, on_vanished=on_vanished,
        )
        self.config = config
        self._queue = FairQueue()
        self._lanes = BatchLanes(lambda: self.backend.batch_lanes)
        self._seq = itertools.count()
        # Generation prefixes whose destination directory exists (prepare_prefix ran), while
        # their generation is live: forgotten when it ends (_terminal), or a daemon that runs
        # for months kept one string per generation it ever drained.
        self._prepared: set[str] = set()
        self.destination = config.destination.scheme
        # A destination outage fails every shard the same way: log each cause once a minute
        # with a count, not once per shard and attempt.
        self._error_log = OncePerCause(60.0)
        DrainPace.__init__(self, config.drain.max_bandwidth_bytes_per_s, metrics,
                           self.destination)
        # Copies in flight, by shard id, each in a cancel scope: ending its generation cancels
        # just that copy (an S3 upload then waits for its in-flight parts and aborts itself).
        self._inflight: dict[int, asyncio.Timeout] = {}

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        # A reload (SIGHUP) sets it here; the publisher reads the same one.
        self._config = config
        self.publisher.config = config

    # -- queueing ----------------------------------------------------------------------------
    def enqueue(self, gen: GenerationRecord, shard: ShardRecord) -> None:
        # Jobs take turns; within a job, oldest generation first, then hand-off order.
        self._queue.put(gen.job, (gen.created_mono, shard.id, next(self._seq)), shard)

    def poke_commits(self) -> None:
        self.publisher.poke()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    # -- what the server calls; the publisher does it ----------------------------------------
    async def advance(self, gen: GenerationRecord) -> None:
        """Record this node's part and publish when every rank is covered. Never raises: a
        failure fails the generation (see :meth:`Publisher.advance`)."""
        await self.publisher.advance(gen)

    async def fail_generation(self, gen: GenerationRecord, reason: str, *, kind: str,
                              event: GenerationEvent = GenerationEvent.FAILED,
                              record_first: bool = True) -> None:
        """End a generation that cannot commit from this node (FAILED), or that a newer one
        of the same job replaced (CANCELLED); ``record_first`` as in Endings.end."""
        await self.publisher.end(gen, reason, kind=kind, event=event, record_first=record_first)

    # -- tasks -------------------------------------------------------------------------------
    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(max(1, self.config.destination.max_concurrency)):
                tg.create_task(self._worker(), name=f"drain-{i}")
            tg.create_task(self.publisher.run(), name="publisher")

    def _drainable(self, shard: ShardRecord) -> GenerationRecord | None:
        """The shard's generation, if the shard is still that generation's to drain now."""
        gen = self.ledger.get(shard.job, shard.step)
        if (gen is None or gen.terminal or shard.state is not ShardState.STAGED
                or shard.deferred or gen.shards.get(shard.path) is not shard):
            return None  # gone, ended, or an old attempt's shard: not this generation's
        return gen

    def _batchable(self, shard: ShardRecord) -> bool:
        b = self.backend
        return b.batch_shards > 1 and shard.size <= b.batch_shard_bytes

    def _batch_behind(self, gen: GenerationRecord, shard: ShardRecord) -> list[ShardRecord]:
        """Small shards of ``gen`` queued in ``shard``'s directory or behind it, to drain with
        it in one go."""
        b = self.backend
        return self._queue.take_more(shard, b.batch_shards - 1, b.batch_bytes - shard.size,
                                     b.batch_shard_bytes,
                                     lambda s: self._drainable(s) is gen)

    async def _worker(self) -> None:
        while True:
            shard = await self._queue.get()
            gen = self._drainable(shard)
            if gen is None:
                continue
            small = self._batchable(shard)
            if small and self._lanes.full:
                # Small shards drain in a few lanes (Backend.batch_lanes). This one goes back
                # in its place (its generation and id order it), and the worker waits for a
                # lane holding nothing: one that waited with a shard in hand would then batch
                # from the leftovers of that shard's directory.
                self.enqueue(gen, shard)
                await self._lanes.freed()
                continue
            async with self._lanes.lane() if small else contextlib.nullcontext():
                batch = [shard, *self._batch_behind(gen, shard)] if small else [shard]
                # The failure boundary of a drain: whatever goes wrong fails this generation
                # and the worker takes the next shard; nothing reaches the TaskGroup.
                try:
                    if await self._foreign(gen):
                        continue
                    if len(batch) == 1:
                        await self._drain(gen, shard)
                    else:
                        await self._drain_batch(gen, batch)
                except Exception as exc:
                    log_event(log, logging.ERROR, "drain_crashed", job=gen.job, step=gen.step,
                              path=shard.path, exc_info=True)
                    self.metrics.internal_error("drain")
                    await self.publisher.end_safely(
                        gen, f"draining {shard.path!r} failed unexpectedly "
                             f"({type(exc).__name__}: {exc}); the daemon log has the traceback",
                        kind="internal")

    async def _drain_deferred(self, gen: GenerationRecord, shard: ShardRecord) -> bool:
        if await self._foreign(gen):
            return False
        return await self._drain(gen, shard, then_advance=False)

    async def _foreign(self, gen: GenerationRecord) -> bool:
        """Whether ``gen`` ended because its job belongs to another user at the destination
        (asked once, before its first shard is written there); a destination that cannot
        answer fails the generation as a failed drain would."""
        try:
            return await self.publisher.ended_if_foreign(gen)
        except (BackendError, ManifestError) as exc:
            await self.publisher.end(gen, f"could not read the job's owner at the "
                                     f"destination: {exc}", kind="drain")
            return True

    async def _drain(self, gen: GenerationRecord, shard: ShardRecord, *, then_advance: bool = True) -> bool:
        """Copy one shard to the destination; True when it drained."""
        if gen.terminal or shard.state is not ShardState.STAGED:
            return False
        try:
            return await self._drain_staged(gen, shard, then_advance=then_advance)
        finally:
            await self._give_back(gen, [shard])

    async def _give_back(self, gen: GenerationRecord, shards: list[ShardRecord]) -> None:
        """Copies given up half-way (their generation ended, or the daemon stops): each shard
        still draining is staged again, and queued again if its generation is open. It is open
        when a retry came while the copy still settled (a thread finishing its call): the
        retry queued only the shards staged then, and one given back after it stayed staged,
        unqueued, and its generation open for good (found attacking)."""
        for shard in shards:
            if shard.state is ShardState.DRAINING:
                await self.ledger.apply(shard, ShardEvent.DRAIN_GAVE_UP, persist=False)
                if self._drainable(shard) is gen:
                    self.enqueue(gen, shard)

    async def _drain_batch(self, gen: GenerationRecord, shards: list[ShardRecord]) -> None:
        """Copy many small shards of ``gen`` in one backend call (one thread job, shared
        fsyncs on POSIX), journal them drained together (the journal batches the rows), and
        advance once. A shard the batch could not write (an error, a name already taken)
        goes on its own through :meth:`_drain`, retries and collision handling included."""
        # Looked at again: the batch was taken before the owner check's await, and meanwhile
        # its generation may have ended (nothing of it is written then), or ended and been
        # retried, its shards queued again and taken by another worker (found attacking: a
        # second DRAIN_STARTED failed the retried generation as internal).
        shards = [shard for shard in shards if self._drainable(shard) is gen]
        if not shards:
            return
        alone: list[ShardRecord] = []
        started: list[ShardRecord] = []  # the ones this call gives back, not another's
        try:
            for shard in shards:
                await self.ledger.apply(shard, ShardEvent.DRAIN_STARTED, persist=False)
                started.append(shard)
            outcomes = await self._put_batch(gen, shards)
            if outcomes is None or gen.terminal:
                return  # discarded: its generation ended mid-copy
            now = time.time()
            written: list[tuple[ShardRecord, str]] = []
            for shard, outcome in zip(shards, outcomes, strict=True):
                if shard.state is not ShardState.DRAINING:
                    continue
                if isinstance(outcome, str):
                    written.append((shard, outcome))
                else:
                    alone.append(shard)
            # The batch's bytes counted once (drained bytes, drain rate), not per shard.
            for shard, _ in written:
                shard.moved_bytes = shard.size
            if written:
                self.count_drained(gen.job, sum(shard.size for shard, _ in written))
            await self.ledger.apply_shards(
                [(shard, {"checksum": checksum, "drained_at": now}) for shard, checksum in written],
                ShardEvent.DRAINED)
            for shard, _ in written:
                self._on_drained(shard)
        finally:
            await self._give_back(gen, started)
        for shard in alone:
            if gen.terminal:
                return
            await self._drain(gen, shard, then_advance=False)
        await self.publisher.advance(gen)

    async def _drain_staged(self, gen: GenerationRecord, shard: ShardRecord, *,
                            then_advance: bool) -> bool:
        await self.ledger.apply(shard, ShardEvent.DRAIN_STARTED, persist=False)
        budget_s = self.config.drain.retry_budget_s
        backoff = self.config.drain.retry_initial_backoff_s
        deadline = time.monotonic() + budget_s
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._prepare(gen)
                checksum = await self._put(shard)
                break
            except Discarded:
                # Its generation ended mid-copy: the upload will never complete. Left open, a
                # resumed one (its id journalled before a restart) stayed until the orphan
                # sweep's grace, an hour (found attacking `abort` after a restart).
                await self.abort_upload(gen, shard)
                return False
            except (BackendError, OSError) as caught:
                if isinstance(caught, BackendError):
                    exc, kind = caught, caught.kind
                elif caught.errno in RUN_OUT:
                    # The daemon (or the node) out of file descriptors or memory opening the
                    # staged copy: it passes once others are closed. It failed acknowledged
                    # generations for good (found attacking with idle connections).
                    exc, kind = BackendError(
                        f"could not open the staged copy of {shard.path}: {caught.strerror} "
                        "(this daemon or the node ran short; retried)", transient=True,
                        kind="io"), "staging"
                else:
                    # The staged copy itself is unreadable: nothing a retry can fix.
                    self.metrics.drain_error(self.destination, "staging")
                    await self._fail_shard(gen, shard, f"staged copy unreadable: {caught}")
                    return False
                self.metrics.drain_error(self.destination, kind)
                self._error_log.log_event(
                    log, logging.WARNING, "drain_error", cause=f"{self.destination}:{kind}",
                    job=gen.job, step=gen.step, path=shard.path, kind=exc.kind,
                    transient=exc.transient, attempt=attempt, error=str(exc))
                if not exc.transient or time.monotonic() + backoff > deadline:
                    await self._fail_shard(gen, shard, f"{exc.kind}: {exc}")
                    return False
                gen.retrying = retrying_note(exc, attempt)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.config.drain.retry_max_backoff_s)
        if gen.terminal or shard.state is not ShardState.DRAINING:
            await self._abort_stale_upload(gen, shard)
            return False
        if shard.deferred and shard.checksum and checksum != shard.checksum:
            promised = await self._promised(shard, checksum)
            if promised is None:
                # The part record already promised shard.checksum: the staged copy changed.
                self.metrics.drain_error(self.destination, "integrity")
                await self._fail_shard(gen, shard, f"staged copy changed: {checksum} != {shard.checksum}")
                return False
            checksum = promised
        now = time.time()
        gen.retrying = ""
        await self.ledger.apply(shard, ShardEvent.DRAINED, checksum=checksum, drained_at=now)
        self._on_drained(shard)
        # Once drained, not before: an abort is never begun while the shard drains (its
        # upload may be the drain's own: owedaborts.wanted).
        await self._abort_stale_upload(gen, shard)
        if then_advance:
            await self.publisher.advance(gen)
        return True

    async def _promised(self, shard: ShardRecord, checksum: str) -> str | None:
        """The checksum a deferred shard's part record promised, when its staged copy still
        has it though the drain computed ``checksum`` with another algorithm; else None. A
        version writing format 1 promised sha256 at the hand-off: upgraded before the
        generation committed, this version's CRC64NVME of the same bytes failed the shard
        as "staged copy changed", and the generation with it (found attacking upgrades)."""
        try:
            algo = parse_checksum(shard.checksum)[0]
        except ManifestError:
            return None
        if algo == parse_checksum(checksum)[0]:
            return None  # one algorithm, two values: the bytes did change
        try:
            now = await in_thread(self.staging.checksum, shard.staged_name, algo)
        except OSError:
            return None
        return shard.checksum if now == shard.checksum else None

    async def _fail_shard(self, gen: GenerationRecord, shard: ShardRecord, reason: str) -> None:
        if shard.state is not ShardState.DRAINING:
            return  # discarded meanwhile: its generation was aborted or cancelled
        await self.ledger.apply(shard, ShardEvent.DRAIN_FAILED, error=reason)
        await self.abort_upload(gen, shard)
        if not gen.terminal:
            await self.fail_generation(gen, f"shard {shard.path!r} could not drain: {reason}",
                                       kind="drain")

    def _terminal(self, gen: GenerationRecord) -> None:
        """``gen`` committed, failed or was cancelled: forget its prepared prefix (a retry
        prepares it again: prepare_prefix is idempotent), then tell the daemon."""
        self._prepared.discard(generation_prefix(gen.job, gen.step))
        self._on_terminal(gen)

    def _discard_copies(self, gen: GenerationRecord) -> None:
        """Its generation ended: cancel its copies in flight, and give up the resumable
        uploads kept from earlier transient failures (in the publisher's TaskGroup)."""
        loop = asyncio.get_running_loop()
        kept: list[ShardRecord] = []
        for shard in gen.shards.values():
            scope = self._inflight.get(shard.id)
            if scope is not None:
                if not scope.expired():
                    scope.reschedule(loop.time())
            elif shard.state is not ShardState.DRAINED:
                kept.append(shard)
        if kept and self._upload_log_for is not None:
            self.publisher.submit(f"abort-uploads {gen.job} {gen.step}",
                                  lambda: self._abort_uploads(gen, kept))

    async def _abort_uploads(self, gen: GenerationRecord, shards: list[ShardRecord]) -> None:
        for shard in shards:
            await self.abort_upload(gen, shard)
