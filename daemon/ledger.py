"""What this node holds: generations, their ranks and shards, mirrored to the journal.

The ledger is the only writer of lifecycle state. Every change is an event passed to
:meth:`Ledger.apply`, which looks the move up in :mod:`ckptdrain.daemon.state`'s table and
journals it before anyone is told about it, so a restarted daemon rebuilds exactly what it had
acknowledged. The records themselves are :mod:`ckptdrain.daemon.records`' (re-exported here).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, overload

from ckptdrain.daemon import journalrows as j
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.journalreplay import JournalReplay
from ckptdrain.daemon.records import (
    MAX_ERROR_CHARS,
    SUMMARY_ERROR_CHARS,
    SUMMARY_RANKS,
    GenerationRecord,
    GenKey,
    ShardRecord,
    assign,
    cap_error,
)
from ckptdrain.daemon.state import (
    INITIAL_RANK,
    INITIAL_SHARD,
    GenerationEvent,
    GenerationState,
    IllegalTransition,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
    journalled,
    transition,
)

__all__ = ["MAX_ERROR_CHARS", "SUMMARY_ERROR_CHARS", "SUMMARY_RANKS", "GenKey",
           "GenerationRecord", "Ledger", "ShardRecord", "cap_error"]


class Ledger(JournalReplay):
    def __init__(self, journal: Journal,
                 acknowledge: Callable[..., Awaitable[None]] | None = None) -> None:
        self.journal = journal
        # How a staged shard's record is made durable (a GroupCommit in the daemon).
        self._acknowledge = acknowledge or journal.write
        self.generations: dict[GenKey, GenerationRecord] = {}
        self.jobs: dict[str, int] = {}
        # Jobs claimed in memory by a begin whose journal write has not succeeded yet.
        self._unjournalled_claims: set[str] = set()
        self._next_shard_id = 1
        # Every shard of every generation held, by id: what `status` finds an open upload's
        # shard by (O(open uploads), not a walk of every shard). Kept where shards are added
        # (a hand-off, the journal's replay) and dropped (a refused add, a forgotten attempt).
        self.shard_index: dict[int, tuple[GenerationRecord, ShardRecord]] = {}
        # Set (and replaced) whenever a generation is opened, changes or is forgotten: what
        # `wait` sleeps on, so it learns of a commit or a new attempt at once.
        self._changed = asyncio.Event()
        # Called the moment a generation's state turns terminal in memory, before its row is
        # journalled: the daemon frees its generation slot here (server.py), so that no
        # `wait` woken during that write sees the end while the job's next `begin` is still
        # refused for the slot.
        self.ended: Callable[[GenerationRecord], None] = lambda gen: None
        # Awaited before a generation's journal rows are deleted (forget), the one place they
        # go: the daemon owes, durably, the abort of every upload still journalled for its
        # shards (UploadAborts.leave_all). Its end's queued abort ran after the delete found
        # nothing journalled, and the upload waited for the orphan sweep's grace.
        self.forgetting: Callable[[GenerationRecord], Awaitable[None]] | None = None

    def change(self) -> asyncio.Event:
        """An event set at the next change of any generation (take it before looking)."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def get(self, job: str, step: int) -> GenerationRecord | None:
        return self.generations.get((job, step))

    def shard_ids(self) -> int:
        sid = self._next_shard_id
        self._next_shard_id += 1
        return sid

    async def open_generation(
        self, job: str, step: int, world_size: int, ack: str, uid: int, attempt: str = ""
    ) -> GenerationRecord:
        """The generation's record, created and journalled (with the job's owner) if new."""
        gen = self.generations.get((job, step))
        if gen is not None:
            return gen
        gen = GenerationRecord(job=job, step=step, world_size=world_size, ack=ack,
                               created_at=time.time(), attempt=attempt)
        self.generations[gen.key] = gen
        statements = [j.put_generation(gen.row())]
        if job not in self.jobs:
            self.jobs[job] = uid
            self._unjournalled_claims.add(job)
        if job in self._unjournalled_claims:
            # Every begin of the job carries the claim until one is written (the row is
            # INSERT OR IGNORE): whichever of concurrent begins is journalled, the job has
            # its owner at the next start.
            statements.insert(0, j.claim_job(job, self.jobs[job]))
        try:
            await self.journal.write(*statements, new=True)
        except BaseException:
            self.generations.pop(gen.key, None)
            if job in self._unjournalled_claims and not any(
                    key[0] == job for key in self.generations):
                # Nobody's job after all: a begin refused for a full journal left it claimed
                # by the refused uid, and every other uid's begin of it was denied until a
                # restart (found attacking a full disk, then reviewing concurrent begins).
                self.jobs.pop(job, None)
                self._unjournalled_claims.discard(job)
            raise
        self._unjournalled_claims.discard(job)
        self._notify()
        return gen

    async def add_shard(self, gen: GenerationRecord, shard: ShardRecord,
                        before: Sequence[Callable[[], None]] = ()) -> None:
        """Journal a new shard: the moment it is acknowledged. ``before``: what must be
        durable first (the staged file's fsync), run in the journal's thread right before
        the shard's row is written, with those of the other hand-offs in its batch."""
        if shard.state not in INITIAL_SHARD:
            raise IllegalTransition(f"a shard begins held or staged, not {shard.state}")
        if not self.current(gen):
            # Its rows would land on (or replace) the newer attempt's at the same step.
            raise IllegalTransition(f"step {gen.step} of job {gen.job!r}: attempt "
                                    f"{gen.attempt or 'unnamed'} was replaced or forgotten")
        if shard.path in gen.shards or shard.id in self.shard_index:
            # The hand-off refuses duplicates before this; a record replaced here would leave
            # the generation's tallies counting it.
            raise IllegalTransition(f"step {gen.step} of job {gen.job!r} already holds "
                                    f"{shard.path!r} (or shard id {shard.id})")
        gen.shards[shard.path] = shard
        gen.count(shard, +1)
        self.shard_index[shard.id] = (gen, shard)
        statements = [j.put_shard(shard.row())]
        if gen.handoff_at is None or shard.handed_at < gen.handoff_at:
            gen.handoff_at = shard.handed_at
            statements.append(j.put_generation(gen.row()))
        try:
            await self._acknowledge(*statements, before=before, new=True)
        except BaseException:
            gen.shards.pop(shard.path, None)
            gen.count(shard, -1)
            self.shard_index.pop(shard.id, None)
            raise

    async def open_rank(self, gen: GenerationRecord, rank: int) -> None:
        """Journal a rank that began handing off on this node."""
        if rank in gen.ranks:
            raise IllegalTransition(f"rank {rank} of step {gen.step} of job {gen.job!r} "
                                    f"already began ({gen.ranks[rank]})")
        gen.ranks[rank] = INITIAL_RANK
        try:
            await self._journal(gen, j.put_rank(gen.job, gen.step, rank, str(INITIAL_RANK)),
                                new=True)
        except BaseException:
            # Not begun after all: an open rank nobody hands off would hold the generation
            # back for good.
            gen.ranks.pop(rank, None)
            raise

    # -- the one way a state changes ---------------------------------------------------------
    @overload
    async def apply(self, record: ShardRecord, event: ShardEvent, *, persist: bool = True,
                    **fields: Any) -> ShardState: ...
    @overload
    async def apply(self, record: tuple[GenerationRecord, int], event: RankEvent) -> RankState: ...
    @overload
    async def apply(self, record: GenerationRecord, event: GenerationEvent,
                    **fields: Any) -> GenerationState: ...
    async def apply(self, record: Any, event: Any, *, persist: bool = True,
                    **fields: Any) -> Any:
        """Move ``record`` by ``event`` through the transition table, set ``fields`` on it and
        journal it; returns the new state. A rank is named by ``(generation, rank)``: its state
        lives in the generation. ``persist=False`` leaves the journal as it is (a shard about
        to be forgotten, or a drain starting or given up: on disk it is staged either way).
        Raises :class:`IllegalTransition` for a move the table lacks, before changing anything.
        """
        if isinstance(record, ShardRecord) and isinstance(event, ShardEvent):
            return await self._apply_shard(record, event, persist, fields)
        if isinstance(record, GenerationRecord) and isinstance(event, GenerationEvent):
            if not persist:
                raise TypeError("a generation's state change is always journalled")
            return await self._apply_generation(record, event, fields)
        if isinstance(record, tuple) and isinstance(event, RankEvent):
            if fields or not persist:
                raise TypeError("a rank has no fields, and its state change is always journalled")
            gen, rank = record
            return await self._apply_rank(gen, rank, event)
        raise TypeError(f"{event!r} does not apply to {type(record).__name__}")

    async def _apply_shard(self, shard: ShardRecord, event: ShardEvent, persist: bool,
                           fields: dict[str, Any]) -> ShardState:
        undo = self._shard_undo(shard, event, fields)
        new, statement = self._move_shard(shard, event, persist, fields)
        if statement is not None:
            await self._written([statement], [undo])
        return new

    async def apply_shards(self, changes: list[tuple[ShardRecord, dict[str, Any]]],
                           event: ShardEvent) -> None:
        """:meth:`apply` of ``event`` to many shards, with their own fields each, journalled
        in one write (a drained batch of small shards). Every move is looked up before any is
        made: an illegal one raises and changes nothing."""
        for shard, fields in changes:
            transition(shard.state, event)
            _check_fields(shard, fields)
        undos = [self._shard_undo(shard, event, fields) for shard, fields in changes]
        statements = [st for shard, fields in changes
                      if (st := self._move_shard(shard, event, True, fields)[1]) is not None]
        if statements:
            await self._written(statements, undos)

    def _shard_undo(self, shard: ShardRecord, event: ShardEvent,
                    fields: dict[str, Any]) -> Callable[[], None]:
        """What puts ``shard`` back as it is now (its state, and the ``fields`` about to be
        set) once ``event`` has moved it, unless something moved it again meanwhile."""
        state = shard.state
        old = {name: getattr(shard, name) for name in fields}
        moved_to = transition(state, event)

        def undo() -> None:
            if shard.state is not moved_to:
                return  # moved on since: what moved it wrote its own row
            gen = self.generations.get((shard.job, shard.step))
            counted = gen is not None and gen.shards.get(shard.path) is shard
            if gen is not None and counted:
                gen.count(shard, -1)
            shard.state = state
            for name, value in old.items():
                assign(shard, name, value)
            if gen is not None and counted:
                gen.count(shard, +1)

        return undo

    async def _written(self, statements: list[tuple[str, tuple[Any, ...]]],
                       undos: list[Callable[[], None]]) -> None:
        """Journal ``statements``, the records of moves already made in memory; when the
        write fails, the moves are taken back, so that memory never runs ahead of what the
        next start will find (a shard counted drained whose row still says staged had its
        staged copy removed: acknowledged work lost at the restart). A full disk does not
        fail it: Journal.write waits for room."""
        try:
            await self.journal.write(*statements)
        except asyncio.CancelledError:
            raise  # the write still happens, in its turn (Journal.write)
        except BaseException:
            for undo in reversed(undos):
                undo()
            raise

    def _move_shard(self, shard: ShardRecord, event: ShardEvent, persist: bool,
                    fields: dict[str, Any]) -> tuple[ShardState, tuple[str, tuple[Any, ...]] | None]:
        """Move ``shard`` in memory; the statement that journals it, or None."""
        new = transition(shard.state, event)
        _check_fields(shard, fields)
        gen = self.generations.get((shard.job, shard.step))
        if gen is None or gen.shards.get(shard.path) is not shard:
            # A forgotten generation's or a replaced attempt's shard counts for nobody, and
            # its row must not come back into the journal (or overwrite the new attempt's).
            gen = None
            persist = False
        # Worked out first: nothing may raise between the tallies' -1 and +1.
        values = {name: cap_error(value) if name == "error" else value
                  for name, value in fields.items()}
        if gen is not None:
            gen.count(shard, -1)
        shard.state = new
        for name, value in values.items():
            assign(shard, name, value)
        if gen is not None:
            gen.count(shard, +1)
        if not persist:
            return new, None
        row = shard.row()
        row["state"] = str(journalled(new))
        return new, j.put_shard(row)

    async def _apply_rank(self, gen: GenerationRecord, rank: int, event: RankEvent) -> RankState:
        current = gen.ranks.get(rank)
        if current is None:
            raise IllegalTransition(f"RankEvent.{event.name}: rank {rank} of step {gen.step} "
                                    f"of job {gen.job!r} never began on this node")
        new = gen.ranks[rank] = transition(current, event)
        try:
            await self._journal(gen, j.put_rank(gen.job, gen.step, rank, str(new)))
        except asyncio.CancelledError:
            raise  # the write still happens, in its turn (Journal.write)
        except BaseException:
            if gen.ranks.get(rank) is new:  # taken back as _written does, unless moved since
                gen.ranks[rank] = current
            raise
        return new

    async def _apply_generation(self, gen: GenerationRecord, event: GenerationEvent,
                                fields: dict[str, Any]) -> GenerationState:
        new = transition(gen.state, event)
        _check_fields(gen, fields)
        gen.state = new
        if gen.terminal:
            self.ended(gen)
        await self._save(gen, fields)
        return new

    async def update_generation(self, gen: GenerationRecord, **fields: Any) -> None:
        """Journal new values of a generation's fields; its state changes only by :meth:`apply`."""
        _check_fields(gen, fields)
        await self._save(gen, fields)

    async def _save(self, gen: GenerationRecord, fields: dict[str, Any]) -> None:
        for name, value in fields.items():
            assign(gen, name, cap_error(value) if name == "error" else value)
        await self._journal(gen, j.put_generation(gen.row()))
        self._notify()

    async def _journal(self, gen: GenerationRecord, statement: tuple[str, tuple[Any, ...]], *,
                       new: bool = False) -> None:
        # Rows are keyed by (job, step): a forgotten generation's late change (its old
        # connection leaving, say) must not land on a new attempt's rows at the same step.
        if self.current(gen):
            await self.journal.write(statement, new=new)

    def current(self, gen: GenerationRecord) -> bool:
        """Whether ``gen`` is the attempt this node holds at its step (not forgotten or
        replaced by a newer attempt)."""
        return self.generations.get(gen.key) is gen

    async def give_job(self, job: str, uid: int) -> None:
        """``job`` is ``uid``'s from now on (root saved it for them: owners.adopt)."""
        self.jobs[job] = uid
        await self.journal.write(j.forget_job(job), j.claim_job(job, uid))

    async def forget_jobs(self, jobs: list[str]) -> None:
        """Forget who owns ``jobs`` (they hold nothing here any more)."""
        for job in jobs:
            self.jobs.pop(job, None)
        await self.journal.write(*(j.forget_job(job) for job in jobs))

    async def forget(self, gen: GenerationRecord) -> None:
        """Forget this attempt, and only it: a no-op once it was forgotten or replaced.
        Gone from memory before the journal write is queued, so a new attempt opened meanwhile
        writes its rows after this delete, never before it."""
        if not self.current(gen):
            return
        if self.forgetting is not None:
            await self.forgetting(gen)
            if not self.current(gen):
                return  # forgotten (or replaced) meanwhile
        del self.generations[gen.key]
        for shard in gen.shards.values():
            if self.shard_index.get(shard.id, (None, None))[1] is shard:
                del self.shard_index[shard.id]
        self._notify()
        await self.journal.write(*j.delete_generation(gen.job, gen.step, gen.attempt))


def _check_fields(record: object, fields: dict[str, Any]) -> None:
    # A misspelt name would otherwise become a new attribute nobody reads, and "state" would
    # bypass the table.
    for name in fields:
        if name == "state" or not hasattr(record, name):
            raise TypeError(f"{type(record).__name__} has no field {name!r} to set")
