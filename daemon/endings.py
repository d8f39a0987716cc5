"""How a generation ends on this node: committed, failed or cancelled, and the failure boundary
around every commit step.

:meth:`Endings.end` is the one place a generation ends (FAILED or CANCELLED): its slot is freed,
its copies in flight are cancelled, and (FAILED) the other nodes are told through this node's
part record. It keeps the rule that no node may commit a multi-node step whose ranks on some
node were told it failed: a step other nodes may still publish from this node's record gets its
failure record first, and ends committed instead where the manifest holds this node's part.
:meth:`Endings.committed` journals a commit, however it was seen, and ends the older steps still
waiting; the looks at the destination (is this step committed with this node's part?) decide
both. Around every step, :meth:`Endings.guarded`: a destination error fails that generation
with its message, anything else is logged once with its traceback and fails that generation;
nothing reaches the TaskGroup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ckptdrain.client.manifest import Manifest, ManifestError
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord
from ckptdrain.daemon.logs import log_event, per_user
from ckptdrain.daemon.metrics import FAILURE_REASONS_USER
from ckptdrain.daemon.partrecords import holds_my_part
from ckptdrain.daemon.state import (
    TRANSITIONS,
    UNDRAINED_SHARD,
    GenerationEvent,
    GenerationState,
    RankState,
    ShardEvent,
    ShardState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.publisher import Publisher

log = logging.getLogger("ckptdrain.publisher")

_G = GenerationState

# How long an abort (record_abort_first) gives this node's failure record before it answers.
ABORT_RECORD_WITHIN_S = 10.0


def destination_error(exc: BaseException) -> BackendError | None:
    """The destination error ``exc`` is, if that is all it is (to retry or report, not a bug)."""
    return exc if isinstance(exc, BackendError) else None


class Endings:
    """The ends of the publisher's generations (``publisher``: its ledger, committer, failure
    records and waits)."""

    def __init__(self, publisher: Publisher, *,
                 on_terminal: Callable[[GenerationRecord], None],
                 on_ended: Callable[[GenerationRecord], None]) -> None:
        self.p = publisher
        self.ledger = publisher.ledger
        self.committer = publisher.committer
        self.metrics = publisher.metrics
        self._on_terminal = on_terminal  # the daemon frees the generation's slot and copies
        self._on_ended = on_ended  # the scheduler cancels its copies and uploads
        self._user_log = per_user()

    @property
    def config(self) -> Config:
        return self.p.config  # a reload replaces the publisher's

    async def guarded(self, gen: GenerationRecord, what: str,
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
                  event: GenerationEvent = GenerationEvent.FAILED, told: str = "",
                  record_first: bool = True) -> None:
        """End a generation that cannot commit from this node (FAILED), or that a newer one
        of the same job replaced (CANCELLED): its slot is freed, its copies in flight are
        cancelled, and (FAILED) the other nodes are told through this node's part record.
        ``event`` names why (the lifecycle table decides the state it leads to).

        The one place a generation ends, so the one place that keeps the rule that no node
        may commit a multi-node step whose ranks on some node were told it failed: a step
        that other nodes may still publish from this node's record (_publishable_elsewhere)
        gets its failure record (saying ``told``, else ``reason``) before its ranks hear of
        the end, and ends committed instead where the manifest holds this node's part
        (_end_recorded). Called with the generation's commit point held or not.

        ``record_first=False`` (recovery, before the daemon serves): no destination I/O
        before the end, whose looks and record writes retry for up to drain.retry_budget_s
        and held the start that long on a destination that did not answer; the failure
        record, every rank aborted, is queued after the end instead (found reviewing)."""
        if gen.terminal:
            return
        if self._publishable_elsewhere(gen, event):
            if record_first:
                await self._end_recorded(gen, reason, kind=kind, event=event,
                                         told=told or reason)
            else:
                await self._end(gen, reason, kind=kind, event=event, every_rank=True)
        else:
            await self._end(gen, reason, kind=kind, event=event)

    async def record_abort_first(self, gen: GenerationRecord, reason: str) -> bool:
        """Before an abort (Generations.give_up, its commit point held) aborts the ranks of ``gen``
        and its waiters hear it failed: where other nodes may still publish the step from
        this node's record (every rank recorded), that record is rewritten with them aborted
        first, as :meth:`end` does for its own ends. Found reviewing multi-node commits: the
        abort aborted the ranks first, which took it off end's record-first path, answered,
        and queued the failure record; a node that sealed meanwhile published the step from
        the record that still said "recorded". False when the step is committed with this
        node's part (looked for before and after the write, as :meth:`_end_recorded` does):
        COMMITTED here, nothing to abort.

        Within ABORT_RECORD_WITHIN_S: the write's retries run for drain.retry_budget_s (300 s
        by default), which `ckptdrain abort` (30 s) would not wait out on a destination that
        refuses writes. Past it, or where the record could not be written, the abort goes
        ahead as before (logged; FailureRecords.owed tries again after the end)."""
        if gen.terminal or not self._recorded_or_being(gen):
            return True
        here: bool | None = False
        manifest: Manifest | None = None
        written = False
        try:
            async with asyncio.timeout(ABORT_RECORD_WITHIN_S):
                here, manifest = await self._look(gen, newer=False)
                if not here:
                    written = await self.p.failures.write_told(gen, reason, sealed=True)
                    if written:
                        here, manifest = await self._look(gen, newer=False)
        except TimeoutError:
            log_event(log, logging.WARNING, "failure_record_failed", job=gen.job, step=gen.step,
                      error=f"not written within {ABORT_RECORD_WITHIN_S:g} s of the abort",
                      action="written after the abort; a node that looks before it lands may "
                             "still commit the step from this node's earlier record")
            return True
        if not here:
            return True
        if not gen.terminal:
            await self.committed(gen, manifest, "accepted")
        if written:
            await self.p.failures.write_recorded(gen)
        return False

    @staticmethod
    def _recorded_or_being(gen: GenerationRecord) -> bool:
        """:meth:`_publishable_elsewhere` for an abort, which also meets a record on its way:
        every rank begun here is recorded, or sealed with its shards settled, whose record
        the advance writes (or has written: a rank is RECORDED only once the write is in),
        and ranks begin on other nodes. Found attacking the record-first abort: an abort
        while the advance wrote the record took the plain path (a rank still SEALED), answered,
        and the record saying "recorded" landed before the failure record; a node sealing
        meanwhile published the step from it."""
        return (TRANSITIONS.get((gen.state, GenerationEvent.FAILED)) is _G.FAILED
                and 0 < len(gen.ranks) < gen.world_size
                and all(st is RankState.RECORDED
                        or (st is RankState.SEALED and gen.rank_drained(r))
                        for r, st in gen.ranks.items()))

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
        failure record (there: committed here, the record left as it is) and after it, written
        or not (there: committed here, and the record written back as recorded, so nodes still
        waiting do not end a committed step; not written, its tries retried for up to
        drain.retry_budget_s while a node could commit: found attacking). One window stays open: a node that read the records just
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
            if await self.found_committed(gen):
                return
        written = await self.p.failures.write_told(gen, told)
        ended = False
        async with gen.commit_point.here():
            # The event may no longer apply: a rank began here (REOPENED; an expiry does not
            # apply then, and the step goes on), or an abort ended it (its own failure record
            # follows this one).
            if (not gen.terminal and TRANSITIONS.get((gen.state, event)) is not None
                    and not await self.found_committed(gen)):
                await self._end(gen, reason, kind=kind, event=event, every_rank=not written)
                ended = True
        if written and not ended:
            await self.p.failures.write_recorded(gen)  # not over an abort's record

    async def _end(self, gen: GenerationRecord, reason: str, *, kind: str,
                   event: GenerationEvent, every_rank: bool = False) -> None:
        """:meth:`end`, the move itself. ``every_rank``: the failure record, every rank of
        this node's aborted, is not at the destination yet (not written before the end, as
        _end_recorded writes it): the one queued after the end writes it so."""
        try:
            await self.ledger.apply(gen, event, error=reason)
        finally:
            # The state changed in memory before the journal write: free what it held even if
            # that write failed.
            if gen.terminal:
                self.p.waits.forget(gen.key)
                self.metrics.generation_failed(gen.job, kind)
                self._on_terminal(gen)
                self._on_ended(gen)
                state = gen.state
                if state is _G.FAILED:
                    self.p.submit(f"failure-record {gen.job} {gen.step}",
                                  lambda: self.p.failures.owed(gen, self.committed_after_all,
                                                               every_rank=every_rank))
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
        # And every shard not drained of a generation that can never be retried (cancelled, a
        # rank aborted, a shard lost before local storage): left "staged" or "failed" in the
        # journal (a step cancelled because a newer one committed kept its deferred .metadata
        # staged), they counted as undrained across restarts (found attacking what operators
        # see). A failed generation a retry can save keeps its shards as they are.
        given_up = gen.terminal and (gen.state is _G.CANCELLED or bool(gen.why_not_retryable()))
        lost: list[tuple[ShardRecord, dict[str, Any]]] = [
            (s, {}) for s in gen.shards.values()
            if s.state is ShardState.HELD or (given_up and s.state in UNDRAINED_SHARD)]
        if lost:
            await self.ledger.apply_shards(lost, ShardEvent.DISCARDED)

    async def committed(self, gen: GenerationRecord, manifest: Manifest | None,
                        outcome: str) -> None:
        """``gen`` is committed at the destination (``manifest``; None when retention has
        removed it since): journal it, and end the older steps still waiting here."""
        committed_at = manifest.clocks.get("committed", time.time()) if manifest else time.time()
        # Journalled as this node saw it, on its own clock: what the last-commit gauge is
        # set from again after a restart (the manifest's clock is the publisher's, hours
        # off on a node whose clock is: found attacking). The phases keep the manifest's.
        # A failed one (committed_after_all) no longer says why it failed: it did not.
        cleared = {"error": ""} if gen.state is _G.FAILED else {}
        await self.ledger.apply(gen, GenerationEvent.COMMITTED, committed_at=time.time(),
                                **cleared)
        self.p.waits.forget(gen.key)
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

    async def _end_older(self, job: str, step: int) -> None:
        """Step ``step`` of ``job`` committed: older steps still waiting here can never be the
        latest, so waiting on for them only holds their slots."""
        for other in list(self.ledger.generations.values()):
            # A locked one is mid-commit; the poller sees the newer manifest next round.
            if (other.job == job and other.step < step and other.state is _G.RECORDED
                    and not other.lock.locked()):
                async with other.lock:  # superseded reads the destination first
                    if other.state is _G.RECORDED:
                        await self.superseded(other, step)

    async def superseded(self, gen: GenerationRecord, newer: int) -> None:
        """Cancel ``gen``, step ``newer`` of its job having committed: unless ``gen`` itself
        committed first, from another node's create (found attacking: a node that recorded
        its part and looked again only after the next step committed cancelled a step that
        had committed, and its waiters heard it failed). Called with ``gen.lock`` held."""
        if await self.committed_elsewhere(gen):
            return
        await self.end(gen, f"step {newer} of this job committed first, so this older step can "
                            "never become the latest", kind="overtaken",
                       event=GenerationEvent.SUPERSEDED_BY_COMMIT)

    async def committed_elsewhere(self, gen: GenerationRecord) -> bool:
        """Whether ``gen`` is settled by what its step holds at the destination: COMMITTED
        here when another node's create committed it with this node's part (then True), or
        left as it is when the destination cannot say now (True: the poller asks again).
        Asked before ending a step as superseded, whichever way a newer commit is seen."""
        here, manifest = await self._look(gen)
        if here is None:
            return True
        if here and not gen.terminal:
            await self.committed(gen, manifest, "accepted")
        return here

    async def committed_here(self, gen: GenerationRecord) -> bool | None:
        """Whether ``gen``'s step is committed at the destination with this node's part as it
        recorded it (assembly.holds_part; retention's tombstone of it: assembly.held_part);
        None when the destination cannot say now."""
        return (await self._look(gen))[0]

    async def committed_with_part(self, gen: GenerationRecord
                                  ) -> tuple[bool | None, Manifest | None]:
        """:meth:`committed_here`, asked for a waiter (nothing logged as waiting on it), and
        the manifest that says so (None when a tombstone does)."""
        return await self._look(gen, newer=False)

    async def _look(self, gen: GenerationRecord, *, newer: bool = True
                    ) -> tuple[bool | None, Manifest | None]:
        """:meth:`committed_here`, and the manifest that says so (None when a tombstone does).
        ``newer``: asked because a newer step committed (what an unreadable manifest makes
        the generation wait for, said at its expiry)."""
        try:
            manifest, removed = await self.committer.committed_or_removed(gen.job, gen.step)
        except BackendError as exc:
            self.metrics.drain_error(self.p.destination, exc.kind)
            self.p.error_log.log_event(log, logging.WARNING, "commit_poll_error",
                                       cause=f"own:{exc.kind}", job=gen.job, step=gen.step,
                                       error=str(exc))
            if newer:
                self.p.waits.why_waiting[gen.key] = (f"a newer step committed, and this step's "
                                                     f"MANIFEST.json could not be read: {exc}")
            return None, None
        except ManifestError:
            return False, None  # damaged: no commit of this step's
        return holds_my_part(self.config.node_id, gen, manifest, removed), manifest

    async def committed_after_all(self, gen: GenerationRecord, manifest: Manifest | None) -> None:
        """A FAILED ``gen`` whose failure record was owed (FailureRecords.owed) is committed at
        the destination with this node's part as recorded: another node read its record
        before the failure record landed, and a committed step is final. COMMITTED here too
        where every rank begun here is recorded (an expiry, its own create refused), so
        `wait` and `status` say what the destination does; one whose ranks an abort aborted
        stays as the abort left it."""
        if (gen.state is _G.FAILED and self.ledger.get(gen.job, gen.step) is gen
                and all(st is RankState.RECORDED for st in gen.ranks.values())):
            await self.committed(gen, manifest, "accepted")

    async def found_committed(self, gen: GenerationRecord) -> bool:
        """Whether ``gen``'s step is committed at the destination with this node's part
        (committed_here), and if so, COMMITTED here. False when the destination cannot say."""
        here, manifest = await self._look(gen, newer=False)
        if not here:
            return False
        if not gen.terminal:
            await self.committed(gen, manifest, "accepted")
        return True
