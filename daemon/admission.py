"""Admission: every budget a hand-off draws on, behind one :class:`Reservation` each.

A hand-off reserves what it needs before a byte is accepted: a slot in the job's
``max_generations_in_flight`` for its generation, a ``max_queued_shards`` slot and
``max_staged_bytes`` for a shard on local storage, ``max_memory_bytes`` for a memfd held in
RAM. Each reservation has one owner at a time (the request, then the shard or generation it
became) and is released exactly once; a second release raises.

When ``max_staged_bytes`` is full, local copies that are only a convenience (drained shards
kept for a fast restore) are evicted first, oldest first (see :mod:`.copies`).

What a refusal says (the limit, the wait, what holds the room and what frees it) is
refusals.py's :class:`Refusals`, which :class:`Admission` builds on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.daemon.budget import AccountingError, Budget, BudgetFull, Reservation, TooLarge
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.refusals import Refusals
from ckptdrain.daemon.state import ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.ledger import GenerationRecord, Ledger
    from ckptdrain.daemon.metrics import Metrics


# Shard states that end drained, giving their share back.
_WILL_DRAIN = frozenset({ShardState.HELD, ShardState.STAGED, ShardState.DRAINING})


class Admission(Refusals):
    def __init__(self, config: Config, metrics: Metrics, ledger: Ledger,
                 drain_rate: Callable[[], float]) -> None:
        limits = config.limits
        self.config = config
        self.metrics = metrics
        self.ledger = ledger
        self._drain_rate = drain_rate
        self.staged = Budget("max_staged_bytes", limits.max_staged_bytes)
        self.shards = Budget("max_queued_shards", limits.max_queued_shards)
        self.memory = Budget("max_memory_bytes", limits.max_memory_bytes)
        self._slots: dict[str, Budget] = {}
        # Bytes each uid's hand-offs and shards hold on max_staged_bytes and max_memory_bytes,
        # and the max_queued_shards slots they hold (a uid's share of each, limits.*_per_uid).
        self.uid_bytes: dict[int, int] = {}
        self.uid_shards: dict[int, int] = {}
        # One slot per generation in flight, owned by the generation until it ends.
        self._held: dict[GenerationRecord, Reservation] = {}
        # Frees room on max_staged_bytes by evicting kept local copies (set by the daemon).
        self.make_room: Callable[[int], Awaitable[int]] | None = None
        # What a uid's failed generations hold for `retry` (LocalCopies.held_for_retry: bytes,
        # queue slots, the generations), told to a save they refuse (set by the daemon).
        self.held_for_retry: Callable[[int], tuple[int, int, list[GenerationRecord]]] | None = None
        # on_full = "supersede": ends this job's older generations (set by the daemon).
        self.supersede: Callable[[str, int, Budget, int], Awaitable[bool]] | None = None
        # Set whenever a uid's share is given back: what hand-offs over their share wait on.
        self._share_freed = asyncio.Event()
        # Hand-offs waiting for their uid's share, by the share's limit.
        self.share_waiting: collections.Counter[str] = collections.Counter()
        # Hand-offs past admission and not yet in the ledger, by uid (not deferred ones).
        self._incoming: collections.Counter[int] = collections.Counter()

    def set_limits(self, config: Config) -> None:
        self.config = config
        limits = config.limits
        self.staged.set_limit(limits.max_staged_bytes)
        self.memory.set_limit(limits.max_memory_bytes)
        self.shards.set_limit(limits.max_queued_shards)
        for budget in self._slots.values():
            budget.set_limit(limits.max_generations_in_flight)
        # Shares may have grown (or on_full changed): hand-offs waiting for one look again
        # (a reload raising the share left them waiting out block_timeout_s: found attacking).
        self._share_freed.set()

    # -- generations ---------------------------------------------------------------------------
    def slots(self, job: str) -> Budget:
        budget = self._slots.get(job)
        if budget is None:
            budget = Budget("max_generations_in_flight", self.config.limits.max_generations_in_flight)
            self._slots[job] = budget
        return budget

    def forget_job(self, job: str) -> bool:
        """Drop ``job``'s slot budget; False while a generation holds or waits for a slot."""
        budget = self._slots.get(job)
        if budget is not None and (budget.used or budget.waiting):
            return False
        self._slots.pop(job, None)
        return True

    def hold_generation(self, gen: GenerationRecord, slot: Reservation) -> None:
        """``gen`` takes ``slot`` over until it ends (release_generation, from Ledger.ended).
        A generation that already ended gives it back at once: an abort landing while its
        begin waited on the journal ended it before it held the slot, and nothing would ever
        have freed it (the job refused every begin until a restart)."""
        if gen in self._held or gen.terminal:
            slot.release()
            return
        self._held[gen] = slot

    def adopt_generation(self, gen: GenerationRecord) -> None:
        """Recovery: a generation still in flight holds its slot whatever the limit is now."""
        self.hold_generation(gen, self.slots(gen.job).adopt(1))

    def release_generation(self, gen: GenerationRecord) -> None:
        slot = self._held.pop(gen, None)
        if slot is not None:
            slot.release()

    def holds(self, gen: GenerationRecord) -> bool:
        return gen in self._held

    @property
    def slots_waiting(self) -> int:
        return sum(b.waiting for b in self._slots.values())

    @property
    def waiting(self) -> int:
        return (self.staged.waiting + self.shards.waiting + self.memory.waiting
                + self.slots_waiting + self.share_waiting.total())

    # -- admission ----------------------------------------------------------------------------
    def charge(self, reservation: Reservation, uid: int) -> Reservation:
        """Count ``reservation`` against ``uid``'s share until it is released, or until its
        shard drains (Reservation.settle: a drained shard's kept local copy is not the uid's
        to carry; a failed generation's copies kept for `retry` are: LocalCopies)."""
        if reservation.then is not None:
            # Charged twice, the first charge would never be given back (a uid refused for
            # good): a bug to find, as a double release is.
            raise AccountingError(f"{reservation!r} is already charged to a uid's share")
        reservation.then = self._take_share(self._tally(reservation.budget), uid,
                                            reservation.amount)
        return reservation

    def take_share_with(self, reservation: Reservation, budget: Budget, uid: int,
                        amount: int) -> None:
        """Check and take ``amount`` of ``uid``'s share of ``budget`` now, given back with
        ``reservation`` (released or settled): a share to hold before its room is reserved."""
        self.check_uid_share(uid, amount, budget)
        give_back = self._take_share(self._tally(budget), uid, amount)
        before = reservation.then

        def both() -> None:
            give_back()
            if before is not None:
                before()

        reservation.then = both

    def _tally(self, budget: Budget) -> dict[int, int]:
        return self.uid_shards if budget is self.shards else self.uid_bytes

    def _take_share(self, tally: dict[int, int], uid: int, amount: int) -> Callable[[], None]:
        """Count ``amount`` against ``uid``'s share now; returns what gives it back (and wakes
        the hand-offs waiting for a share)."""
        tally[uid] = tally.get(uid, 0) + amount

        def give_back() -> None:
            left = tally.get(uid, 0) - amount
            if left > 0:
                tally[uid] = left
            else:
                tally.pop(uid, None)
            self._share_freed.set()

        return give_back

    def _share(self, budget: Budget | None) -> tuple[str, int, str]:
        limits = self.config.limits
        if budget is self.shards:
            return "max_queued_shards_per_uid", limits.max_queued_shards_per_uid, "shards"
        return "max_reserved_bytes_per_uid", limits.max_reserved_bytes_per_uid, "bytes"

    def _over_share(self, uid: int, amount: int, budget: Budget | None) -> bool:
        _, cap, _ = self._share(budget)
        return bool(cap) and self._tally(budget or self.staged).get(uid, 0) + amount > cap

    def check_uid_share(self, uid: int, amount: int, budget: Budget | None = None, *,
                        action: str = "rejected") -> None:
        """Refuse at once what would take ``uid`` over its share of ``budget`` (default: the
        bytes). The queue slots have a share of their own: empty shards pass any byte share,
        and one user holding every max_queued_shards slot refused every other user's
        hand-off (found attacking)."""
        if not self._over_share(uid, amount, budget):
            return
        name, cap, what = self._share(budget)
        if amount > cap:
            # Never fits, however much drains: no backpressure (whose retry loop spun for good,
            # found attacking), the refusal a shard larger than a whole node-wide limit gets.
            self.metrics.backpressure(action, name)
            raise RequestError(wire.BAD_REQUEST, f"{amount} {what} exceeds the whole per-uid "
                               f"share limits.{name} of {cap}; raise limits.{name} or split "
                               "the shard", {"limit": name, "limit_value": cap,
                                             "requested": amount})
        held = self._tally(budget or self.staged).get(uid, 0)
        self.metrics.backpressure(action, name)
        waited = " for limits.block_timeout_s" if action == "timed_out" else ""
        details = {"limit": name, "limit_value": cap, "current": held, "requested": amount,
                   "retry_after_s": 1.0}
        kept, advice = self._retry_advice(uid, budget is self.shards)
        if kept:
            details["held_for_retry"] = kept
        raise RequestError(wire.BACKPRESSURE, f"backpressure: uid {uid} already holds {held} "
                           f"{what} on this node{waited} and asks for {amount} more, over "
                           f"limits.{name} ({cap}); "
                           f"{advice or 'wait for its shards to drain or checkpoint less often'}",
                           details)

    async def hold_share(self, uid: int | None, amount: int, budget: Budget,
                         deadline: float | None = None) -> Callable[[], None]:
        """Wait for ``uid``'s share of ``budget`` as :meth:`admit` does and take it now, before
        any other budget is waited for; returns what gives it back (to hand to the room's
        Reservation.then once it is reserved). Taken only at admit, after a queue slot, a
        hand-off woken with others of its uid could wait for the share again holding the slot,
        keeping another user out of a small max_queued_shards (found attacking)."""
        if uid is None:
            return lambda: None
        await self.wait_for_share(uid, amount, budget, deadline)
        return self._take_share(self._tally(budget), uid, amount)

    async def wait_for_share(self, uid: int | None, amount: int, budget: Budget,
                             deadline: float | None = None) -> None:
        """Under on_full = "block", wait until ``deadline`` (:meth:`deadline`) for ``uid``'s own
        shards to drain below its share of ``budget``, as a hand-off waits for room; refuse
        at once under "reject" and "supersede" (no other job's generation gives way to a
        uid's share), and a request larger than the share itself. Refused at once under
        every setting before, a single user's save on a busy node failed where it could have
        waited for its own earlier shards."""
        if uid is None:
            return
        limits = self.config.limits
        name, cap, _ = self._share(budget)
        if (limits.on_full != "block" or amount > cap or not self._over_share(uid, amount, budget)
                or not self._draining_for(uid)):
            self.check_uid_share(uid, amount, budget)
            return
        self.metrics.backpressure("blocked", name)
        self.share_waiting[name] += 1
        try:
            async with asyncio.timeout_at(self._loop_time(deadline)):
                while self._over_share(uid, amount, budget):
                    # A reload made it "reject", or nothing of the uid's drains any more.
                    if self.config.limits.on_full != "block" or not self._draining_for(uid):
                        self.check_uid_share(uid, amount, budget)
                    self._share_freed.clear()
                    await self._share_freed.wait()
        except TimeoutError:
            self.check_uid_share(uid, amount, budget, action="timed_out")
        finally:
            self.share_waiting[name] -= 1

    @contextlib.contextmanager
    def incoming(self, uid: int, deferred: bool) -> Iterator[None]:
        """A hand-off of ``uid``'s, admitted (its share taken) and on its way into the ledger:
        one that will drain (not ``deferred``), so a hand-off over the share waits for it as
        for a staged shard. Counted from the ledger alone, the second of two ranks handing off
        at once was refused at once while the first's bytes were still coming (found
        attacking: every DCP save of a 2-rank job failed on a node with a per-uid share).
        Waiters look again when it ends: landed (it drains), or failed (nothing may drain)."""
        if deferred:
            yield
            return
        self._incoming[uid] += 1
        try:
            yield
        finally:
            self._incoming[uid] -= 1
            if self._incoming[uid] <= 0:
                del self._incoming[uid]
            self._share_freed.set()

    def _draining_for(self, uid: int) -> bool:
        """Whether some shard of ``uid``'s will drain and give its share back: one coming in
        (:meth:`incoming`), or in the ledger. A share held only by deferred shards (drained
        once every rank's are, right before the commit) or failed ones is waited for in vain
        (a rank's second put beside its deferred first waited out block_timeout_s, found in
        CI): refused at once, as before."""
        if self._incoming.get(uid):
            return True
        jobs = self.ledger.jobs
        return any(not s.deferred and s.state in _WILL_DRAIN
                   for g in self.ledger.generations.values()
                   if not g.terminal and jobs.get(g.job) == uid
                   for s in g.undrained())

    def check_uid_generations(self, uid: int) -> None:
        cap = self.config.limits.max_generations_per_uid
        jobs = self.ledger.jobs
        open_now = sum(1 for g in self.ledger.generations.values()
                       if not g.terminal and jobs.get(g.job) == uid)
        if open_now >= cap:
            self.metrics.backpressure("rejected", "max_generations_per_uid")
            raise RequestError(wire.BACKPRESSURE, f"backpressure: uid {uid} already has {open_now} "
                               "uncommitted generations on this node, the most "
                               f"limits.max_generations_per_uid allows ({cap}); wait for them to "
                               "commit or fail", {"limit": "max_generations_per_uid",
                                                  "limit_value": cap, "current": open_now,
                                                  "retry_after_s": 1.0})

    def deadline(self) -> float:
        """When a wait for room that starts now must end (limits.block_timeout_s), on the
        monotonic clock. One request's waits (its uid's share, a queue slot, staging room)
        all end by the one deadline: each with a block_timeout_s of its own, a hand-off
        waited up to three times as long, and its client timed out before the backpressure
        answer came (found attacking the client)."""
        return time.monotonic() + self.config.limits.block_timeout_s

    def _loop_time(self, deadline: float | None) -> float:
        left = (self.deadline() if deadline is None else deadline) - time.monotonic()
        return asyncio.get_running_loop().time() + max(0.0, left)

    async def admit(self, budget: Budget, amount: int, job: str, step: int,
                    uid: int | None = None, deadline: float | None = None) -> Reservation:
        """Reserve ``amount`` of ``budget`` per limits.on_full, or raise the backpressure error.
        Charged to ``uid``'s share of ``budget`` (limits.max_reserved_bytes_per_uid,
        limits.max_queued_shards_per_uid). Every wait ends by ``deadline``
        (default: :meth:`deadline`, taken now)."""
        if deadline is None:
            deadline = self.deadline()
        if uid is None:
            return await self._admit(budget, amount, job, step, deadline)
        # The share is taken with the check, before any wait for room: checked now and charged
        # once admitted, puts queued behind a full budget all passed the check and together
        # held three times the cap (found attacking the per-uid limit). The wait for it ends
        # with the check (nothing awaited in between).
        give_back = await self.hold_share(uid, amount, budget, deadline)
        try:
            room = await self._admit(budget, amount, job, step, deadline)
        except BaseException:
            give_back()
            raise
        room.then = give_back
        return room

    async def _admit(self, budget: Budget, amount: int, job: str, step: int,
                     deadline: float) -> Reservation:
        limits = self.config.limits
        try:
            if budget is self.staged and self.make_room is not None:
                ready = budget.reserve_now(amount)
                if ready is not None:
                    return ready
                await self.make_room(amount)
            if (limits.on_full == "supersede" and self.supersede is not None
                    and await self.supersede(job, step, budget, amount)):
                return Reservation(budget, amount)
            # Counted when it has to wait: a hand-off that waited for room and then got in
            # left no trace on the backpressure panel, only in a gauge a scrape can miss
            # (found attacking the metrics).
            return await budget.reserve(
                amount, block=limits.on_full != "reject",
                timeout_s=max(0.0, deadline - time.monotonic()),
                on_wait=lambda: self.metrics.backpressure("blocked", budget.name))
        except (BudgetFull, TooLarge) as exc:
            raise self.backpressure_error(exc, job) from None
