"""Commit orchestration: from "this node's ranks drained" to the end of every generation.

:meth:`Publisher.advance` writes this node's part record once its ranks drained and, when the
records of all nodes cover every rank, drains the deferred shards and publishes the manifest
through the :class:`~ckptdrain.daemon.commit.Committer`. A generation waiting for other nodes
(RECORDED) is polled until it ends: COMMITTED (the manifest appeared), FAILED (another node's
record marks a rank aborted, or ``drain.commit_wait_s`` passed since this node's drained clock,
which is journalled), or CANCELLED (a newer step of the job committed). A node that fails a
generation it cannot deliver rewrites its record with those ranks aborted, so the others end
it too; so does one whose ranks were all recorded, with all of them, before they hear of it,
whatever ended it (its commit_wait_s, its own create refused): no node may commit a step whose
ranks were told it failed (Publisher.end). Around every step, a failure boundary: a
destination error fails that generation with its message, anything else is logged once with
its traceback and fails that generation; nothing reaches the TaskGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ckptdrain.client.manifest import (
    Manifest,
    ManifestError,
    PartRecord,
    RecordTooLarge,
    latest_key,
)
from ckptdrain.daemon import owners
from ckptdrain.daemon.assembly import (
    describe_aborted,
    describe_missing,
    held_part,
    holds_part,
    missing_ranks,
    not_this_nodes,
)
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.commit import CommitOutcome, CommitResult, Committer, parse_latest
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.latest import (
    overtaken,
)
from ckptdrain.daemon.ledger import GenerationRecord, GenKey, Ledger, ShardRecord
from ckptdrain.daemon.locks import KeyedLocks
from ckptdrain.daemon.logs import OncePerCause, log_event, per_user
from ckptdrain.daemon.metrics import FAILURE_REASONS_USER
from ckptdrain.daemon.partrecords import FailureRecords, part_record
from ckptdrain.daemon.records import assign, retrying_note
from ckptdrain.daemon.state import (
    TRANSITIONS,
    GenerationEvent,
    GenerationState,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.metrics import Metrics

log = logging.getLogger("ckptdrain.publisher")

_T = TypeVar("_T")
_G = GenerationState

# A poll's read of a generation's part records is bounded: a destination whose listing never
# ends (new keys on every page) held the poller, past drain.commit_wait_s, and every other
# generation it waits on with it (found attacking). As long as the commit's wait, between
# these (a read of 1,000 nodes' records takes seconds).
PART_READ_MIN_S = 2.0
PART_READ_MAX_S = 60.0
# Generations polled at once (each reads its part records at the destination).
POLLS_AT_ONCE = 16
Work = Callable[[], Awaitable[None]]


def destination_error(exc: BaseException) -> BackendError | None:
    """The destination error ``exc`` is, if that is all it is (to retry or report, not a bug)."""
    return exc if isinstance(exc, BackendError) else None


class Publisher:
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
        self._on_terminal = on_terminal  # the daemon frees the generation's slot and copies
        self._on_ended = on_ended  # the scheduler cancels its copies and uploads
        # This node's create made the manifest: the daemon runs the job's retention (one node
        # per commit, not every node of the job).
        self._on_published = on_published
        self._on_vanished = on_vanished  # the local copy holds a queue slot again
        self.destination = config.destination.scheme
        self._poll_now = asyncio.Event()
        # Work that outlives its caller (a failure record, aborting uploads), queued here and
        # started by run() inside its TaskGroup: callers are outside that scope.
        self._work: asyncio.Queue[tuple[str, Work]] = asyncio.Queue()
        # This node's part record of each generation, written by the advance and rewritten
        # by a failure: one at a time per generation (the failure's, written last, stands).
        self._part_locks = KeyedLocks()
        self._failures = FailureRecords(config=config, ledger=ledger, committer=committer,
                                        locks=self._part_locks, retrying=self._with_retries)
        # Ranks with no part record of this attempt at the last look, said for the
        # commit_wait_s message (describe_missing: records of other attempts included).
        self._missing: dict[GenKey, str] = {}
        # Why a generation could not commit at its last poll: its part records unreadable, or
        # shards of other nodes missing at the destination (its expiry names that, not a
        # manifest that never appeared).
        self._why_waiting: dict[GenKey, str] = {}
        # An unreachable destination fails every poll alike: one line per cause a minute.
        self._error_log = OncePerCause(60.0)
        self._user_log = per_user()

    def poke(self) -> None:
        """Poll the generations waiting on other nodes now, not at the next interval."""
        self._poll_now.set()

    def submit(self, name: str, work: Work) -> None:
        """Run ``work`` in the publisher's TaskGroup, failure boundary included."""
        self._work.put_nowait((name, work))

    async def run(self) -> None:
        for gen in self._failures.unsent():
            self.submit(f"failure-record {gen.job} {gen.step}",
                        functools.partial(self._failures.write, gen, unless_present=True))
        # As many at once as the destination is allowed requests; the rest wait their turn.
        slots = asyncio.Semaphore(max(1, self.config.destination.max_concurrency))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._poller(), name="commit-poller")
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

    # -- the failure boundary -----------------------------------------------------------------
    async def _guarded(self, gen: GenerationRecord, what: str,
                       work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except ManifestError as exc:  # the records at the destination cannot be trusted
            await self.end_safely(gen, f"{what} failed: {exc}", kind="conflict")
        except Exception as exc:
            refused = destination_error(exc)
            if refused is not None:  # expected: the destination refused; say what and why
                await self.end_safely(gen, f"{what} failed: {refused}", kind="drain")
                return
            log_event(log, logging.ERROR, "commit_crashed", job=gen.job, step=gen.step,
                      during=what, exc_info=True)
            self.metrics.internal_error("commit")
            await self.end_safely(gen, f"{what} failed unexpectedly ({type(exc).__name__}: "
                                       f"{exc}); the daemon log has the traceback", kind="internal")

    async def end_safely(self, gen: GenerationRecord, reason: str, *, kind: str,
                         event: GenerationEvent = GenerationEvent.FAILED) -> None:
        """:meth:`end` for failure boundaries: whatever happens, nothing propagates."""
        try:
            await self.end(gen, reason, kind=kind, event=event)
        except Exception:
            log_event(log, logging.ERROR, "generation_end_failed", job=gen.job, step=gen.step,
                      reason=reason, exc_info=True)

    async def end(self, gen: GenerationRecord, reason: str, *, kind: str,
                  event: GenerationEvent = GenerationEvent.FAILED, told: str = "") -> None:
        """End a generation that cannot commit from this node (FAILED), or that a newer one
        of the same job replaced (CANCELLED): its slot is freed, its copies in flight are
        cancelled, and (FAILED) the other nodes are told through this node's part record.
        ``event`` names why (the lifecycle table decides the state it leads to).

        The one place a generation ends, so the one place that keeps the rule that no node
        may commit a multi-node step whose ranks on some node were told it failed: a step
        that other nodes may still publish from this node's record (_publishable_elsewhere)
        gets its failure record (saying ``told``, else ``reason``) before its ranks hear of
        the end, and ends committed instead where the manifest holds this node's part
        (_end_recorded). Called with the generation's commit point held or not."""
        if gen.terminal:
            return
        if self._publishable_elsewhere(gen, event):
            await self._end_recorded(gen, reason, kind=kind, event=event, told=told or reason)
        else:
            await self._end(gen, reason, kind=kind, event=event)

    @staticmethod
    def _publishable_elsewhere(gen: GenerationRecord, event: GenerationEvent) -> bool:
        """Whether ending ``gen`` by ``event`` tells ranks it failed that another node may
        still commit from this node's part record: it leads to FAILED, every rank begun here
        is recorded (the record says so, and nothing of this node's says otherwise), and ranks
        begin on other nodes. Found attacking multi-node commits: a node whose commit wait ran
        out, or whose own create was refused, left its record saying "recorded", and a node
        that looked later published the step. Not on another node's failure record
        (PEER_ABORTED): that record ends it on every node already."""
        return (event is not GenerationEvent.PEER_ABORTED
                and TRANSITIONS.get((gen.state, event)) is _G.FAILED
                and 0 < len(gen.ranks) < gen.world_size
                and all(st is RankState.RECORDED for st in gen.ranks.values()))

    async def _end_recorded(self, gen: GenerationRecord, reason: str, *, kind: str,
                            event: GenerationEvent, told: str) -> None:
        """:meth:`end` of a generation another node may still publish: this node's part
        record is rewritten with its ranks aborted first (FailureRecords.write_told), so a
        node that reads it later ends the step as aborted.

        The manifest decides a race with a node publishing meanwhile: looked for before the
        failure record (there: committed here, the record left as it is) and after it (there:
        committed here, and the record written back as recorded, so nodes still waiting do
        not end a committed step). One window stays open: a node that read the records just
        before the failure record landed and creates the manifest after this second look
        commits a step this node's ranks heard had failed. It is as wide as that node's
        publish (its shard checks and create); for an expiry, only a node whose own wait ran
        out within that much of this one's meets it, and a commit_wait_s longer than the
        nodes' lag keeps it shut. The looks and the end hold the commit point, as a publish
        does (an abort never lands between them); the record's writes and their retries do
        not, unless the caller holds it (an abort waits for nothing longer: partrecords.py)."""
        async with gen.commit_point.here():
            if gen.terminal:
                return
            if not self._publishable_elsewhere(gen, event):
                # Changed while the commit point was awaited: a rank began here, which no
                # node can cover from this node's record (an expiry does not apply then:
                # the step goes on).
                if TRANSITIONS.get((gen.state, event)) is not None:
                    await self._end(gen, reason, kind=kind, event=event)
                return
            if await self._found_committed(gen):
                return
        written = await self._failures.write_told(gen, told)
        ended = False
        async with gen.commit_point.here():
            # The event may no longer apply: a rank began here (REOPENED; an expiry does not
            # apply then, and the step goes on), or an abort ended it (its own failure record
            # follows this one).
            if (not gen.terminal and TRANSITIONS.get((gen.state, event)) is not None
                    and not (written and await self._found_committed(gen))):
                await self._end(gen, reason, kind=kind, event=event, told=not written)
                ended = True
        if written and not ended:
            await self._failures.write_recorded(gen)  # not over an abort's record

    async def _end(self, gen: GenerationRecord, reason: str, *, kind: str,
                   event: GenerationEvent, told: bool = False) -> None:
        """:meth:`end`, the move itself. ``told``: the failure record that _end_recorded
        should have written before it is not there (written after the end, then)."""
        try:
            await self.ledger.apply(gen, event, error=reason)
        finally:
            # The state changed in memory before the journal write: free what it held even if
            # that write failed.
            if gen.terminal:
                self._forget_waiting(gen.key)
                self.metrics.generation_failed(gen.job, kind)
                self._on_terminal(gen)
                self._on_ended(gen)
                state = gen.state
                if state is _G.FAILED:
                    self.submit(f"failure-record {gen.job} {gen.step}",
                                lambda: self._failures.write(gen, every_rank=told))
                if kind in FAILURE_REASONS_USER:
                    # The job's own doing (it aborted, or a new attempt replaced it): a
                    # warning, and per owner bounded (a user beginning and aborting jobs in a
                    # loop wrote about 330 lines a second, 1000-character reasons included).
                    owner = self.ledger.jobs.get(gen.job)
                    self._user_log.log_event(log, logging.WARNING, f"generation_{state}",
                                             cause=f"uid {owner}", job=gen.job, step=gen.step,
                                             reason=reason)
                else:
                    log_event(log, logging.ERROR if state is _G.FAILED else logging.WARNING,
                              f"generation_{state}", job=gen.job, step=gen.step, reason=reason)
        # Memory hand-offs of an ended generation never reach local storage (their copy stops
        # at the end, and the memfd goes with it): lost, so discarded here, the one place a
        # generation ends, as recovery does after a restart. Left held, they showed as
        # `held: N` in status and counted as the job's oldest undrained shard until the job
        # committed a newer step, paging about bytes no drain would ever move (found
        # truncating a memfd after its acknowledgement).
        lost: list[tuple[ShardRecord, dict[str, Any]]] = [
            (s, {}) for s in gen.shards.values() if s.state is ShardState.HELD]
        if lost:
            await self.ledger.apply_shards(lost, ShardEvent.DISCARDED)

    # -- advance: part record, coverage, publish ----------------------------------------------
    async def advance(self, gen: GenerationRecord) -> None:
        """Write this node's part record once every rank begun here has drained, then publish
        the manifest if every node's records cover every rank. Never raises (but cancellation)."""
        async with gen.lock:
            await self._guarded(gen, "committing", self._advance(gen))

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
            await self._settle(gen)

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

    async def _settle(self, gen: GenerationRecord) -> None:
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
                if not gen.terminal and not await self._found_committed(gen):
                    await self.end(gen, aborted, kind="aborted",
                                   event=GenerationEvent.PEER_ABORTED)
            return
        missing = missing_ranks(parts, gen.world_size)
        if missing:
            self._missing[gen.key] = describe_missing(missing, others)
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
            self._why_waiting.pop(gen.key, None)
        except Exception as caught:
            if isinstance(caught, TimeoutError) and reading.expired():
                why = (f"reading the part records at the destination took more than {bound:g} "
                       "s (a listing without end?)")
                self._why_waiting[gen.key] = why
                self._error_log.log_event(
                    log, logging.WARNING, "commit_poll_error", cause="parts:timeout",
                    job=gen.job, step=gen.step, error=f"{why}; asked again at the next poll")
                return None
            exc = destination_error(caught)
            if exc is None or not exc.transient:
                raise (exc or caught) from None
            self.metrics.drain_error(self.destination, exc.kind)
            self._error_log.log_event(log, logging.WARNING, "commit_poll_error",
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
                self._error_log.log_event(
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

    async def _try_publish(self, gen: GenerationRecord) -> None:
        try:
            if await self.ended_if_foreign(gen, again=True):
                return
        except BackendError as exc:
            await self.end(gen, f"commit failed: {exc}", kind="drain")
            return
        if await self._retention_would_take(gen):
            return
        # The commit point, from the manifest's create to the COMMITTED it leads to: an abort
        # (Daemon.give_up) waits for it, or it for the abort.
        async with gen.commit_point:
            if gen.terminal:
                return
            failure = await self._publish(gen)
        if failure is not None:
            # After the commit point: the end writes the failure record first, and an abort
            # waits for none of its retries (end).
            await self.end(gen, failure[0], kind=failure[1])

    async def _retention_would_take(self, gen: GenerationRecord) -> bool:
        """End ``gen`` rather than publish it when ``retention.keep_last`` newer steps of its
        job committed since it began (latest.overtaken; found attacking: newer steps committed
        while it was saved, and the begin's check had passed). A destination that cannot say
        in time lets the commit go ahead, as before."""
        keep = self.config.retention.keep_last
        if gen.state is not _G.RECORDED:
            return False  # (the one state a newer commit may end)
        try:
            async with asyncio.timeout(PART_READ_MIN_S * 5):
                above = await overtaken(self.committer.backend, gen.job, gen.step, keep=keep)
        except (BackendError, ManifestError, OSError, TimeoutError) as exc:
            self._error_log.log_event(log, logging.WARNING, "rollback_check_failed",
                                      cause=f"retention:{gen.job}", job=gen.job, step=gen.step,
                                      error=str(exc) or type(exc).__name__)
            return False
        if not above:
            return False
        if await self._committed_elsewhere(gen):
            # Another node's create committed it with this node's part, and newer steps since
            # (found attacking: a node restarted after that cancelled the committed step).
            return True
        await self.end(gen, f"steps {', '.join(map(str, above))} of this job committed while "
                            f"it was saved: retention.keep_last = {keep} would remove it as soon "
                            "as it committed, and a restart resumes from the newest step anyway",
                       kind="superseded", event=GenerationEvent.SUPERSEDED_BY_COMMIT)
        return True

    async def _publish(self, gen: GenerationRecord) -> tuple[str, str] | None:
        """The create, at the commit point; what fails the generation, as (reason, kind), is
        returned for the caller to end it by (after the commit point)."""
        try:
            result = await self._with_retries(lambda: self.committer.try_publish(
                gen.job, gen.step, gen.world_size, gen.attempt), gen)
        except BackendError as exc:
            return f"commit failed: {exc}", "drain"
        except RecordTooLarge as exc:
            return str(exc), "aborted"
        if result.committed:
            self.committer.owners.remember(gen.job, self.ledger.jobs.get(gen.job))
        if result.outcome is CommitOutcome.PUBLISHED:
            # This node's create made the manifest: retention runs here, also when the
            # generation ended here meanwhile (cancelled, expired).
            self._on_published(gen)
        if gen.terminal:
            return None
        if result.committed:
            await self._committed(gen, result.manifest, result.outcome.name.lower())
        elif result.outcome is CommitOutcome.CONFLICT:
            return f"it cannot commit: {result.reason}", "conflict"
        elif result.absent:
            return await self._absent(gen, result)
        return None

    async def _committed(self, gen: GenerationRecord, manifest: Manifest | None,
                         outcome: str) -> None:
        """``gen`` is committed at the destination (``manifest``; None when retention has
        removed it since): journal it, and end the older steps still waiting here."""
        committed_at = manifest.clocks.get("committed", time.time()) if manifest else time.time()
        # Journalled as this node saw it, on its own clock: what the last-commit gauge is
        # set from again after a restart (the manifest's clock is the publisher's, hours
        # off on a node whose clock is: found attacking). The phases keep the manifest's.
        await self.ledger.apply(gen, GenerationEvent.COMMITTED, committed_at=time.time())
        self._forget_waiting(gen.key)
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
                  outcome=outcome, shards=len(gen.shards),
                  bytes=sum(s.size for s in gen.shards.values()))
        await self._end_older(gen.job, gen.step)

    async def _absent(self, gen: GenerationRecord,
                      result: CommitResult) -> tuple[str, str] | None:
        """Shards the part records list are missing at the destination: deleted behind the
        daemon's back after they drained (an operator freeing room, a cleanup script). This
        node's own end the generation now (returned, as _publish's failures are), each failed
        so that `ckptdrain retry` drains its kept copy again; waiting could only end at
        drain.commit_wait_s, saying the manifest never appeared (found attacking: an hour's
        silent wait, and a retry that re-sent only the shards that had failed before).
        Other nodes' are theirs to see: the reason is kept for this generation's expiry."""
        node = self.config.node_id
        mine = [gen.shards[s.path] for s in result.absent
                if s.node == node and s.path in gen.shards]
        if not mine:
            self._why_waiting[gen.key] = result.reason
            return None
        for shard in mine:
            if shard.state is ShardState.DRAINED:
                await self.ledger.apply(shard, ShardEvent.VANISHED,
                                        error="missing at the destination after it drained")
                self._on_vanished(shard)
        names = ", ".join(repr(s.path) for s in mine[:5]) + (" ..." if len(mine) > 5 else "")
        lost = [s for s in mine if not s.local_copy]
        then = ("their local copies are gone too: save a new step" if lost else
                f"`ckptdrain retry {gen.job} {gen.step}` drains them again from this node's "
                "local copies")
        return (f"{len(mine)} shard(s) drained from this node ({names}) are missing at the "
                f"destination: something deleted them before the commit; {then}", "drain")

    async def _end_older(self, job: str, step: int) -> None:
        """Step ``step`` of ``job`` committed: older steps still waiting here can never be the
        latest, so waiting on for them only holds their slots."""
        for other in list(self.ledger.generations.values()):
            # A locked one is mid-commit; the poller sees the newer manifest next round.
            if (other.job == job and other.step < step and other.state is _G.RECORDED
                    and not other.lock.locked()):
                async with other.lock:  # _superseded reads the destination first
                    if other.state is _G.RECORDED:
                        await self._superseded(other, step)

    async def _superseded(self, gen: GenerationRecord, newer: int) -> None:
        """Cancel ``gen``, step ``newer`` of its job having committed: unless ``gen`` itself
        committed first, from another node's create (found attacking: a node that recorded
        its part and looked again only after the next step committed cancelled a step that
        had committed, and its waiters heard it failed). Called with ``gen.lock`` held."""
        if await self._committed_elsewhere(gen):
            return
        await self.end(gen, f"step {newer} of this job committed first, so this older step can "
                            "never become the latest", kind="superseded",
                       event=GenerationEvent.SUPERSEDED_BY_COMMIT)

    async def _committed_elsewhere(self, gen: GenerationRecord) -> bool:
        """Whether ``gen`` is settled by what its step holds at the destination: COMMITTED
        here when another node's create committed it with this node's part (then True), or
        left as it is when the destination cannot say now (True: the poller asks again).
        Asked before ending a step as superseded, whichever way a newer commit is seen."""
        here, manifest = await self._look(gen)
        if here is None:
            return True
        if here and not gen.terminal:
            await self._committed(gen, manifest, "accepted")
        return here

    async def committed_here(self, gen: GenerationRecord) -> bool | None:
        """Whether ``gen``'s step is committed at the destination with this node's part as it
        recorded it (assembly.holds_part; retention's tombstone of it: assembly.held_part);
        None when the destination cannot say now."""
        return (await self._look(gen))[0]

    async def _look(self, gen: GenerationRecord, *, newer: bool = True
                    ) -> tuple[bool | None, Manifest | None]:
        """:meth:`committed_here`, and the manifest that says so (None when a tombstone does).
        ``newer``: asked because a newer step committed (what an unreadable manifest makes
        the generation wait for, said at its expiry)."""
        try:
            manifest, removed = await self.committer.committed_or_removed(gen.job, gen.step)
        except BackendError as exc:
            self.metrics.drain_error(self.destination, exc.kind)
            self._error_log.log_event(log, logging.WARNING, "commit_poll_error",
                                      cause=f"own:{exc.kind}", job=gen.job, step=gen.step,
                                      error=str(exc))
            if newer:
                self._why_waiting[gen.key] = (f"a newer step committed, and this step's "
                                              f"MANIFEST.json could not be read: {exc}")
            return None, None
        except ManifestError:
            return False, None  # damaged: no commit of this step's
        node = self.config.node_id
        ranks = {r for r, st in gen.ranks.items() if st is RankState.RECORDED}
        if manifest is not None:
            mine = {(s.path, s.size, s.checksum, s.rank) for s in gen.shards.values()
                    if s.rank in ranks}
            return holds_part(manifest, node, gen.world_size, mine), manifest
        return (removed is not None
                and held_part(removed, gen.job, gen.step, node, gen.world_size)), None

    # -- waiting on other nodes ---------------------------------------------------------------
    async def _poller(self) -> None:
        """Generations whose part record is written wait for the other nodes' records."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.drain.commit_poll_interval_s):
                    await self._poll_now.wait()
            self._poll_now.clear()
            waiting = [g for g in self.ledger.generations.values() if g.state is _G.RECORDED]
            if not waiting:
                continue
            newest = await self._newest_commits(waiting)
            # Several at once: one after another, a slow destination read of each (up to
            # PART_READ_MAX_S) pushed every later generation's expiry back by as much (found
            # attacking: four waiting generations ended 6, 12, 18 and 24 s late).
            await for_each_bounded(waiting, functools.partial(self._poll_locked, newest),
                                   POLLS_AT_ONCE)

    def _forget_waiting(self, key: GenKey) -> None:
        """What the polls learned about a generation that has ended or committed."""
        self._missing.pop(key, None)
        self._why_waiting.pop(key, None)

    async def _poll_locked(self, newest: dict[str, int], gen: GenerationRecord) -> None:
        # Locked: an advance is at work on it right now, and will settle it itself.
        if gen.state is _G.RECORDED and not gen.lock.locked():
            async with gen.lock:
                await self._guarded(gen, "waiting for the commit",
                                    self._poll(gen, newest.get(gen.job)))

    async def _poll(self, gen: GenerationRecord, newest: int | None) -> None:
        if gen.state is not _G.RECORDED:
            return
        if newest is not None and newest > gen.step:
            # Still RECORDED after it when the destination could not say whether this step
            # committed: drain.commit_wait_s below ends it all the same (found attacking: a
            # manifest key that never read held the generation, and its slot, for good).
            await self._superseded(gen, newest)
        else:
            await self._settle(gen)
        wait_s = self.config.drain.commit_wait_s
        since = gen.created_mono if gen.drained_mono is None else gen.drained_mono
        if gen.state is _G.RECORDED and time.monotonic() - since >= wait_s:
            why = (self._missing.get(gen.key)
                   or self._why_waiting.get(gen.key, "the manifest never appeared"))
            await self._expire(gen, wait_s, why)

    async def _expire(self, gen: GenerationRecord, wait_s: float, why: str) -> None:
        """End ``gen`` at drain.commit_wait_s, on every node: its ranks are told the step
        failed, so no other node may commit it afterwards (end writes this node's failure
        record first, and ends it committed where the manifest turns out to be there)."""
        await self.end(
            gen, f"not committed within drain.commit_wait_s = {wait_s:g} s of this node "
                 f"recording its part: {why}", kind="timeout", event=GenerationEvent.EXPIRED,
            told=f"the step expired on node {self.config.node_id!r} after drain.commit_wait_s "
                 f"= {wait_s:g} s without a commit ({why}); its ranks were told it failed")

    async def _found_committed(self, gen: GenerationRecord) -> bool:
        """Whether ``gen``'s step is committed at the destination with this node's part
        (committed_here), and if so, COMMITTED here. False when the destination cannot say."""
        here, manifest = await self._look(gen, newer=False)
        if not here:
            return False
        if not gen.terminal:
            await self._committed(gen, manifest, "accepted")
        return True

    async def _newest_commits(self, waiting: list[GenerationRecord]) -> dict[str, int]:
        """Per job, a committed step newer than one of ``waiting``, from the LATEST hint and
        confirmed by its manifest. A lagging or unreadable hint only means waiting longer."""
        oldest: dict[str, int] = {}
        for gen in waiting:
            oldest[gen.job] = min(oldest.get(gen.job, gen.step), gen.step)
        found: dict[str, int] = {}
        for job, step in oldest.items():
            try:
                hint = parse_latest(await self.committer.backend.get_bytes(
                    latest_key(job), max_bytes=64))
                if (hint is not None and hint > step
                        and await self.committer.committed(job, hint) is not None):
                    found[job] = hint
            except (BackendError, ManifestError) as exc:
                self._error_log.log_event(log, logging.WARNING, "commit_poll_error",
                                          cause=f"latest:{job}", job=job, error=str(exc))
            except Exception:  # one job's hint must not stop the polling of every job
                log_event(log, logging.ERROR, "commit_poll_crashed", job=job, exc_info=True)
                self.metrics.internal_error("commit")
        return found
