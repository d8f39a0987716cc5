"""Commit orchestration: from "this node's ranks drained" to the manifest.

:meth:`Publisher.advance` writes this node's part record once its ranks drained and, when the
records of all nodes cover every rank, drains the deferred shards and publishes the manifest
through the :class:`~ckptdrain.daemon.commit.Committer` at the commit point (commitpoint.py,
the publisher's base). A generation waiting for other nodes (RECORDED) is polled until it ends
(commitwaits.py). Every end of a generation, and the failure boundary around every commit step,
is endings.py's: a node that fails a generation rewrites its record with the ranks it can no
longer deliver aborted, so the others end it too, and one whose ranks were all recorded does so
before they hear of it, whatever ended it (its commit_wait_s, its own create refused): no node
may commit a step whose ranks were told it failed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from ckptdrain.client.manifest import (
    PartRecord,
    RecordTooLarge,
)
from ckptdrain.daemon import owners
from ckptdrain.daemon.assembly import (
    describe_aborted,
    describe_missing,
    missing_ranks,
    not_this_nodes,
)
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.commitpoint import PART_READ_MAX_S, PART_READ_MIN_S, CommitPoint
from ckptdrain.daemon.commitwaits import CommitWaits
from ckptdrain.daemon.endings import Endings, destination_error
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.locks import KeyedLocks
from ckptdrain.daemon.logs import OncePerCause, log_event
from ckptdrain.daemon.partrecords import FailureRecords, part_record
from ckptdrain.daemon.records import assign, retrying_note
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    RankEvent,
    RankState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.metrics import Metrics

log = logging.getLogger("ckptdrain.publisher")

_T = TypeVar("_T")
_G = GenerationState

Work = Callable[[], Awaitable[object]]  # what it returns is not looked at


class Publisher(CommitPoint):
    def __init__(
        self,
        *,
        config: Config,
        ledger: Ledger,
        committer: Committer,
        metrics: Metrics,
        drain: Callable[[GenerationRecord, ShardRecord], Awaitable[bool]],
        on_terminal: Callable[[GenerationRecord], None],
        on_ended: Callable[[GenerationRecord], None],
        on_published: Callable[[GenerationRecord], None] = lambda gen: None,
        on_vanished: Callable[[ShardRecord], None] = lambda shard: None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.committer = committer
        self.metrics = metrics
        self._drain = drain  # a deferred shard, copied right before the manifest
        # This node's create made the manifest: the daemon runs the job's retention (one node
        # per commit, not every node of the job).
        self._on_published = on_published
        self._on_vanished = on_vanished  # the local copy holds a queue slot again
        self.destination = config.destination.scheme
        # Work that outlives its caller (a failure record, aborting uploads), queued here and
        # started by run() inside its TaskGroup: callers are outside that scope.
        self._work: asyncio.Queue[tuple[str, Work]] = asyncio.Queue()
        # This node's part record of each generation, written by the advance and rewritten
        # by a failure: one at a time per generation (the failure's, written last, stands).
        self._part_locks = KeyedLocks()
        self.failures = FailureRecords(config=config, ledger=ledger, committer=committer,
                                       locks=self._part_locks, retrying=self._with_retries)
        # An unreachable destination fails every poll alike: one line per cause a minute.
        self.error_log = OncePerCause(60.0)
        self.waits = CommitWaits(self)
        self.ends = Endings(self, on_terminal=on_terminal, on_ended=on_ended)

    def poke(self) -> None:
        """Poll the generations waiting on other nodes now, not at the next interval."""
        self.waits.poke()

    def submit(self, name: str, work: Work) -> None:
        """Run ``work`` in the publisher's TaskGroup, failure boundary included."""
        self._work.put_nowait((name, work))

    async def run(self) -> None:
        for gen in self.failures.unsent():
            self.submit(f"failure-record {gen.job} {gen.step}",
                        functools.partial(self.failures.resend, gen,
                                          self.ends.committed_after_all))
        # As many at once as the destination is allowed requests; the rest wait their turn.
        slots = asyncio.Semaphore(max(1, self.config.destination.max_concurrency))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.waits.run(), name="commit-poller")
            while True:
                name, work = await self._work.get()
                await slots.acquire()
                tg.create_task(self._run_work(name, work, slots), name=name)

    async def _run_work(self, name: str, work: Work, slots: asyncio.Semaphore) -> None:
        try:
            await work()
        except Exception:
            log_event(log, logging.ERROR, "task_failed", task=name, exc_info=True)
            self.metrics.internal_error("commit")
        finally:
            slots.release()

    # -- ends (endings.py) ---------------------------------------------------------------------
    async def end(self, gen: GenerationRecord, reason: str, *, kind: str,
                  event: GenerationEvent = GenerationEvent.FAILED, told: str = "",
                  record_first: bool = True) -> None:
        """:meth:`Endings.end`: the one place a generation ends."""
        await self.ends.end(gen, reason, kind=kind, event=event, told=told,
                            record_first=record_first)

    async def end_safely(self, gen: GenerationRecord, reason: str, *, kind: str,
                         event: GenerationEvent = GenerationEvent.FAILED) -> None:
        """:meth:`Endings.end_safely`: :meth:`end` for failure boundaries."""
        await self.ends.end_safely(gen, reason, kind=kind, event=event)

    async def committed_here(self, gen: GenerationRecord) -> bool | None:
        """:meth:`Endings.committed_here`."""
        return await self.ends.committed_here(gen)

    # -- advance: part record, coverage, publish ----------------------------------------------
    async def advance(self, gen: GenerationRecord) -> None:
        """Write this node's part record once every rank begun here has drained, then publish
        the manifest if every node's records cover every rank. Never raises (but cancellation)."""
        async with gen.lock:
            await self.ends.guarded(gen, "committing", self._advance(gen))

    async def _advance(self, gen: GenerationRecord) -> None:
        if gen.terminal or not gen.ranks:
            return
        # A recorded rank waits too: a retry drains again a shard that went missing at the
        # destination after its rank was recorded, and published before that copy ended, the
        # generation failed again, for as long as the copy took longer than the publish
        # (found attacking the retry).
        if any(st is RankState.OPEN or (st in (RankState.SEALED, RankState.RECORDED)
                                        and not gen.rank_drained(r))
               for r, st in gen.ranks.items()):
            return
        ready = [r for r, st in gen.ranks.items() if st is RankState.SEALED]
        # Open with nothing new to record: retried (or recovered between its record and
        # RECORDED). Written again all the same: the record at the destination may be the
        # failure record of its expiry, every rank aborted, which ended the step on every
        # node that read it, this one's retried commit included.
        rewrite = not ready and gen.state is _G.OPEN
        if (ready or rewrite) and not await self._record_part(gen, ready):
            return
        if gen.state is _G.OPEN:
            await self.ledger.apply(gen, GenerationEvent.RECORDED)
        if gen.state is _G.RECORDED:
            await self.settle(gen)

    async def _record_part(self, gen: GenerationRecord, ready: list[int]) -> bool:
        try:
            # First: the record names the job's owner, which this may settle (owners.adopt).
            if await self.ended_if_foreign(gen):
                return False
        except BackendError as exc:
            await self.end(gen, f"could not read the job's owner at the destination: {exc}",
                           kind="drain")
            return False
        part = await part_record(self.config, self.ledger, gen,
                                 [r for r, st in gen.ranks.items()
                                  if st is RankState.RECORDED or r in ready])
        failure: tuple[str, str] | None = None
        async with self._part_locks.hold(gen.key):
            if gen.terminal or self.ledger.get(gen.job, gen.step) is not gen:
                return False  # ended meanwhile: its failure record says so, not this one
            if gen.aborting:
                # An abort wrote (or is writing) its failure record first, and ends it next:
                # "recorded" written over that let a node looking meanwhile publish the step
                # (found attacking the record-first abort).
                return False
            try:
                await self._with_retries(lambda: self.committer.record_part(part), gen)
            except BackendError as exc:
                failure = f"could not write this node's part record: {exc}", "drain"
            except RecordTooLarge as exc:  # the job's doing: too many shards
                failure = str(exc), "aborted"
        if failure is not None:
            # Not under the part lock: the end may write the failure record first (end).
            await self.end(gen, failure[0], kind=failure[1])
            return False
        if gen.terminal:
            # Ended (an abort) while the record was written: its failure record, written
            # after this one under the same part lock, is the one that stands.
            return False
        for r in ready:
            # A rank an abort took meanwhile stays aborted (applying RECORDED to it failed
            # the commit as an internal error).
            if gen.ranks.get(r) is RankState.SEALED:
                await self.ledger.apply((gen, r), RankEvent.RECORDED)
        if ready:
            # The drained clock is also where drain.commit_wait_s counts from (journalled
            # with the RECORDED state right after this). Not for a record only written again:
            # a retry's wait counts from the retry (maintenance.retry).
            assign(gen, "staged_at", part.clocks["staged"])
            assign(gen, "drained_at", part.clocks["drained"])
        return True

    async def settle(self, gen: GenerationRecord) -> None:
        """Publish when the part records cover every rank; end the generation when they say
        it can never commit. Called with ``gen.lock`` held, for a RECORDED generation."""
        others: list[PartRecord] = []
        parts = await self._read_parts(gen, others)
        if parts is None or gen.terminal:
            return
        recorded = {r for r, st in gen.ranks.items() if st is RankState.RECORDED}
        twin = not_this_nodes(parts, self.config.node_id, set(gen.ranks), recorded)
        if twin:
            # This node's part can never stand at its key: its ranks are aborted, so the
            # failure record the end writes there tells the other daemon and every other
            # node at their next look, rather than after drain.commit_wait_s.
            for r in recorded:
                await self.ledger.apply((gen, r), RankEvent.ABORTED)
            await self.end(gen, twin, kind="conflict")
            return
        aborted = describe_aborted(parts)
        if aborted:
            # Another node that failed the step writes its failure record over a record
            # that said "recorded" (end), and a node that read the records just before may
            # have published from them: the manifest, if there is one with this node's part,
            # decides (at the commit point: not in the middle of an operator's abort). A
            # destination that cannot say now: the abort stands, as before.
            async with gen.commit_point:
                if not gen.terminal and not await self.ends.found_committed(gen):
                    await self.end(gen, aborted, kind="aborted",
                                   event=GenerationEvent.PEER_ABORTED)
            return
        missing = missing_ranks(parts, gen.world_size)
        if missing:
            self.waits.missing[gen.key] = describe_missing(missing, others)
            return  # other nodes are not done: the poller looks again
        for shard in gen.pending_deferred():
            if not await self._drain(gen, shard):
                return
        if not gen.terminal:
            await self._try_publish(gen)

    async def _read_parts(self, gen: GenerationRecord,
                          others: list[PartRecord]) -> list[PartRecord] | None:
        """This attempt's part records (other attempts' into ``others``); None when they
        cannot be read now (the poller asks again) or cannot be trusted (the generation has
        failed)."""
        bound = min(PART_READ_MAX_S, max(PART_READ_MIN_S, self.config.drain.commit_wait_s))
        try:
            # The Committer's own reader: the records must count the same here as in
            # try_publish, which decides the commit.
            async with asyncio.timeout(bound) as reading:
                parts, problem = await self.committer.read_parts(
                    gen.job, gen.step, gen.world_size, gen.attempt, others=others)
            self.waits.why_waiting.pop(gen.key, None)
        except Exception as caught:
            if isinstance(caught, TimeoutError) and reading.expired():
                why = (f"reading the part records at the destination took more than {bound:g} "
                       "s (a listing without end?)")
                self.waits.why_waiting[gen.key] = why
                self.error_log.log_event(
                    log, logging.WARNING, "commit_poll_error", cause="parts:timeout",
                    job=gen.job, step=gen.step, error=f"{why}; asked again at the next poll")
                return None
            exc = destination_error(caught)
            if exc is None or not exc.transient:
                raise (exc or caught) from None
            self.metrics.drain_error(self.destination, exc.kind)
            self.error_log.log_event(log, logging.WARNING, "commit_poll_error",
                                     cause=f"parts:{exc.kind}", job=gen.job, step=gen.step,
                                     error=str(exc))
            return None
        if problem:
            await self.end(gen, f"the part records cannot be combined: {problem}",
                           kind="conflict")
            return None
        return parts

    async def _with_retries(self, op: Callable[[], Awaitable[_T]],
                            gen: GenerationRecord | None = None) -> _T:
        """``op``, retried on transient destination errors within drain.retry_budget_s; what
        ``gen`` is retrying shows in its status meanwhile."""
        backoff = self.config.drain.retry_initial_backoff_s
        deadline = time.monotonic() + self.config.drain.retry_budget_s
        attempt = 0
        while True:
            attempt += 1
            try:
                result = await op()
                if gen is not None:
                    gen.retrying = ""
                return result
            except Exception as caught:
                exc = destination_error(caught)
                if exc is None:
                    raise
                self.metrics.drain_error(self.destination, exc.kind)
                # Said as the drain says its errors: a wait for a mount is seen, not silent.
                self.error_log.log_event(
                    log, logging.WARNING, "destination_error",
                    cause=f"{self.destination}:{exc.kind}", kind=exc.kind,
                    transient=exc.transient, error=str(exc))
                if not exc.transient or time.monotonic() + backoff > deadline:
                    raise exc from None
                if gen is not None:
                    gen.retrying = retrying_note(exc, attempt)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.config.drain.retry_max_backoff_s)

    async def ended_if_foreign(self, gen: GenerationRecord, *, again: bool = False) -> bool:
        """End ``gen`` (conflict) when the destination names another owner of its job than
        this node's (owners.py): nothing of it may be written there. Asked before its first
        write (a shard, a part record) and, with ``again``, at its commit. A destination error
        is raised (BackendError) after the usual retries."""
        if not self.config.access.check_destination_owner or (gen.owner_checked and not again):
            return False
        await self._with_retries(
            lambda: owners.adopt(self.ledger, self.committer.owners, gen.job), gen)
        owner = self.ledger.jobs.get(gen.job)
        if owner is None:
            return False
        theirs = await self._with_retries(
            lambda: self.committer.owners.someone_else(gen.job, owner), gen)
        if theirs is None:
            gen.owner_checked = True
            return False
        await self.end(gen, f"job {gen.job!r} at the destination belongs to uid {theirs} (its "
                       f"newest committed generation), not to uid {owner} who saved this step; "
                       "nothing was written there: save under another job name",
                       kind="conflict")
        return True
