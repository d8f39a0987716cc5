"""Every shard file this node holds on local storage, and the one owner of its room.

A staged shard holds two reservations: its bytes on ``max_staged_bytes`` for as long as its
file exists, and a ``max_queued_shards`` slot until it has drained (or is discarded). Both
live here, keyed by the shard record, and are released exactly once: the slot when the shard
drains or is dropped; the bytes after its file is unlinked (off the event loop) when it is
evicted or dropped as it drains, at once when the decision to drop it is made otherwise.

Copies kept after draining (for a fast restore, for a generation still waiting on other
nodes) stay inside ``max_staged_bytes``. When a hand-off needs room they are evicted oldest
first; a shard not yet drained is never evicted (a failed generation's copies kept for
``retry`` included: they stay charged to their uid's share instead), and the newest committed
generation of a job, the copy a fast restore would use, goes only after every other
candidate.

Copies lent to readers through ``open`` (what bounds lending, and dropped copies a reader still
holds open) are lentcopies.py's :class:`LentCopies`, which :class:`LocalCopies` builds on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ckptdrain.daemon.budget import Reservation
from ckptdrain.daemon.lentcopies import LentCopies
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import GenerationState, ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.admission import Admission
    from ckptdrain.daemon.dataplane import DataPlane
    from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
    from ckptdrain.daemon.staging import Staging
    from ckptdrain.daemon.supervisor import Supervisor

log = logging.getLogger("ckptdrain.copies")

# Staged files unlinked by one data-plane call (each call is bounded by io_timeout_s).
UNLINK_BATCH = 256
# How long copies dropped as their shards drain (keep_local_copy off) are gathered before one
# data-plane call unlinks them. They drop one at a time: unlinked at once, each was a task, a
# thread hop and a future's callback on the event loop, about a fifth of its CPU per shard in
# a drain of small shards (py-spy, 256 x 1 MiB to S3). A gathered copy keeps its room until its
# file is gone, so max_staged_bytes still bounds the disk, and a hand-off that waits for room
# (or any other drop: a generation ended, failed or expired) ends the wait.
UNLINK_GATHER_S = 0.05


class LocalCopies(LentCopies):
    def __init__(self, staging: Staging, admission: Admission, ledger: Ledger,
                 dataplane: DataPlane, supervisor: Supervisor) -> None:
        super().__init__(staging, admission, ledger, dataplane, supervisor)
        self.keep_after_drain = True
        self._room: dict[ShardRecord, Reservation] = {}
        self._slot: dict[ShardRecord, Reservation] = {}
        self.evicted = 0
        # Files to unlink, each with the room it holds until then (None: released at the drop).
        self._unlinks: list[tuple[ShardRecord, Reservation | None]] = []
        self._unlinking = False
        self._unlink_now = asyncio.Event()

    # -- ownership ----------------------------------------------------------------------------
    def adopt(self, shard: ShardRecord, room: Reservation, slot: Reservation | None) -> None:
        """The shard's file now exists: it owns its room (and its queue slot until drained)."""
        self._room[shard] = room
        if slot is not None:
            self._slot[shard] = slot

    def recovered(self, shard: ShardRecord) -> None:
        """Recovery found ``shard``'s file: held against the limits whatever they are now,
        its uid's share included while it is to drain or kept for ``retry`` (as at the
        hand-off that staged it, and as :meth:`kept_for_retry` keeps it)."""
        room = self._room[shard] = self.admission.staged.adopt(shard.size)
        if shard.state is ShardState.DRAINED:
            # A reader may still hold an fd an earlier run lent it: dropping the copy asks.
            self._lent.add(shard.staged_name)
        if shard.state in (ShardState.STAGED, ShardState.FAILED):
            slot = self._slot[shard] = self.admission.shards.adopt(1)
            self._charge(shard, room)
            self._charge(shard, slot)

    def vanished(self, shard: ShardRecord) -> None:
        """A drained shard went missing at the destination (failed, for ``retry`` to drain
        again): while its copy exists it holds a queue slot again, as every undrained one
        does (drained() gave it back)."""
        if shard in self._room and shard not in self._slot:
            self._slot[shard] = self.admission.shards.adopt(1)

    def kept_for_retry(self, gen: GenerationRecord) -> None:
        """``gen`` failed and keeps its undrained copies for ``ckptdrain retry``: they stay
        charged to its uid's share, bytes and queue slots, until they drain (retried) or go
        (``ckptdrain abort``, retention.keep_failed, retention.forget_after_s). Left out of the
        share, they still held max_staged_bytes and max_queued_shards, which no eviction
        frees: one user failing its own saves again and again filled the node, and every
        other user was refused (found attacking). A save they refuse is told so, and how to
        free them (Admission.check_uid_share).

        They are never evicted, not even for another uid's hand-off: each is the only copy of
        acknowledged bytes that never reached the destination (a destination outage fails
        every user's saves at once: evicted, they would have been lost to whoever saved
        next). The share bounds what one uid holds through them instead. A shard that
        vanished at the destination (drained, then failed) is charged again here too: its
        room was given back to the share when it drained."""
        for shard in gen.shards.values():
            if shard.state is not ShardState.DRAINED:
                for held in (self._room.get(shard), self._slot.get(shard)):
                    if held is not None:
                        self._charge(shard, held)

    def retried(self, shard: ShardRecord) -> None:
        """Its failed generation is retried: the shard counts against its uid's share until
        it drains, as it did while kept (an operator's retry is not refused for the share)."""
        for held in (self._room.get(shard), self._slot.get(shard)):
            if held is not None:
                self._charge(shard, held)

    def _charge(self, shard: ShardRecord, room: Reservation) -> None:
        """Charge ``room`` to the share of ``shard``'s job's owner, unless it already is: given
        back when the shard drains (settled) or its copy goes (released). A generation that
        fails (again) while a retry's loop still charges its shards leaves nothing charged
        for good: the copies a failed generation keeps are charged anyway, and given back
        with them."""
        owner = self.ledger.jobs.get(shard.job)
        if (owner is not None and room.then is None
                and self.ledger.get(shard.job, shard.step) is not None):
            self.admission.charge(room, owner)

    def held_for_retry(self, uid: int) -> tuple[int, int, list[GenerationRecord]]:
        """What ``uid``'s failed generations hold for ``retry``: bytes, queue slots, and the
        generations, oldest step first (what a save over the share is told to free)."""
        jobs = self.ledger.jobs
        nbytes = slots = 0
        gens = []
        for gen in sorted(self.ledger.generations.values(), key=lambda g: (g.step, g.job)):
            if gen.state is not GenerationState.FAILED or jobs.get(gen.job) != uid:
                continue
            before = (nbytes, slots)
            for shard in gen.shards.values():
                if shard.state is ShardState.DRAINED:
                    continue
                room, slot = self._room.get(shard), self._slot.get(shard)
                nbytes += room.amount if room is not None else 0
                slots += 1 if slot is not None else 0
            if (nbytes, slots) != before:
                gens.append(gen)
        return nbytes, slots, gens

    @property
    def kept_bytes(self) -> int:
        """Bytes of drained copies: inside max_staged_bytes, but evicted when room is needed."""
        return sum(r.amount for s, r in self._room.items() if s.state is ShardState.DRAINED)

    def held_bytes(self, shard: ShardRecord) -> int:
        room = self._room.get(shard)
        return room.amount if room is not None else 0

    # -- events -------------------------------------------------------------------------------
    def drained(self, shard: ShardRecord) -> None:
        """The bytes are safe at the destination: its queue slot goes back; the file stays as
        a local copy (inside max_staged_bytes) unless keep_local_copy is off."""
        slot = self._slot.pop(shard, None)
        if slot is not None:
            slot.release()
        room = self._room.get(shard)
        if room is not None:
            # limits.max_reserved_bytes_per_uid bounds what a uid holds until drained: a kept
            # copy counted against it refused every later save of a uid whose checkpoint was
            # over half its share, for good (found attacking the per-uid limit).
            room.settle()
        if not self.keep_after_drain:
            # Its room goes back once the file is gone; a hand-off waiting for room gets it
            # without the gathering wait.
            self._drop(shard, gather=not self.admission.staged.head_request(), hold_room=True)
        elif self.admission.staged.head_request():
            # A hand-off waits for room, and this copy just became evictable: make room now,
            # or the waiter would wait for a release that kept copies never make.
            self.supervisor.spawn(self.relieve, what="evict for a waiting hand-off")

    async def relieve(self) -> None:
        """Evict for the hand-offs waiting on max_staged_bytes, first in line first."""
        while (head := self.admission.staged.head_request()) and await self.make_room(head):
            pass

    def discard(self, shard: ShardRecord) -> None:
        """Drop the shard's file and everything it holds. Its room goes back at once (the
        decision is made; the staging filesystem's own free-space check covers the moment
        until the unlink, which runs in the data plane, is done)."""
        self._drop(shard, gather=False, hold_room=False)

    def _drop(self, shard: ShardRecord, *, gather: bool, hold_room: bool) -> None:
        """``gather``: the unlink may wait :data:`UNLINK_GATHER_S` for more drops to join
        it; ``hold_room``: the room goes back when the file is gone, not now."""
        slot = self._slot.pop(shard, None)
        if slot is not None:
            slot.release()
        room = self._room.pop(shard, None)
        if not shard.local_copy and room is None:
            return
        if shard.staged_name in self._lent:
            shard.local_copy = False
            self._pin(shard, room)
            return
        if room is not None and not hold_room:
            room.release()
            room = None
        shard.local_copy = False
        # Unlinked in batches: one data-plane job for every file dropped meanwhile, not a
        # task and a thread hop per shard (a generation of small shards drops thousands).
        self._unlinks.append((shard, room))
        if not gather:
            self._unlink_now.set()
        if not self._unlinking:
            self._unlinking = True
            self.supervisor.spawn(self._unlink_dropped, what="unlink dropped staged copies")

    async def _unlink_dropped(self) -> None:
        try:
            while self._unlinks:
                # Before every batch: drops keep coming while one is unlinked.
                if len(self._unlinks) < UNLINK_BATCH:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(UNLINK_GATHER_S):
                            await self._unlink_now.wait()
                batch = self._unlinks[:UNLINK_BATCH]
                del self._unlinks[:UNLINK_BATCH]
                if not self._unlinks:  # else what asked for it may be in the rest: no wait
                    self._unlink_now.clear()
                kept: list[str] = []
                try:
                    kept = await self.dataplane.call(self.staging.discard_many,
                                                     [s.staged_name for s, _ in batch])
                finally:
                    # Unlinked, or the call failed or was cancelled (a stop): the room goes
                    # back. A file the kernel would not remove stays counted, and is asked again.
                    stays = set(kept)
                    _give_back([(s, room) for s, room in batch if s.staged_name not in stays])
                for shard, room in batch:
                    if shard.staged_name in stays:
                        self._pin(shard, room)
        finally:
            self._unlinking = False
            if not self._unlinks:
                self._unlink_now.clear()  # what asked for it is unlinked
            elif not self.supervisor.accepting:
                # Stopping: a restart's recovery drops these files (keep_local_copy off).
                _give_back(self._unlinks)
                self._unlinks.clear()
            else:  # the call failed (logged by the supervisor): go on with the rest
                self._unlinking = True
                self.supervisor.spawn(self._unlink_dropped, what="unlink dropped staged copies")

    def discard_generation(self, gen: GenerationRecord) -> None:
        for shard in gen.shards.values():
            self.discard(shard)

    def drop_older_committed(self, gen: GenerationRecord) -> None:
        """``gen`` committed: older committed generations of its job are no longer the
        newest, so their copies go."""
        for other in self.ledger.generations.values():
            if (other.job == gen.job and other is not gen and other.step < gen.step
                    and other.state is GenerationState.COMMITTED):
                self.discard_generation(other)

    # -- eviction -----------------------------------------------------------------------------
    def evictable(self) -> list[ShardRecord]:
        """Drained copies, oldest first; the newest committed generation of each job last."""
        newest: dict[str, int] = {}
        for g in self.ledger.generations.values():
            if g.state is GenerationState.COMMITTED and g.step > newest.get(g.job, -1):
                newest[g.job] = g.step
        candidates = []
        for g in self.ledger.generations.values():
            last_resort = newest.get(g.job) == g.step and g.state is GenerationState.COMMITTED
            for s in g.shards.values():
                if s.state is ShardState.DRAINED and s in self._room:
                    candidates.append((last_resort, s.drained_at or s.staged_at, s.id, s))
        candidates.sort(key=lambda c: c[:3])
        return [c[3] for c in candidates]

    async def make_room(self, amount: int) -> int:
        """Evict kept copies until ``amount`` fits max_staged_bytes (what waiters ahead of it
        need included); returns the bytes evicted. Waits for the unlinks, so the room is real
        when the hand-off goes on."""
        budget = self.admission.staged
        need = budget.used + amount - budget.limit
        if need <= 0:
            return 0
        return await self._evict(need, "a hand-off needed room on max_staged_bytes")

    async def make_disk_room(self, need: int) -> int:
        """Evict kept copies to free ``need`` bytes of the staging filesystem itself (something
        besides ckptdrain filled the disk): a hand-off was refused as `staging_filesystem`
        while copies kept only for a fast restore sat on it (found attacking). Returns the
        bytes evicted, unlinked by then. Nothing is evicted when every copy would not free
        ``need`` (a hand-off that could not fit anyway took every fast-restore copy with it:
        found attacking). A copy lent to a reader counts unless the kernel says a reader holds
        it open now: most were read and closed (a restore from the node's copies; left out,
        one restore stopped every eviction for the disk), while one held open frees nothing
        (counted, every other copy went for a hand-off still refused)."""
        if need <= 0:
            return 0
        copies = self.evictable()
        lent = [s.staged_name for s in copies if s.staged_name in self._lent]
        held = await self.dataplane.call(self.staging.held_open, lent) if lent else set()
        # (Looked up again: others may have evicted some while the kernel was asked.)
        free = sum(room.amount for s in copies
                   if s.staged_name not in held and (room := self._room.get(s)) is not None)
        if free < need:
            return 0
        return await self._evict(need, "a hand-off needed room on the staging filesystem",
                                 copies)

    async def _evict(self, need: int, reason: str,
                     candidates: list[ShardRecord] | None = None) -> int:
        """Evict kept copies, oldest first (``candidates``, default :meth:`evictable`), until
        ``need`` bytes went; returns the bytes evicted."""
        freed = 0
        evicted = 0
        for shard in self.evictable() if candidates is None else candidates:
            if freed >= need:
                break
            room = self._room.pop(shard, None)
            if room is None:
                continue  # dropped or evicted by someone else while this one unlinked
            shard.local_copy = False
            # Lent to a reader once: removed only if none holds it now, else it stays
            # counted and the next copy is evicted instead (one copy read once stopped every
            # eviction behind it, found attacking).
            lent = shard.staged_name in self._lent
            self._lent.discard(shard.staged_name)
            self._unlend(shard.staged_name)  # removed now, or pinned (counted there)
            if not await self._discard(shard, room, lent=lent):
                continue
            freed += room.amount
            evicted += 1
        if evicted:
            self.evicted += evicted
            log_event(log, logging.INFO, "local_copies_evicted", shards=evicted, bytes=freed,
                      reason=reason)
        return freed

    async def _discard(self, shard: ShardRecord, room: Reservation, *, lent: bool) -> bool:
        """Remove ``shard``'s copy (a ``lent`` one only if no reader holds it open); whether
        it went. ``room`` is settled by what the thread did, also when this task is cancelled
        meanwhile (a hand-off whose client hung up while it evicted for room): released once
        the file is gone, pinned while a reader keeps it or the unlink failed. Released at
        the cancellation instead, the room came back while the thread kept a held file, which
        then stayed on the disk in no count (found attacking)."""
        settled = False

        def settle(removed: object) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            if removed:
                room.release()
            else:
                self._pin(shard, room)

        name = shard.staged_name
        if lent:
            removed = bool(await self.dataplane.call(
                self.staging.discard_unless_open, [name], abandoned=settle,
                cleanup=lambda: settle(True)))
        else:
            # A file whose unlink failed (EIO) stays counted and is asked again, as a held one.
            removed = not await self.dataplane.call(
                self.staging.discard_many, [name], abandoned=lambda kept: settle(not kept),
                cleanup=lambda: settle(True))
        settle(removed)
        return removed


def _give_back(unlinks: list[tuple[ShardRecord, Reservation | None]]) -> None:
    """The rooms gathered drops held until their unlink: each released once, as it leaves
    the unlink queue."""
    for _, room in unlinks:
        if room is not None:
            room.release()
