"""Drains staged shards to the destination and commits generations.

Oldest generation first, at most ``destination.max_concurrency`` drains at once, every task
owned by the scheduler's TaskGroup. A shard is retried with backoff and jitter until its retry
budget is spent; then its generation fails and the local copy is kept for ``ckptdrain retry``.
After the last shard of a rank drains, this node rewrites its part record and tries to publish
the manifest (DESIGN.md section 4); generations waiting on other nodes are polled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptdrain.client.manifest import PartRecord, ShardEntry, generation_prefix, shard_key
from ckptdrain.daemon.backends.base import Backend, BackendError, UploadLog
from ckptdrain.daemon.commit import CommitOutcome, Committer
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.logs import OncePerCause, log_event
from ckptdrain.daemon.ratelimit import TokenBucket
from ckptdrain.daemon.state import GenerationState, RankState, ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.metrics import Metrics
    from ckptdrain.daemon.staging import Staging

log = logging.getLogger("ckptdrain.scheduler")


class FairQueue:
    """Shards waiting to drain. Jobs take turns, so one job's backlog never starves another's
    newer checkpoint; within a job the oldest generation goes first, in hand-off order."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[tuple[float, int, int], ShardRecord]]] = {}
        self._turns: collections.deque[str] = collections.deque()
        self._ready = asyncio.Event()
        self._size = 0

    def put(self, job: str, key: tuple[float, int, int], shard: ShardRecord) -> None:
        heap = self._heaps.get(job)
        if heap is None:
            heap = self._heaps[job] = []
            self._turns.append(job)
        heapq.heappush(heap, (key, shard))
        self._size += 1
        self._ready.set()

    async def get(self) -> ShardRecord:
        while not self._size:
            self._ready.clear()
            await self._ready.wait()
        job = self._turns.popleft()
        heap = self._heaps[job]
        _, shard = heapq.heappop(heap)
        self._size -= 1
        if heap:
            self._turns.append(job)
        else:
            del self._heaps[job]
        return shard

    def qsize(self) -> int:
        return self._size


class _Discarded(Exception):
    """The copy was cancelled because its generation failed or was cancelled."""


class Scheduler:
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
        upload_log_for: Callable[[ShardRecord], UploadLog | None] | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.staging = staging
        self.backend = backend
        self.committer = committer
        self.metrics = metrics
        self._on_drained = on_drained
        self._on_terminal = on_terminal
        self._upload_log_for = upload_log_for
        self._queue = FairQueue()
        self._seq = itertools.count()
        self._prepared: set[str] = set()
        self._recorded_poll = asyncio.Event()
        self._drained_bytes_window: list[tuple[float, int]] = []
        self.destination = config.destination.scheme
        # A destination outage fails every shard the same way: log each cause once a minute
        # with a count, not once per shard and attempt.
        self._error_log = OncePerCause(60.0)
        self._pacer_changed = asyncio.Event()
        self.pacer = TokenBucket(config.drain.max_bandwidth_bytes_per_s)
        # Copies in flight, by shard id: a failed or cancelled generation cancels them (an S3
        # upload then waits for its in-flight parts and aborts itself).
        self._inflight: dict[int, asyncio.Task[str]] = {}
        self._tg: asyncio.TaskGroup | None = None

    # -- queueing ----------------------------------------------------------------------------
    def enqueue(self, gen: GenerationRecord, shard: ShardRecord) -> None:
        # Jobs take turns; within a job, oldest generation first, then hand-off order.
        self._queue.put(gen.job, (gen.created_at, shard.id, next(self._seq)), shard)

    def set_bandwidth(self, bytes_per_s: int) -> None:
        """A new drain rate (SIGHUP): waiters paced at the old rate go now; the new rate
        applies from here on."""
        self.pacer = TokenBucket(bytes_per_s)
        self._pacer_changed.set()
        self._pacer_changed = asyncio.Event()

    def poke_commits(self) -> None:
        self._recorded_poll.set()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def drain_rate_bytes_per_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        self._drained_bytes_window = [(t, n) for t, n in self._drained_bytes_window if now - t < window_s]
        if not self._drained_bytes_window:
            return 0.0
        total = sum(n for _, n in self._drained_bytes_window)
        span = max(1.0, now - self._drained_bytes_window[0][0])
        return total / span

    # -- tasks -------------------------------------------------------------------------------
    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            for i in range(max(1, self.config.destination.max_concurrency)):
                tg.create_task(self._worker(), name=f"drain-{i}")
            tg.create_task(self._commit_poller(), name="commit-poller")

    async def _worker(self) -> None:
        while True:
            shard = await self._queue.get()
            gen = self.ledger.get(shard.job, shard.step)
            if (gen is None or gen.terminal or shard.state is not ShardState.STAGED
                    or shard.deferred or gen.shards.get(shard.path) is not shard):
                continue  # gone, ended, or an old attempt's shard: not this generation's
            await self._drain(gen, shard)

    async def _drain(self, gen: GenerationRecord, shard: ShardRecord, *, then_advance: bool = True) -> bool:
        """Copy one shard to the destination; True when it drained."""
        if gen.terminal or shard.state is not ShardState.STAGED:
            return False
        try:
            return await self._drain_staged(gen, shard, then_advance=then_advance)
        finally:
            if shard.state in (ShardState.DRAINING,):  # (mypy narrows `is` from the guard)
                # Given up half-way (its generation ended): staged again, so a retry sends it.
                await self.ledger.set_shard(shard, ShardState.STAGED, persist=False)

    async def _drain_staged(self, gen: GenerationRecord, shard: ShardRecord, *,
                            then_advance: bool) -> bool:
        # Pace before the copy so draining never takes more than its share of the network.
        delay = self.pacer.reserve(shard.size, time.monotonic())
        if delay:
            # A reload that changes the rate wakes the wait early (set_bandwidth).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pacer_changed.wait(), delay)
            if gen.terminal or shard.state is not ShardState.STAGED:
                return False
        await self.ledger.set_shard(shard, ShardState.DRAINING, persist=False)
        prefix = generation_prefix(gen.job, gen.step)
        budget_s = self.config.drain.retry_budget_s
        backoff = self.config.drain.retry_initial_backoff_s
        deadline = time.monotonic() + budget_s
        attempt = 0
        while True:
            attempt += 1
            try:
                if prefix not in self._prepared:
                    await self.backend.prepare_prefix(prefix)
                    self._prepared.add(prefix)
                checksum = await self._put(shard)
                break
            except _Discarded:
                return False
            except BackendError as exc:
                self.metrics.drain_error(self.destination, exc.kind)
                self._error_log.log_event(
                    log, logging.WARNING, "drain_error", cause=f"{self.destination}:{exc.kind}",
                    job=gen.job, step=gen.step, path=shard.path, kind=exc.kind,
                    transient=exc.transient, attempt=attempt, error=str(exc))
                if not exc.transient or time.monotonic() + backoff > deadline:
                    await self._fail_shard(gen, shard, f"{exc.kind}: {exc}")
                    return False
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.config.drain.retry_max_backoff_s)
            except OSError as exc:
                # The staged copy itself is unreadable: nothing a retry can fix.
                self.metrics.drain_error(self.destination, "staging")
                await self._fail_shard(gen, shard, f"staged copy unreadable: {exc}")
                return False
        if gen.terminal or shard.state is not ShardState.DRAINING:
            return False
        if shard.deferred and shard.checksum and checksum != shard.checksum:
            # The part record already promised shard.checksum: the staged copy changed.
            self.metrics.drain_error(self.destination, "integrity")
            await self._fail_shard(gen, shard, f"staged copy changed: {checksum} != {shard.checksum}")
            return False
        now = time.time()
        await self.ledger.set_shard(shard, ShardState.DRAINED, checksum=checksum, drained_at=now)
        self._drained_bytes_window.append((time.monotonic(), shard.size))
        self.metrics.drained(gen.job, shard.size, self.destination)
        self._on_drained(shard)
        if then_advance:
            await self.advance(gen)
        return True

    async def _put(self, shard: ShardRecord) -> str:
        fd = self.staging.open_data(shard.staged_name)
        try:
            upload_log = self._upload_log_for(shard) if self._upload_log_for else None
            # Its own task so fail_generation can cancel just this copy; awaited right here.
            task = asyncio.ensure_future(self.backend.put_file(
                shard_key(shard.job, shard.step, shard.path), fd, shard.size,
                upload_log=upload_log,
            ))
            self._inflight[shard.id] = task
            try:
                return await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the daemon is stopping
                raise _Discarded from None
        finally:
            self._inflight.pop(shard.id, None)
            os.close(fd)

    async def _fail_shard(self, gen: GenerationRecord, shard: ShardRecord, reason: str) -> None:
        if shard.state is not ShardState.DRAINING:
            return  # discarded meanwhile: its generation was aborted or cancelled
        await self.ledger.set_shard(shard, ShardState.FAILED, error=reason)
        await self.abort_upload(shard)
        if not gen.terminal:
            await self.fail_generation(gen, f"shard {shard.path!r} could not drain: {reason}",
                                       kind="drain")

    async def fail_generation(self, gen: GenerationRecord, reason: str, *, kind: str,
                              state: GenerationState = GenerationState.FAILED) -> None:
        """End a generation that cannot commit from this node (FAILED), or that a newer one
        of the same job replaced (CANCELLED): its copies in flight are cancelled and its
        resumable uploads aborted."""
        if gen.terminal:
            return
        await self.ledger.save_generation(gen, state, error=reason)
        self.metrics.generation_failed(gen.job, kind)
        self._on_terminal(gen)
        for shard in gen.shards.values():
            task = self._inflight.get(shard.id)
            if task is not None:
                task.cancel()
            elif shard.state is not ShardState.DRAINED and self._tg is not None:
                # A resumable upload kept from an earlier transient failure: give it up.
                self._tg.create_task(self.abort_upload(shard))
        log_event(log, logging.ERROR if state is GenerationState.FAILED else logging.WARNING,
                  f"generation_{state}", job=gen.job, step=gen.step, reason=reason)

    async def abort_upload(self, shard: ShardRecord) -> None:
        if self._upload_log_for is None:
            return
        upload_log = self._upload_log_for(shard)
        if upload_log is None:
            return
        try:
            await self.backend.abort_upload(
                shard_key(shard.job, shard.step, shard.path), upload_log)
        except BackendError as exc:
            log_event(log, logging.WARNING, "abort_failed", job=shard.job, step=shard.step,
                      path=shard.path, error=str(exc),
                      action="left to the orphan sweep and the lifecycle rule")

    # -- commit ------------------------------------------------------------------------------
    async def advance(self, gen: GenerationRecord) -> None:
        """Write this node's part record once every sealed rank has drained, then try to
        publish the manifest."""
        async with gen.lock:
            if gen.terminal or not gen.ranks:
                return
            pending = [
                r for r, st in gen.ranks.items()
                if st is RankState.OPEN or (st is RankState.SEALED and not gen.rank_drained(r))
            ]
            if pending:
                return
            ready = [r for r, st in gen.ranks.items() if st is RankState.SEALED]
            if ready:
                await self._record_part(gen, ready)
            if gen.state is GenerationState.OPEN:
                await self.ledger.save_generation(gen, GenerationState.RECORDED)
            if gen.state is GenerationState.RECORDED:
                await self._publish_when_covered(gen)

    async def _publish_when_covered(self, gen: GenerationRecord) -> None:
        """Publish, first draining deferred shards once every rank has its part record.
        Called with ``gen.lock`` held."""
        deferred = gen.pending_deferred()
        if deferred:
            try:
                missing = await self._with_retries(
                    gen, lambda: self.committer.ranks_missing(gen.job, gen.step, gen.world_size, gen.attempt))
            except BackendError as exc:
                await self.fail_generation(gen, f"commit failed: {exc}", kind="drain")
                return
            if missing is None or missing:
                return  # other nodes are not done (or disagree: try_publish will say so)
            for shard in deferred:
                if not await self._drain(gen, shard, then_advance=False):
                    return
        await self._try_publish(gen)

    async def _record_part(self, gen: GenerationRecord, ready: list[int]) -> None:
        recorded = sorted(
            r for r, st in gen.ranks.items() if st is RankState.RECORDED or r in ready
        )
        shards = sorted(
            (s for s in gen.shards.values() if s.rank in recorded),
            key=lambda s: (s.rank, s.path),
        )
        now = time.time()
        staged_at = max((s.staged_at for s in shards), default=now)
        drained_at = max((s.drained_at or now for s in shards), default=now)
        part = PartRecord(
            job=gen.job,
            step=gen.step,
            world_size=gen.world_size,
            node=self.config.node_id,
            ranks=tuple(recorded),
            shards=tuple(
                ShardEntry(path=s.path, size=s.size, checksum=s.checksum, rank=s.rank,
                           node=self.config.node_id)
                for s in shards
            ),
            clocks={
                "handoff": gen.handoff_at or min((s.handed_at for s in shards), default=now),
                "staged": staged_at,
                "drained": drained_at,
            },
            attempt=gen.attempt,
        )
        await self._with_retries(gen, lambda: self.committer.record_part(part))
        for r in ready:
            await self.ledger.set_rank(gen, r, RankState.RECORDED)
        gen.staged_at, gen.drained_at = staged_at, drained_at

    async def _with_retries(self, gen: GenerationRecord, op: Callable[[], object]) -> object:
        backoff = self.config.drain.retry_initial_backoff_s
        deadline = time.monotonic() + self.config.drain.retry_budget_s
        while True:
            try:
                return await op()  # type: ignore[misc]
            except BackendError as exc:
                self.metrics.drain_error(self.destination, exc.kind)
                if not exc.transient or time.monotonic() + backoff > deadline:
                    raise
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.config.drain.retry_max_backoff_s)

    async def _try_publish(self, gen: GenerationRecord) -> None:
        try:
            result = await self._with_retries(
                gen, lambda: self.committer.try_publish(gen.job, gen.step, gen.world_size, gen.attempt)
            )
        except BackendError as exc:
            await self.fail_generation(gen, f"commit failed: {exc}", kind="drain")
            return
        outcome = result.outcome  # type: ignore[attr-defined]
        if outcome in (CommitOutcome.PUBLISHED, CommitOutcome.ACCEPTED):
            manifest = result.manifest  # type: ignore[attr-defined]
            committed_at = manifest.clocks.get("committed", time.time()) if manifest else time.time()
            await self.ledger.save_generation(gen, GenerationState.COMMITTED,
                                              committed_at=committed_at)
            clocks = {
                "started": gen.created_at,
                "handoff": gen.handoff_at or gen.created_at,
                "staged": gen.staged_at or committed_at,
                "drained": gen.drained_at or committed_at,
                "committed": committed_at,
            }
            self.metrics.generation_committed(gen.job, gen.step, clocks, committed_at)
            self._on_terminal(gen)
            log_event(log, logging.INFO, "generation_committed", job=gen.job, step=gen.step,
                      outcome=outcome.name.lower(), shards=len(gen.shards),
                      bytes=sum(s.size for s in gen.shards.values()))
        elif outcome is CommitOutcome.CONFLICT:
            await self.fail_generation(
                gen, f"another manifest for this generation differs: {result.reason}",  # type: ignore[attr-defined]
                kind="conflict")

    async def _commit_poller(self) -> None:
        """Generations whose part record is written wait for the other nodes' records; poll."""
        interval = self.config.drain.commit_poll_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recorded_poll.wait(), interval)
            self._recorded_poll.clear()
            for gen in list(self.ledger.generations.values()):
                if gen.state is GenerationState.RECORDED:
                    try:
                        async with gen.lock:
                            if gen.state is GenerationState.RECORDED:
                                await self._publish_when_covered(gen)
                    except Exception as exc:  # keep polling the others
                        log_event(log, logging.WARNING, "commit_poll_error", job=gen.job,
                                  step=gen.step, error=str(exc))
