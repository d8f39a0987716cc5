"""ack=memory hand-offs: the client's memfd, held and acknowledged at once, then written to
staging in the background (:meth:`HeldHandoffs.persist_held`) while the generation lives.

Apart from handoff.py (the ack=local path, into staging before the answer), which owns the
checks and reservations both paths share; this module owns a held memfd from its hand-off
until it is on local storage: its record lock, its RAM, then its staging room.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.daemon.budget import Budget, BudgetFull, Reservation, TooLarge
from ckptdrain.daemon.dataplane import SourceEnded, kernel_copy
from ckptdrain.daemon.errors import RequestError, StuckIO
from ckptdrain.daemon.handoff import DISK_FULL, close_fds
from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.ranks import still_open
from ckptdrain.daemon.staging import NO_INODES_ADVICE, Staging, StagingFull
from ckptdrain.daemon.state import ShardEvent, ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.handoff import Handoffs

log = logging.getLogger(__name__)


def _copy_held(staging: Staging, src: int, dst: int, size: int, name: str) -> OSError | None:
    """A held memfd's bytes into its staged file, fsynced and renamed into place (blocking: the
    data plane's). An OSError (the disk full) comes back as the result, so that the caller
    still owns ``src`` and may try again: any close of the memfd in this process would drop
    the record lock that keeps the client's pool from reusing it meanwhile."""
    try:
        kernel_copy(src, dst, size)
        staging.finish(dst, name)
    except OSError as exc:
        return exc
    return None


class HeldHandoffs:
    """The ack=memory hand-offs of one daemon (``Daemon.held``)."""

    def __init__(self, handoffs: Handoffs) -> None:
        self.handoffs = handoffs
        self.d = handoffs.d

    async def hold(self, h: ClientHandler, gen: GenerationRecord, rank: int, path: str, size: int,
                   fd: int, deferred: bool) -> dict[str, Any]:
        """Owns ``fd``: on success the background writer closes it after persisting."""
        d = self.d
        started = time.perf_counter()
        memory: Reservation | None = None
        receiving = False
        incoming = contextlib.ExitStack()
        try:
            self.handoffs.check_new_shard(gen, path, size, rank)
            owner = d.ledger.jobs.get(gen.job, h.uid)
            await self.handoffs.check_source(h.uid, fd, path, size, "memfd")
            # Reserved across every await below: a concurrent duplicate is refused.
            gen.reserve_path(path)
            receiving = True
            memory = await h.channel.unless_hung_up(
                d.admission.admit(d.admission.memory, size, gen.job, gen.step, owner),
                "its hand-off waited for memory")
            # Its queue slot is reserved when it is staged, but the owner's share of slots is
            # taken now, with the RAM's, and moves to the slot at staging: only checked here,
            # held memfds got past it until staged (found attacking the share).
            d.admission.take_share_with(memory, d.admission.shards, owner, 1)
            incoming.enter_context(d.admission.incoming(owner, deferred))
            still_open(gen, rank)
            try:
                # Marks the memfd busy for the client's pool until we close it (memfd.py).
                # Never blocking: a client that write-locked its memfd is refused, not waited for.
                fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    raise RequestError(wire.BAD_REQUEST, f"the memfd passed for {path!r} is locked "
                                       "by another process; pass a memfd nobody holds a write lock "
                                       "on") from None
                raise RequestError(wire.BAD_REQUEST, f"the memfd passed for {path!r} cannot be "
                                   f"locked ({exc.strerror}); pass a memfd opened O_RDWR") from None
            shard = ShardRecord(
                id=d.ledger.shard_ids(), job=gen.job, step=gen.step, rank=rank, path=path,
                size=size, staged_name=d.staging.new_name(owner), state=ShardState.HELD,
                handed_at=time.time(), staged_at=time.time(), deferred=deferred,
            )
            await d.ledger.add_shard(gen, shard)
        except BaseException:
            if memory is not None:
                memory.release()
            d.dataplane.close_client_fd(fd, h.uid)
            raise
        finally:
            incoming.close()
            if receiving:
                gen.release_path(path)
        held = memory
        d.supervisor.spawn(lambda: self.persist_held(gen, shard, fd, held),
                           what=f"persist {gen.job}/{gen.step}/{path}", critical=True)
        d.metrics.handoff(gen.job, time.perf_counter() - started, size, "memory")
        return {"path": path, "size": size, "ack": "memory"}

    async def _reserve_while_open(self, gen: GenerationRecord, budget: Budget, amount: int,
                                  timeout_s: float) -> Reservation | None:
        """Wait for room on ``budget``, but only while ``gen`` lives: None as soon as it ends
        (what the waiter holds meanwhile, a memfd's RAM, goes back then, not at the timeout)."""
        outcome: list[Reservation | BaseException] = []

        metrics = self.d.metrics

        async def reserve() -> None:
            try:
                # Counted as any hand-off's wait (found attacking: an acknowledged memory
                # hand-off's waits and time-outs showed nowhere).
                outcome.append(await budget.reserve(
                    amount, block=True, timeout_s=timeout_s,
                    on_wait=lambda: metrics.backpressure("blocked", budget.name)))
            except (BudgetFull, TooLarge) as exc:
                if isinstance(exc, BudgetFull) and exc.timed_out:
                    metrics.backpressure("timed_out", budget.name)
                outcome.append(exc)

        async with asyncio.TaskGroup() as tg:
            waiting = tg.create_task(reserve())
            while not waiting.done():
                changed = self.d.ledger.change()  # taken before looking: no change is missed
                if gen.terminal:
                    waiting.cancel()
                    break
                woken = tg.create_task(changed.wait())
                either: list[asyncio.Future[Any]] = [waiting, woken]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        if not outcome:
            return None  # the generation ended first
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    async def persist_held(self, gen: GenerationRecord, shard: ShardRecord, fd: int,
                           memory: Reservation) -> None:
        """Write an ack=memory shard from its memfd to local storage, then queue it. Owns
        ``fd`` and ``memory``; closing the fd drops our record lock, so the client's pool may
        reuse the memfd only after the bytes are on local storage (or given up)."""
        d = self.d
        limits = d.config.limits
        name = shard.staged_name
        slot: Reservation | None = None
        room: Reservation | None = None
        created = False
        promised = 0
        fd_ours = True
        try:
            slot = await self._reserve_while_open(gen, d.admission.shards, 1,
                                                  limits.block_timeout_s)
            if slot is None:
                return
            await d.copies.make_room(shard.size)
            room = await self._reserve_while_open(gen, d.admission.staged, shard.size,
                                                  limits.block_timeout_s)
            if room is None:
                return
            owner = d.ledger.jobs.get(gen.job)
            if owner is not None:
                # The uid's share moves from the RAM to the staged room, with nothing awaited
                # between: charged both while it was written, it went over the cap (found
                # attacking the per-uid limit).
                memory.settle()
                d.admission.charge(room, owner)
                d.admission.charge(slot, owner)
            # A staging filesystem short of room is waited out, before the copy and during
            # it, up to block_timeout_s: the hand-off is acknowledged and its bytes are only
            # in RAM (found attacking the staging disk: another user's file, written as the
            # copy ran and removed 2 s later, failed the generation for good).
            deadline = time.monotonic() + limits.block_timeout_s
            pause = 0.05
            while True:
                if not await self._disk_room_while_open(gen, shard,
                                                        deadline - time.monotonic()):
                    return
                d.staging.pending_bytes += shard.size  # counted by concurrent hand-offs
                promised = shard.size
                try:
                    created = True
                    dst = await d.dataplane.call(
                        d.staging.open_tmp, name,
                        abandoned=functools.partial(self.handoffs.abandoned_tmp, name=name))
                    try:
                        failed = await d.dataplane.call(
                            _copy_held, d.staging, fd, dst, shard.size, name,
                            cleanup=functools.partial(close_fds, fd, dst))
                    except BaseException:
                        fd_ours = False  # closed by the data plane once its thread returns
                        raise
                    close_fds(dst)
                finally:
                    d.staging.pending_bytes -= promised
                    promised = 0
                if failed is None:
                    break
                if failed.errno not in DISK_FULL or time.monotonic() >= deadline:
                    raise failed
                await d.dataplane.call(d.staging.discard, name)
                created = False
                # A quota (EDQUOT) does not show in statvfs: never copy again at once.
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 1.0)
            close_fds(fd)  # on local storage: the client's pool may reuse the memfd now
            fd_ours = False
            if shard.deferred:
                shard.checksum = await d.dataplane.call(d.staging.checksum, name)
            if gen.terminal or shard.state is not ShardState.HELD:
                return
            await d.ledger.apply(shard, ShardEvent.STAGED, staged_at=time.time())
            d.copies.adopt(shard, room, slot)
            room = slot = None
            created = False
            if shard.deferred:
                await d.scheduler.advance(gen)
            else:
                d.scheduler.enqueue(gen, shard)
        except SourceEnded as exc:
            # The client cut its memfd short after the acknowledgement: its own doing, which
            # fails its generation (the bytes are gone) but pages no operator, as a drain
            # failure did (found attacking: any user could raise pages at will).
            await d.fail(gen, f"the memfd of the memory hand-off {shard.path!r} was changed "
                              f"after it was acknowledged ({exc.strerror}); under ack=memory a "
                              "memfd passed with put_file is the daemon's until it is on local "
                              "storage: use put() to reuse a buffer", kind="aborted")
        except (BudgetFull, TooLarge, OSError, StuckIO) as exc:
            await d.fail(gen, f"could not write the memory hand-off {shard.path!r} to local "
                              f"storage: {exc}", kind="drain")
        except Exception as exc:
            # The failure boundary of an acknowledged memory hand-off, as of a drain: its
            # bytes are lost with it, so the generation fails (a journal write that failed
            # here left it open for good, holding its slot: found attacking a full disk).
            log_event(log, logging.ERROR, "memory_handoff_crashed", job=gen.job, step=gen.step,
                      path=shard.path, exc_info=True)
            d.metrics.internal_error("background")
            await d.fail(gen, f"writing the memory hand-off {shard.path!r} to local storage "
                              f"failed unexpectedly ({type(exc).__name__}: {exc}); the daemon "
                              "log has the traceback", kind="internal")
        finally:
            d.staging.pending_bytes -= promised
            if fd_ours:
                close_fds(fd)
            self.handoffs.give_back(name if created else None, room, slot)
            memory.release()

    async def _disk_room_while_open(self, gen: GenerationRecord, shard: ShardRecord,
                                    timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the staging filesystem to have room for ``shard``, as
        a wait for max_staged_bytes does; False when its generation ended meanwhile, and
        StagingFull once the wait is over. The memory hand-off is already acknowledged: a
        moment's shortage (another user's file, written and removed) failed it at once, for
        good, though it waited on the budget (found attacking the staging disk)."""
        d = self.d
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            if gen.terminal or shard.state is not ShardState.HELD:
                return False
            try:
                # Kept copies make way, as for an ack=local hand-off (they did not here: an
                # acknowledged save failed beside 16 MiB of them, found attacking).
                room = await self.handoffs.room_after_eviction(
                    shard.size, await d.dataplane.call(d.staging.room))
                d.staging.check_room(shard.size, room)
                return True
            except StagingFull as exc:
                if time.monotonic() + pause > deadline:
                    raise
                if pause == 0.05:
                    log_event(log, logging.WARNING, "memory_handoff_waits_for_disk", job=gen.job,
                              step=gen.step, path=shard.path, error=str(exc),
                              action=(NO_INODES_ADVICE if exc.out_of_inodes else
                                      "free space on the staging filesystem")
                              + "; the hand-off waits up to limits.block_timeout_s, then its "
                              "generation fails")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
