"""Batches of small shards: a batch takes whole directories (ranks hand off side by side, so
the queue interleaves their directories, and a batch of the shards right behind the first
gave each directory of a POSIX destination about one shard per batch, each paying its own walk
and directory fsync); and small-shard drains run in a few lanes (Backend.batch_lanes), not
one per drain worker."""

from __future__ import annotations

import asyncio
import builtins
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend
from ckptdrain.daemon.drainqueue import BatchLanes, FairQueue
from ckptdrain.daemon.ledger import Ledger, ShardRecord
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    RankEvent,
    ShardEvent,
    ShardState,
)
from tests.functional.test_scheduler import running_scheduler

BIG = 1 << 40


def shard(sid: int, path: str, *, step: int = 1, size: int = 1) -> ShardRecord:
    return ShardRecord(id=sid, job="j", step=step, rank=0, path=path, size=size,
                       staged_name=f"n{sid}", state=ShardState.STAGED, handed_at=0.0,
                       staged_at=0.0)


def interleaved(q: FairQueue, dirs: int, per_dir: int) -> None:
    """As ranks hand off side by side: r0/s0, r1/s0, ..., r0/s1, r1/s1, ..."""
    sid = 0
    for j in range(per_dir):
        for r in range(dirs):
            sid += 1
            q.put("j", (1.0, sid, sid), shard(sid, f"r{r}/s{j}.bin"))


def dirs_of(shards: list[ShardRecord]) -> list[str]:
    return sorted({s.path.rpartition("/")[0] for s in shards})


@pytest.mark.asyncio
async def test_a_batch_takes_whole_directories_of_ranks_that_handed_off_side_by_side() -> None:
    q = FairQueue()
    interleaved(q, dirs=4, per_dir=10)
    first = await q.get()
    assert first.path == "r0/s0.bin"
    batch = q.take_more(first, 19, BIG, BIG, lambda s: True)
    # The rest of r0, then the directory of the next shard in line (r1), whole.
    assert dirs_of([first, *batch]) == ["r0", "r1"], [s.path for s in batch]
    assert len(batch) == 19
    # What is left still drains oldest first, and counts right.
    assert q.qsize() == 20
    second = await q.get()
    assert second.path == "r2/s0.bin"
    rest = q.take_more(second, 100, BIG, BIG, lambda s: True)
    assert dirs_of([second, *rest]) == ["r2", "r3"] and len(rest) == 19
    assert q.qsize() == 0


@pytest.mark.asyncio
async def test_a_batch_of_directories_with_one_shard_each_still_fills() -> None:
    q = FairQueue()
    interleaved(q, dirs=10, per_dir=1)
    first = await q.get()
    batch = q.take_more(first, 5, BIG, BIG, lambda s: True)
    assert [s.path for s in batch] == [f"r{r}/s0.bin" for r in range(1, 6)]
    assert [(await q.get()).path for _ in range(q.qsize())] == [
        f"r{r}/s0.bin" for r in range(6, 10)]


@pytest.mark.asyncio
async def test_shards_a_batch_cannot_take_stay_queued_in_order() -> None:
    q = FairQueue()
    q.put("j", (1.0, 1, 1), shard(1, "r0/a"))
    q.put("j", (1.0, 2, 2), shard(2, "r0/big", size=100))
    q.put("j", (1.0, 3, 3), shard(3, "r0/other-step", step=2))
    q.put("j", (1.0, 4, 4), shard(4, "r0/unusable"))
    q.put("j", (1.0, 5, 5), shard(5, "r0/b"))
    q.put("j", (1.0, 6, 6), shard(6, "r1/c"))
    first = await q.get()
    batch = q.take_more(first, 10, 50, BIG, lambda s: not s.path.endswith("unusable"))
    # r0's that fit, then r1's (the job's next shard in line is r0/big, which does not fit:
    # the batch stops there, as it did when it took only the shards right behind).
    assert [s.path for s in batch] == ["r0/b"]
    assert [(await q.get()).path for _ in range(q.qsize())] == [
        "r0/big", "r0/other-step", "r0/unusable", "r1/c"]


@pytest.mark.asyncio
async def test_lanes_hold_drains_to_the_limit_and_a_cancelled_waiter_holds_none() -> None:
    limit = 2
    lanes = BatchLanes(lambda: limit)
    release = asyncio.Event()
    inside: list[int] = []
    most = 0

    async def drain(i: int) -> None:
        nonlocal most
        async with lanes.lane():
            inside.append(i)
            most = max(most, lanes.busy)
            await release.wait()
            inside.remove(i)

    tasks = [asyncio.create_task(drain(i)) for i in range(6)]
    while len(inside) < 2:
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert sorted(inside) == [0, 1] and lanes.busy == 2
    tasks[2].cancel()  # a waiter given up: it must neither enter nor keep the others out
    limit = 3  # learnt meanwhile (a network filesystem): read again at the next entry
    release.set()
    async with asyncio.timeout(10):
        await asyncio.gather(*tasks, return_exceptions=True)
    assert tasks[2].cancelled()
    assert all(t.done() and not t.cancelled() for i, t in enumerate(tasks) if i != 2)
    assert most <= 3 and lanes.busy == 0


class _Batching(MemoryBackend):
    """The in-memory destination taking batches, in ``lanes`` at once; it records how many of
    its small-shard writes ran at the same time."""

    batch_shards = 64
    batch_shard_bytes = 1 << 20
    batch_bytes = 16 << 20

    def __init__(self, lanes: int) -> None:
        super().__init__("n0")
        self.lanes = lanes
        self.running = 0
        self.most = 0
        self.batches: list[list[str]] = []

    @property
    def batch_lanes(self) -> int:
        return self.lanes

    async def put_files(
        self, items: builtins.list[tuple[str, int, int]],
    ) -> builtins.list[str | BackendError | None]:
        self.running += 1
        self.most = max(self.most, self.running)
        self.batches.append([key for key, _, _ in items])
        try:
            # Held open a moment, as a real write is: batches allowed to overlap do.
            await asyncio.sleep(0.01)
            return await super().put_files(items)
        finally:
            self.running -= 1


async def _small_generation(ledger: Ledger, staging: Staging, shards: int, dirs: int):  # type: ignore[no-untyped-def]
    gen = await ledger.open_generation("j", 1, 1, "local", uid=0)
    await ledger.open_rank(gen, 0)
    now = time.time()
    for i in range(shards):
        name = staging.new_name(0)
        staging.data_path(name).write_bytes(b"x" * 10)
        await ledger.add_shard(gen, ShardRecord(
            id=ledger.shard_ids(), job="j", step=1, rank=0, path=f"r{i % dirs}/s{i}.bin",
            size=10, staged_name=name, state=ShardState.STAGED, handed_at=now, staged_at=now))
    await ledger.apply((gen, 0), RankEvent.SEALED)
    return gen


@pytest.mark.asyncio
async def test_small_shards_drain_in_the_destinations_lanes_in_whole_directories(
    tmp_path: Path,
) -> None:
    backend = _Batching(lanes=2)
    async with running_scheduler(tmp_path, backend) as (scheduler, ledger, staging, _):
        gen = await _small_generation(ledger, staging, shards=512, dirs=16)
        for s in gen.shards.values():
            scheduler.enqueue(gen, s)
        async with asyncio.timeout(30):
            while not gen.terminal:
                await asyncio.sleep(0.01)
        assert gen.state is GenerationState.COMMITTED, gen.error
    # 8 drain workers (max_concurrency), 2 lanes.
    assert scheduler.config.destination.max_concurrency == 8
    assert 1 <= backend.most <= 2, backend.most
    # All in batches of 64 (a worker that finds no free lane puts its shard back and waits
    # holding none), each into as few directories as the queue allows: 32 shards in each of
    # 16, so two directories a batch, the first one's, then the one next in line.
    assert [len(b) for b in backend.batches] == [64] * 8, [len(b) for b in backend.batches]
    assert [len({k.rpartition("/")[0] for k in b}) for b in backend.batches] == [2] * 8, [
        sorted({k.rpartition("/")[0] for k in b}) for b in backend.batches]


# --- a retry while a cancelled copy still settles ---------------------------------------------


class _Settling(_Batching):
    """Its writes of keys with ``held/`` finish only once released, cancelled or not, as a
    worker thread finishes its call before a cancelled copy returns (PosixBackend._run)."""

    def __init__(self, *, batched: bool) -> None:
        super().__init__(lanes=2)
        if not batched:
            self.batch_shards = 1
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def _settle(self, keys: list[str]) -> None:
        if not any("/held/" in key for key in keys):
            return
        self.reached.set()
        waiting = asyncio.ensure_future(self.release.wait())
        cancelled = False
        while not waiting.done():
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    async def put_files(
        self, items: builtins.list[tuple[str, int, int]],
    ) -> builtins.list[str | BackendError | None]:
        await self._settle([key for key, _, _ in items])
        return await super().put_files(items)

    async def put_file(self, key: str, fd: int, size: int, **kw: Any) -> str:
        await self._settle([key])
        return await super().put_file(key, fd, size, **kw)


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
@pytest.mark.asyncio
async def test_a_retry_while_a_cancelled_copy_still_settles_drains_that_shard_too(
    tmp_path: Path, batched: bool,
) -> None:
    """A failed generation retried at once: a copy its failure cancelled may still be settling
    (its thread finishing the call). The retry queues the shards staged then; the one given
    back after it was staged and never queued, and the generation stayed open for good
    (found attacking: 12-64 shards left staged, nothing draining)."""
    backend = _Settling(batched=batched)
    backend.inject("put_file", BackendError("Not a directory", kind="io"), key_contains="/bad/")
    async with running_scheduler(tmp_path, backend) as (scheduler, ledger, staging, _):
        gen = await ledger.open_generation("j", 1, 1, "local", uid=0)
        await ledger.open_rank(gen, 0)
        now = time.time()
        # The bad shard drains on its own (over the batch size), the held ones in a batch or
        # one by one.
        for path, size in (("held/a.bin", 10), ("held/b.bin", 10), ("bad/c.bin", 2 << 20)):
            name = staging.new_name(0)
            staging.data_path(name).write_bytes(b"x" * size)
            await ledger.add_shard(gen, ShardRecord(
                id=ledger.shard_ids(), job="j", step=1, rank=0, path=path, size=size,
                staged_name=name, state=ShardState.STAGED, handed_at=now, staged_at=now))
        await ledger.apply((gen, 0), RankEvent.SEALED)
        for s in gen.shards.values():
            scheduler.enqueue(gen, s)
        async with asyncio.timeout(15):
            await backend.reached.wait()
            while gen.state is not GenerationState.FAILED:
                await asyncio.sleep(0.01)
        assert "Not a directory" in gen.error
        held = [s for s in gen.shards.values() if s.path.startswith("held/")]
        assert any(s.state is ShardState.DRAINING for s in held), "no copy settling: nothing tested"
        # What `ckptdrain retry` does (maintenance.retry).
        await ledger.apply(gen, GenerationEvent.RETRIED, error="")
        for s in gen.shards.values():
            if s.state is ShardState.FAILED:
                await ledger.apply(s, ShardEvent.RETRIED, error="")
            if s.state is ShardState.STAGED:
                scheduler.enqueue(gen, s)
        backend.release.set()
        async with asyncio.timeout(15):
            while gen.state is not GenerationState.COMMITTED:
                assert not gen.terminal, gen.error
                await asyncio.sleep(0.01)
        assert all(s.state is ShardState.DRAINED for s in gen.shards.values())


@pytest.mark.asyncio
async def test_a_shard_queued_twice_is_queued_once() -> None:
    """A failed generation's shards stay queued until a worker finds them no longer
    drainable, and a retry queues them again: one batch then took the same shard twice and
    failed the retried generation as an internal error (found attacking)."""
    q = FairQueue()
    first = shard(1, "r0/a")
    q.put("j", (1.0, 1, 1), first)
    q.put("j", (1.0, 2, 2), shard(2, "r0/b"))
    q.put("j", (1.0, 1, 3), first)
    assert q.qsize() == 2
    got = await q.get()
    assert got is first
    assert [s.path for s in q.take_more(got, 10, BIG, BIG, lambda s: True)] == ["r0/b"]
    assert q.qsize() == 0
    q.put("j", (1.0, 1, 4), first)  # queued again once it left: it is queued
    assert q.qsize() == 1


class _HeldFirst(_Batching):
    """Its first put_files call waits until released: a copy in flight."""

    def __init__(self) -> None:
        super().__init__(lanes=2)
        self.first = asyncio.Event()
        self.release = asyncio.Event()

    async def put_files(
        self, items: builtins.list[tuple[str, int, int]],
    ) -> builtins.list[str | BackendError | None]:
        if not self.first.is_set():
            self.first.set()
            await self.release.wait()
        return await super().put_files(items)


@pytest.mark.parametrize("retried", [True, False], ids=["retried", "failed-only"])
@pytest.mark.asyncio
async def test_a_batch_taken_before_the_owner_check_is_looked_at_again_after_it(
    tmp_path: Path, retried: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker takes a batch, then awaits the owner check (a read at the destination, in a
    thread, retried on transient errors). Meanwhile the generation failed: the worker wrote
    the batch anyway. Or it failed and was retried, and another worker took the shards again:
    the first one's DRAIN_STARTED failed the retried generation as internal, and its give-back
    staged the other's copy in flight (found attacking)."""
    backend = _HeldFirst()
    async with running_scheduler(tmp_path, backend) as (scheduler, ledger, staging, _):
        checking, answer = asyncio.Event(), asyncio.Event()
        checks = 0

        async def owner_check(gen: Any, *, again: bool = False) -> bool:
            nonlocal checks
            checks += 1
            if checks == 1:  # the first worker's, still in its thread
                checking.set()
                await answer.wait()
            return False

        batches_done: list[int] = []
        drain_batch = scheduler._drain_batch

        async def counted(gen: Any, shards: list[ShardRecord]) -> None:
            try:
                await drain_batch(gen, shards)
            finally:
                batches_done.append(len(shards))

        scheduler.publisher.ended_if_foreign = owner_check  # type: ignore[method-assign]
        scheduler._drain_batch = counted  # type: ignore[method-assign]
        gen = await ledger.open_generation("j", 1, 1, "local", uid=0)
        await ledger.open_rank(gen, 0)
        now = time.time()
        for path in ("r0/a.bin", "r0/b.bin"):
            name = staging.new_name(0)
            staging.data_path(name).write_bytes(b"x" * 10)
            await ledger.add_shard(gen, ShardRecord(
                id=ledger.shard_ids(), job="j", step=1, rank=0, path=path, size=10,
                staged_name=name, state=ShardState.STAGED, handed_at=now, staged_at=now))
        await ledger.apply((gen, 0), RankEvent.SEALED)
        for s in gen.shards.values():
            scheduler.enqueue(gen, s)
        async with asyncio.timeout(10):
            await checking.wait()  # the first worker holds [a, b]
        await scheduler.fail_generation(gen, "another shard failed", kind="drain")
        if retried:  # what `ckptdrain retry` does (maintenance.retry)
            await ledger.apply(gen, GenerationEvent.RETRIED, error="")
            for s in gen.shards.values():
                if s.state is ShardState.STAGED:
                    scheduler.enqueue(gen, s)
            async with asyncio.timeout(10):
                await backend.first.wait()  # a second worker copies [a, b]
            assert [s.state for s in gen.shards.values()] == [ShardState.DRAINING] * 2
        answer.set()
        async with asyncio.timeout(10):
            while not batches_done:  # the first worker's batch, the second's being held
                await asyncio.sleep(0.01)
        backend.release.set()
        if retried:
            async with asyncio.timeout(10):
                while gen.state is not GenerationState.COMMITTED:
                    assert not gen.terminal, gen.error
                    await asyncio.sleep(0.01)
            assert [len(b) for b in backend.batches] == [2], backend.batches
        else:
            assert gen.state is GenerationState.FAILED
            assert backend.batches == [], "a batch of an ended generation was written"
        assert "drain_crashed" not in caplog.text
