"""A generation's turns that span rooms: opening one for a rank's ``begin`` (this node's, a new
attempt replacing an old one, or a new one with its in-flight slot), replacing, superseding
and giving one up, and what an ended generation gives back on this node.

Failing a generation is the daemon's (``Daemon.fail``, the scheduler's end); these decide
when, and what goes with it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from ckptdrain.daemon import maintenance, owners
from ckptdrain.daemon.budget import Budget, Reservation
from ckptdrain.daemon.locks import KeyedLocks
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.ledger import GenerationRecord
    from ckptdrain.daemon.server import Daemon

# The name these lines had when they were the daemon's own: log filters select on it.
log = logging.getLogger("ckptdrain.server")

# A wait run only while its client stays connected (Channel.unless_hung_up).
Connected = Callable[[Awaitable[Reservation], str], Awaitable[Reservation]]


class Generations:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self._begin_locks = KeyedLocks()

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
            gen = self.d.ledger.get(job, step)
            looked_up: tuple[int, bool] | None = None
            if gen is None or (gen.attempt != attempt
                               and gen.state is not GenerationState.COMMITTED):
                maintenance.refuse_new_generation(self.d, job, step)
                if gen is None and job not in self.d.ledger.jobs:
                    # Both ask the destination, each within its own timeout: one after the
                    # other, a destination that answered nothing held a new job's begin for
                    # both (10 s, found attacking an S3 outage).
                    looked_up = await self.d.begin_checks.new_job(job, step, uid)
                else:
                    await self.d.begin_checks.refuse_if_committed(job, step)
            if (gen is not None and gen.attempt != attempt
                    and gen.state is not GenerationState.COMMITTED):
                # A restarted job saving this step again: the new attempt replaces the old.
                owners.check_now(self.d, job, uid)
                await self.replace_generation(gen, attempt)
                gen = self.d.ledger.get(job, step)
            if gen is not None:
                owners.check_now(self.d, job, uid)
                self.d.expiry.touch(job)
                return gen
            verified, owner = True, uid
            if job not in self.d.ledger.jobs:
                owner, verified = looked_up or await self.d.begin_checks.job_owner(job, uid)
            self.d.admission.check_uid_generations(self.d.ledger.jobs.get(job, owner))
            await self.d.expiry.make_room_for(job, owner)
            waiting = self.d.admission.admit(self.d.admission.slots(job), 1, job, step)
            slot = await (waiting if connected is None else
                          connected(waiting, "its begin waited for a generation slot"))
            try:
                # Checked again with nothing awaited before the job and its generation are
                # tracked: other begins may have opened while this one waited.
                owners.check_now(self.d, job, uid)
                self.d.admission.check_uid_generations(self.d.ledger.jobs.get(job, owner))
                self.d.expiry.check_room(job, owner)
                gen = await self.d.ledger.open_generation(job, step, world_size, ack, owner,
                                                        attempt)
            except BaseException:
                slot.release()
                raise
            self.d.admission.hold_generation(gen, slot)
            if not verified and self.d.ledger.jobs.get(job) == owner:
                self.d.committer.owners.unverified.add(job)
            return gen

    def after_terminal(self, gen: GenerationRecord) -> None:
        """Free what a finished generation held on this node (its slot was freed the moment
        it ended: Ledger.ended)."""
        if gen.state is GenerationState.COMMITTED:
            self.d.copies.drop_older_committed(gen)
            job = gen.job
            self.d.supervisor.spawn(lambda: self.d.expiry.forget_older(job),
                                    what=f"forget older {job}")
            return
        job = gen.job
        self.d.supervisor.spawn(lambda: self.d.expiry.trim(job), what=f"trim ended {job}")
        if gen.state is GenerationState.CANCELLED or gen.why_not_retryable():
            # Superseded, an aborted rank or a shard lost before local storage: never
            # retried, so nothing of it is worth keeping (every byte it reserved goes back;
            # its shards' records are discarded where it ends, Endings._end).
            self.d.copies.discard_generation(gen)
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
                        self.d.copies.discard(shard)
            self.d.copies.kept_for_retry(gen)

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
        commit it from this node's part record; where every rank here is recorded, that
        record is rewritten with them aborted before they are (Endings.record_abort_first)."""
        async with gen.commit_point:
            if gen.state is GenerationState.COMMITTED:
                return False
            # First, while its ranks are still recorded: the record, then the answer. An
            # advance waiting to write the record meanwhile must not land "recorded" over it.
            gen.aborting = True
            try:
                if not await self.d.scheduler.publisher.ends.record_abort_first(gen, reason):
                    return False
                await self._abort_ranks(gen, reason, ranks)
            finally:
                gen.aborting = False
            await self._discard_shards(gen)
            self.d.copies.discard_generation(gen)
        return True

    async def _abort_ranks(self, gen: GenerationRecord, reason: str,
                           ranks: Iterable[int] | None) -> None:
        """give_up's own: ``ranks`` (default: every one begun here) aborted, and ``gen``
        failed."""
        chosen = list(gen.ranks) if ranks is None else list(ranks)
        for rank in chosen:
            if gen.ranks.get(rank) in (RankState.OPEN, RankState.SEALED, RankState.RECORDED):
                await self.d.ledger.apply((gen, rank), RankEvent.ABORTED)
        if not gen.terminal:
            await self.d.fail(gen, reason, kind="aborted", event=GenerationEvent.FAILED)

    async def _discard_shards(self, gen: GenerationRecord, *, persist: bool = True) -> None:
        """Every shard of ``gen`` not yet discarded is (it will never drain)."""
        for shard in gen.shards.values():
            if shard.state is not ShardState.DISCARDED:
                await self.d.ledger.apply(shard, ShardEvent.DISCARDED, persist=persist)

    async def replace_generation(self, gen: GenerationRecord, attempt: str) -> None:
        """A new attempt at an uncommitted step: end the old attempt on this node, drop what it
        staged, and forget it. Its part record at the destination names the old attempt, so
        no node counts it; this node rewrites it for the new attempt."""
        reason = (f"replaced by a new attempt at this step ({attempt or 'unnamed'}); "
                  f"the old attempt was {gen.attempt or 'unnamed'}")
        if not gen.terminal:
            await self.d.fail(gen, reason, kind="replaced", event=GenerationEvent.CANCELLED)
        else:
            self.d.copies.discard_generation(gen)
        # Still queued, perhaps: a worker must never take it for the new attempt's.
        await self._discard_shards(gen, persist=False)
        log_event(log, logging.INFO, "generation_replaced", job=gen.job, step=gen.step,
                  old_attempt=gen.attempt, attempt=attempt)
        # Each shard's upload still journalled is owed, not tried here (ledger.forgetting:
        # UploadAborts.leave_all): a destination answering nothing held this begin for the
        # abort's timeout per failed shard. The daemon aborts it once the destination
        # answers, forgotten generation or not.
        await self.d.ledger.forget(gen)

    async def supersede(self, job: str, step: int, budget: Budget, amount: int) -> bool:
        """on_full = "supersede": cancel this job's older uncommitted generations, oldest
        first, until ``amount`` fits ``budget``; True when it was acquired. Never touches a
        committed generation, another job's, or one that already drained everything here:
        its part record is written or on its way (a generation is RECORDED, and no victim,
        only once the write is in), another node may publish the step from it, and cancelled
        meanwhile its ranks heard "superseded" of a step committed with their part (found
        attacking the record-first abort's window)."""
        while not budget.try_acquire(amount):
            victims = sorted(
                (g for g in self.d.ledger.generations.values()
                 if g.job == job and g.step < step and g.state is GenerationState.OPEN
                 and not _drained_here(g)),
                key=lambda g: g.step,
            )
            if not victims:
                return False
            victim = victims[0]
            self.d.metrics.backpressure("superseded", budget.name)
            await self.d.fail(victim, f"superseded by step {step}: {budget.name} was full and "
                                    "on_full = \"supersede\" keeps the newest checkpoint",
                            kind="superseded", event=GenerationEvent.CANCELLED)
            await self._discard_shards(victim)
        return True


def _drained_here(gen: GenerationRecord) -> bool:
    """Whether every rank begun here on ``gen`` is sealed (or recorded) with its shards
    settled: what the advance writes the part record for."""
    return bool(gen.ranks) and all(
        st in (RankState.SEALED, RankState.RECORDED) and gen.rank_drained(r)
        for r, st in gen.ranks.items())
