"""This node's part record of a generation: what it says, and the failure record that
rewrites it.

A node writes its part record once every rank begun here has drained (the publisher's
advance): the ranks, every shard of theirs, the four clocks so far. A generation that then
fails here gets the record rewritten with the ranks it can no longer deliver marked aborted
(its *failure record*), so the other nodes end the generation at their next look rather
than after ``drain.commit_wait_s``. One whose ranks were all recorded gets it too, with every
rank of its own aborted: a node that looked later otherwise published the step from the
record that said "recorded", whatever ended it here (its commit wait, its own create
refused), and that record is written before the ranks hear of the failure
(:meth:`FailureRecords.write_told`, Endings.end). Both writes of one generation hold the
same per-generation lock, so the failure record, written last, is the one that stands. One
owed after the end, or at the next start, is never written into a step committed meanwhile
(:meth:`FailureRecords.owed`, the one way both write it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ckptdrain.client.manifest import (
    MAX_ABORT_REASON_CHARS,
    Manifest,
    ManifestError,
    PartRecord,
    ShardEntry,
    part_key,
)
from ckptdrain.daemon.assembly import describe_ranks, held_part, holds_part
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.latest import PART_ENTRY_BYTES, off_loop_if_large, parse_part
from ckptdrain.daemon.ledger import GenerationRecord, Ledger
from ckptdrain.daemon.locks import KeyedLocks
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.records import shortened
from ckptdrain.daemon.state import GenerationState, RankState

if TYPE_CHECKING:
    from ckptdrain.daemon.commit import Committer
    from ckptdrain.daemon.config import Config

log = logging.getLogger("ckptdrain.publisher")

_T = TypeVar("_T")
Retrying = Callable[[Callable[[], Awaitable[_T]]], Awaitable[_T]]
# Told that a failed generation's step is committed with this node's part (its manifest; None
# where retention's tombstone says so): Endings.committed_after_all.
OnCommitted = Callable[[GenerationRecord, Manifest | None], Awaitable[None]]


def holds_my_part(node: str, gen: GenerationRecord, manifest: Manifest | None,
                  removed: bytes | None) -> bool:
    """Whether ``manifest`` (or retention's tombstone ``removed``) holds ``node``'s part of
    ``gen`` as it recorded it."""
    ranks = {r for r, st in gen.ranks.items() if st is RankState.RECORDED}
    if manifest is not None:
        mine = {(s.path, s.size, s.checksum, s.rank) for s in gen.shards.values()
                if s.rank in ranks}
        return holds_part(manifest, node, gen.world_size, mine)
    return removed is not None and held_part(removed, gen.job, gen.step, node, gen.world_size)


class _CommittedMeanwhile(DaemonError):
    """Raised through the write's retries: the step is committed with this node's part."""

    def __init__(self, manifest: Manifest | None) -> None:
        super().__init__("committed meanwhile")
        self.manifest = manifest


async def part_record(config: Config, ledger: Ledger, gen: GenerationRecord,
                      recorded: Iterable[int], aborted: Iterable[int] = (),
                      reason: str = "") -> PartRecord:
    """This node's part record of ``gen``. What it says is read from the ledger here, on
    the loop; the record itself (every entry's names checked again, about 6 us a shard:
    55 ms for 10,000) is built in a thread when large."""
    ranks = set(recorded)
    shards = [s for s in gen.shards.values() if s.rank in ranks]
    now = time.time()
    entries = [(s.path, s.size, s.checksum, s.rank) for s in shards]
    fields: dict[str, Any] = dict(
        job=gen.job, step=gen.step, world_size=gen.world_size, node=config.node_id,
        ranks=tuple(sorted(ranks)),
        clocks={
            "handoff": gen.handoff_at or min((s.handed_at for s in shards), default=now),
            "staged": max((s.staged_at for s in shards), default=now),
            "drained": max((s.drained_at or now for s in shards), default=now),
        },
        attempt=gen.attempt,
        aborted_ranks=tuple(sorted(aborted)),
        # Cut in the middle: its end says what went wrong and what to do (found attacking:
        # cut at the end, a long path took "the destination is full ...; free space" off
        # what the other nodes said of this one).
        abort_reason=shortened(reason, MAX_ABORT_REASON_CHARS),
        owner_uid=ledger.jobs.get(gen.job),
    )
    return await off_loop_if_large(len(entries) * PART_ENTRY_BYTES, _build_part, entries,
                                   fields)


def _build_part(entries: list[tuple[str, int, str, int]], fields: dict[str, Any]) -> PartRecord:
    node = str(fields["node"])
    return PartRecord(shards=tuple(ShardEntry(path=path, size=size, checksum=checksum, rank=rank,
                                              node=node)
                                   for path, size, checksum, rank in entries), **fields)


class FailureRecords:
    """Writes the failure record of a generation that failed on this node."""

    def __init__(self, *, config: Config, ledger: Ledger, committer: Committer,
                 locks: KeyedLocks, retrying: Retrying[Any]) -> None:
        self.config = config
        self.ledger = ledger
        self.committer = committer
        self._locks = locks  # the publisher's, held while it writes the part record
        self.retrying = retrying  # retried on transient destination errors

    async def write(self, gen: GenerationRecord, *, unless_present: bool = False,
                    every_rank: bool = False, unless_committed: bool = False) -> bool:
        """Rewrite this node's part record with the ranks it can no longer deliver marked
        aborted, so the other nodes end the generation now rather than after commit_wait_s.
        ``every_rank``: all of them when all were recorded (it failed here for a reason of
        this node's, after :meth:`write_told` could not write: told it failed all the same,
        and that record let another node cover them). Without it such a generation, which
        failed at the commit itself or on another node's record, is left as it is: the other
        nodes see the same (a record of each would also fail every retry on a node whose
        peers were not retried yet). ``unless_present``: not when the destination already
        holds that record (resent at start-up). ``unless_committed``: not once the step is
        committed with this node's part, looked for before each try (:meth:`owed`; raises
        _CommittedMeanwhile). True when written."""
        async with self._locks.hold(gen.key):
            if gen.state is not GenerationState.FAILED or self.ledger.get(gen.job, gen.step) is not gen:
                return False  # retried or replaced meanwhile: the new record is the truth
            recorded = [r for r, st in gen.ranks.items() if st is RankState.RECORDED]
            failed = [r for r in gen.ranks if r not in recorded]
            if not failed and every_rank:
                recorded, failed = [], recorded
            if not failed:
                return False
            if len(gen.ranks) >= gen.world_size:
                # Every rank began here: no other node waits on this generation, and the
                # destination is spared a record per aborted generation.
                return False
            if not await self._put(gen, recorded, failed, gen.error or "failed on this node",
                                   unless_present=unless_present,
                                   unless_committed=unless_committed):
                return False
        log_event(log, logging.INFO, "failure_recorded", job=gen.job, step=gen.step,
                  aborted_ranks=describe_ranks(failed))
        return True

    async def write_told(self, gen: GenerationRecord, reason: str, *,
                         sealed: bool = False) -> bool:
        """Before its ranks hear that ``gen`` failed, while every rank of it is recorded here
        (Endings.end): rewrite this node's part record with them all marked aborted (they
        stay RECORDED in the ledger, so ``ckptdrain retry`` can bring them back). Left
        saying "recorded", the record let a node that looked later cover every rank and
        publish the step from it (found attacking multi-node commits). True when written;
        False when there was nothing to write (every rank began here, no other node waits)
        or it could not be written (logged; the step ends all the same, and
        :meth:`owed` tries again after the end). ``sealed``: sealed ranks too, whose record
        the advance may be writing (an abort, Endings.record_abort_first): this write waits
        for that one and lands over it."""
        kept = (RankState.RECORDED, RankState.SEALED) if sealed else (RankState.RECORDED,)
        async with self._locks.hold(gen.key):
            if gen.terminal or self.ledger.get(gen.job, gen.step) is not gen:
                return False
            ranks = [r for r, st in gen.ranks.items() if st in kept]
            if not ranks or len(gen.ranks) >= gen.world_size:
                return False
            if not await self._put(gen, [], ranks, reason, action=(
                    "a node that looks later may still commit the step from this node's "
                    "earlier record")):
                return False
        log_event(log, logging.INFO, "failure_recorded", job=gen.job, step=gen.step,
                  aborted_ranks=describe_ranks(ranks), before="its ranks hear of it")
        return True

    async def write_recorded(self, gen: GenerationRecord) -> None:
        """This node's part record as its advance writes it (its recorded ranks), over a
        failure record that :meth:`write_told` wrote for a step that did not end after
        all: it committed meanwhile, or a rank began here. Not for an ended generation, but a
        committed one (its failure record would tell every node still waiting that it can
        never commit). Errors are logged: those nodes then end the step at their next look."""
        async with self._locks.hold(gen.key):
            if (gen.state in (GenerationState.FAILED, GenerationState.CANCELLED)
                    or self.ledger.get(gen.job, gen.step) is not gen):
                return
            recorded = [r for r, st in gen.ranks.items() if st is RankState.RECORDED]
            part = await part_record(self.config, self.ledger, gen, recorded)
            try:
                await self.retrying(lambda: self.committer.record_part(part))
            except (BackendError, ManifestError) as exc:
                log_event(log, logging.WARNING, "part_record_restore_failed", job=gen.job,
                          step=gen.step, error=str(exc),
                          action="nodes that read this node's failure record end the step")
                return
        log_event(log, logging.INFO, "failure_record_withdrawn", job=gen.job, step=gen.step,
                  state=str(gen.state))

    async def _put(self, gen: GenerationRecord, recorded: list[int], failed: list[int],
                   reason: str, *, unless_present: bool = False, unless_committed: bool = False,
                   action: str = "the other nodes end it after drain.commit_wait_s") -> bool:
        """Write the failure record (held: the part lock); False when it was not written."""
        owner = self.ledger.jobs.get(gen.job)
        if owner is not None and self.config.access.check_destination_owner:
            try:
                theirs = await self.retrying(
                    lambda: self.committer.owners.someone_else(gen.job, owner))
            except (BackendError, ManifestError) as exc:
                # Cannot tell whose job it is: nothing is written into what may be
                # another user's (the other nodes end it after commit_wait_s).
                log_event(log, logging.WARNING, "failure_record_failed", job=gen.job,
                          step=gen.step, error=str(exc), action=action)
                return False
            if theirs is not None:
                return False  # another user's job: nothing of this node's goes there
        part = await part_record(self.config, self.ledger, gen, recorded, failed, reason)
        key = part_key(gen.job, gen.step, part.node)
        try:
            if unless_present and await self._already(key, part):
                return False
            await self.retrying(lambda: self._try_put(gen, part, unless_committed))
        except (BackendError, ManifestError) as exc:
            log_event(log, logging.WARNING, "failure_record_failed", job=gen.job,
                      step=gen.step, error=str(exc), action=action)
            return False
        return True

    async def _try_put(self, gen: GenerationRecord, part: PartRecord,
                       unless_committed: bool) -> None:
        """One try of a failure record's write: where ``unless_committed``, the step is looked
        for first, at every try, as a node may commit it while the tries retry."""
        if unless_committed:
            here, manifest = await self.committed_look(gen)
            if here:
                raise _CommittedMeanwhile(manifest)
        await self.committer.record_part(part)

    async def committed_look(self, gen: GenerationRecord) -> tuple[bool, Manifest | None]:
        """One look (destination errors raised): whether ``gen``'s step is committed with this
        node's part as it recorded it (holds_my_part), and the manifest that says so."""
        try:
            manifest, removed = await self.committer.committed_or_removed(gen.job, gen.step)
        except ManifestError:
            return False, None  # damaged: no commit of this step's
        return holds_my_part(self.config.node_id, gen, manifest, removed), manifest

    async def owed(self, gen: GenerationRecord, on_committed: OnCommitted, *,
                   every_rank: bool, unless_present: bool = False) -> None:
        """The failure record an end owes ``gen`` after it (:meth:`write`): queued by the end
        (Endings._end: :meth:`write_told` could not write it, or the end wrote none first)
        and resent at start-up (:meth:`resend`); the one way either writes it, so that
        neither writes it into a step committed meanwhile (a committed step is final).

        Looked for before the write, before each of its tries, and after it; committed with
        this node's part (another node read its record saying "recorded" before the failure
        record landed): nothing is written, ``on_committed`` (Endings.committed_after_all)
        ends it COMMITTED here where every rank begun here is recorded, and a record written
        just before the commit was seen is written back as recorded. Found attacking
        multi-node ends: a queued write retrying against a destination that refused it (or
        after an abort's 10 s) landed, once the destination took writes again, inside the
        step another node had committed meanwhile, and status said "failed" here. Where the
        destination cannot say, nothing is written: the record stays owed to the next start."""
        if len(gen.ranks) >= gen.world_size or not ((every_rank and gen.ranks) or any(
                st is not RankState.RECORDED for st in gen.ranks.values())):
            return  # nothing to write (write): nothing to ask
        try:
            here, manifest = await self.retrying(lambda: self.committed_look(gen))
            written = not here and await self.write(
                gen, unless_present=unless_present, every_rank=every_rank, unless_committed=True)
        except _CommittedMeanwhile as found:
            here, manifest, written = True, found.manifest, False
        except BackendError:
            log_event(log, logging.WARNING, "failure_record_failed", job=gen.job, step=gen.step,
                      error="the destination could not say whether the step committed meanwhile",
                      action="written at the next start; a node that looks before then may "
                             "still commit the step from this node's earlier record")
            return
        if written:
            # A node that read the records before this one landed may create the manifest
            # after: committed so, the record is written back as recorded.
            try:
                here, manifest = await self.retrying(lambda: self.committed_look(gen))
            except BackendError:
                return  # written; the other nodes end the step from it
        if not here:
            return
        await on_committed(gen, manifest)
        if written:
            await self.write_recorded(gen)
        else:
            log_event(log, logging.INFO, "failure_record_not_sent", job=gen.job, step=gen.step,
                      why="another node committed the step with this node's part",
                      state=str(gen.state))

    async def resend(self, gen: GenerationRecord, on_committed: OnCommitted) -> None:
        """At start-up, for a generation of :meth:`unsent`: its failure record as the end
        owed it (:meth:`owed`: not into a step committed meanwhile), unless the destination
        holds it already. Every rank of this node's aborted
        where all were recorded (its commit wait, its own create, an abort: their ranks heard
        it failed), but where another node's record marks a rank aborted, whose end ended it
        here (the record left as it is, as at run time: :meth:`write`). Found reviewing
        multi-node commits: which it was is not journalled, and the resend wrote only the
        ranks not recorded (none), so a failure record owed when the daemon was killed, or
        given up against a destination that refused it, was never written; the record kept
        saying "recorded", and a node that came later published the step from it. Found
        attacking multi-node ends: a node that came while this one was down committed the
        step from that record, and the resend rewrote it, every rank aborted, inside the
        committed step."""
        if len(gen.ranks) >= gen.world_size:
            return  # every rank began here: no record is written (write), nothing to ask
        every_rank = False
        if gen.ranks and all(st is RankState.RECORDED for st in gen.ranks.values()):
            try:
                parts, _ = await self.committer.read_parts(gen.job, gen.step, gen.world_size,
                                                           gen.attempt)
            except (BackendError, ManifestError):
                parts = []  # cannot tell: the record that keeps every node from publishing
            node = self.config.node_id
            every_rank = not any(p.aborted_ranks for p in parts if p.node != node)
        await self.owed(gen, on_committed, every_rank=every_rank, unless_present=True)

    async def _already(self, key: str, part: PartRecord) -> bool:
        data = await self.committer.backend.get_bytes(key)
        if data is None:
            return False
        try:
            there = await parse_part(data)
        except ManifestError:
            return False  # unreadable: rewrite it
        return (there.attempt, there.aborted_ranks) == (part.attempt, part.aborted_ranks)

    def unsent(self) -> Iterator[GenerationRecord]:
        """At start-up: the failed generations whose failure record may never have been
        written (queued when the daemon stopped). Not a step older than a commit this node
        saw: nobody waits for those."""
        newest: dict[str, int] = {}
        for gen in self.ledger.generations.values():
            if gen.state is GenerationState.COMMITTED:
                newest[gen.job] = max(newest.get(gen.job, gen.step), gen.step)
        for gen in list(self.ledger.generations.values()):
            if gen.state is GenerationState.FAILED and gen.step > newest.get(gen.job, -1):
                yield gen
