"""Drain order: jobs take turns; within a job, the oldest generation first. And the failure
boundary: a bug in one generation's drain or commit fails that generation, nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import Config, DestinationConfig, DrainConfig
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.metrics import Metrics
from ckptdrain.daemon.scheduler import FairQueue, Scheduler
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import GenerationState, RankEvent, ShardState


def shard(job: str, step: int, sid: int) -> ShardRecord:
    return ShardRecord(id=sid, job=job, step=step, rank=0, path=f"s{sid}", size=1,
                       staged_name=f"n{sid}", state=ShardState.STAGED, handed_at=0.0, staged_at=0.0)


@pytest.mark.asyncio
async def test_jobs_take_turns_and_old_generations_go_first() -> None:
    q = FairQueue()
    sid = 0
    # job-a has a backlog of two generations; job-b arrives later with one.
    for created, step in ((2.0, 20), (1.0, 10)):
        for _ in range(3):
            sid += 1
            q.put("job-a", (created, sid, sid), shard("job-a", step, sid))
    for _ in range(2):
        sid += 1
        q.put("job-b", (5.0, sid, sid), shard("job-b", 7, sid))
    order = [await q.get() for _ in range(q.qsize())]
    assert [(s.job, s.step) for s in order] == [
        ("job-a", 10), ("job-b", 7), ("job-a", 10), ("job-b", 7),
        ("job-a", 10), ("job-a", 20), ("job-a", 20), ("job-a", 20),
    ]
    assert q.qsize() == 0


@pytest.mark.asyncio
async def test_a_waiting_worker_wakes_on_put() -> None:
    q = FairQueue()
    getter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    assert not getter.done()
    q.put("j", (1.0, 1, 1), shard("j", 1, 1))
    got = await asyncio.wait_for(getter, 5)
    assert got.id == 1


# --- the failure boundary -------------------------------------------------------------------
# In-process, on the in-memory backend: only a fault-injecting fake can make a destination
# call raise something no real backend raises (a bug), which is what the boundary is for.


async def _staged_generation(ledger: Ledger, staging: Staging, job: str, *, rank: int = 0,
                             world_size: int = 1) -> GenerationRecord:
    gen = await ledger.open_generation(job, 1, world_size, "local", uid=0)
    await ledger.open_rank(gen, rank)
    name = staging.new_name(0)
    staging.data_path(name).write_bytes(b"x" * 100)
    now = time.time()
    await ledger.add_shard(gen, ShardRecord(
        id=ledger.shard_ids(), job=job, step=1, rank=rank, path=f"{rank}.bin", size=100,
        staged_name=name, state=ShardState.STAGED, handed_at=now, staged_at=now))
    await ledger.apply((gen, rank), RankEvent.SEALED)
    return gen


@contextlib.asynccontextmanager
async def running_scheduler(
    tmp_path: Path, backend: MemoryBackend, published: list[GenerationRecord] | None = None,
) -> AsyncIterator[tuple[Scheduler, Ledger, Staging, list[GenerationRecord]]]:
    node = backend.node_id
    config = Config(
        node_id=node, socket=tmp_path / "d.sock", staging_dir=tmp_path / "staging",
        destination=DestinationConfig(uri="memory://boundary"),
        drain=DrainConfig(commit_poll_interval_s=0.05, retry_initial_backoff_s=0.01),
    )
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    ledger = Ledger(journal)
    staging = Staging(tmp_path / "staging")
    staging.prepare()
    ended: list[GenerationRecord] = []
    scheduler = Scheduler(
        config=config, ledger=ledger, staging=staging, backend=backend,
        committer=Committer(backend, node), metrics=Metrics(node, "test"),
        on_drained=lambda shard: None, on_terminal=ended.append,
        on_published=(lambda gen: None) if published is None else published.append,
    )
    running = asyncio.create_task(scheduler.run())
    try:
        yield scheduler, ledger, staging, ended
        assert not running.done(), running
    finally:
        running.cancel()
        # Bounded: a scheduler wedged by the bug under test must fail the test, not hang it.
        await asyncio.wait([running], timeout=10)
        await journal.close()


async def drain_all(scheduler: Scheduler, gens: list[GenerationRecord]) -> None:
    for gen in gens:
        for shard in gen.shards.values():
            scheduler.enqueue(gen, shard)
    deadline = time.monotonic() + 15
    while not all(g.terminal for g in gens):
        assert time.monotonic() < deadline, [g.state for g in gens]
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_an_unexpected_error_fails_only_its_generation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend("n0")
    # A bug in the commit step (the part record write) and one in a drain.
    backend.inject("put_bytes", RuntimeError("bug in commit"), key_contains="bad-commit/")
    backend.inject("put_file", RuntimeError("bug in drain"), key_contains="bad-drain/")
    async with running_scheduler(tmp_path, backend) as (scheduler, ledger, staging, ended):
        gens = [await _staged_generation(ledger, staging, job)
                for job in ("bad-commit", "bad-drain", "good")]
        await drain_all(scheduler, gens)
        bad_commit, bad_drain, good = gens
        assert bad_commit.state is GenerationState.FAILED
        assert "RuntimeError: bug in commit" in bad_commit.error
        assert bad_drain.state is GenerationState.FAILED
        assert "RuntimeError: bug in drain" in bad_drain.error
        assert good.state is GenerationState.COMMITTED
        # The end's bookkeeping follows the state change by a journal write.
        deadline = time.monotonic() + 5
        while len(ended) < 3:
            assert time.monotonic() < deadline, ended
            await asyncio.sleep(0.01)
        assert sorted(g.job for g in ended) == ["bad-commit", "bad-drain", "good"]
        tracebacks = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
        assert sorted(str(r.exc_info[1]) for r in tracebacks if r.exc_info) == [
            "bug in commit", "bug in drain"]


@pytest.mark.asyncio
async def test_destination_errors_reading_part_records_are_retried_or_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # The Committer reads part records concurrently: what a read raises arrives wrapped in an
    # ExceptionGroup, and must still count as a destination error, not a bug.
    backend = MemoryBackend("n0")
    backend.inject("get_bytes", BackendError("slow down", transient=True, kind="throttled"),
                   times=3, key_contains="flaky/00000000000000000001/_parts/")
    backend.inject("get_bytes", BackendError("access denied", kind="auth"),
                   key_contains="denied/00000000000000000001/_parts/")
    async with running_scheduler(tmp_path, backend) as (scheduler, ledger, staging, _):
        flaky = await _staged_generation(ledger, staging, "flaky")
        denied = await _staged_generation(ledger, staging, "denied")
        await drain_all(scheduler, [flaky, denied])
        assert flaky.state is GenerationState.COMMITTED
        assert denied.state is GenerationState.FAILED
        assert denied.error.endswith("failed: access denied"), denied.error
        assert not [r for r in caplog.records if r.exc_info], "no traceback for a destination error"


# --- cancellation is never lost ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_paced_drain_cancelled_as_its_wait_ends_is_cancelled() -> None:
    """A stopping daemon cancels its drains. On Python 3.11 asyncio.wait_for drops that
    cancellation when what it waits for completes in the same turn of the loop (here: a rate
    change waking the paced wait), and the drain went on: a stop hung with its parts pacing
    at 1 B/s (seen in the S3 benchmark). Cancel at every point of that turn; each must end
    the wait with CancelledError. (The daemon bans wait_for: ruff TID251.)"""
    from types import SimpleNamespace

    from ckptdrain.daemon.ratelimit import TokenBucket
    from ckptdrain.daemon.yielding import HandoffYield

    cancelled_pending = 0
    for turns in range(8):
        drain = SimpleNamespace(config=Config(), yielding=HandoffYield(),
                                pacer=TokenBucket(1), _pacer_changed=asyncio.Event())
        paced = asyncio.create_task(Scheduler.pace(drain, 10**9))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not paced.done()
        Scheduler.set_bandwidth(drain, 0)  # type: ignore[arg-type]
        for _ in range(turns):
            await asyncio.sleep(0)
        if paced.done():
            continue  # the wait ended before the cancel: nothing to lose
        cancelled_pending += 1
        paced.cancel()
        with pytest.raises(asyncio.CancelledError):
            await paced
    assert cancelled_pending >= 1, "every wait ended before its cancel: nothing tested"


@pytest.mark.asyncio
async def test_only_the_node_whose_create_made_the_manifest_is_told_it_published(
    tmp_path: Path,
) -> None:
    """Retention runs where the manifest was published, not on every node of the job: each
    commit tells exactly one node (whose create made it), however the two nodes' commit
    steps interleave; the other node still ends the generation committed."""
    store = MemoryStore()
    for trial in range(4):
        told: dict[str, list[GenerationRecord]] = {"n0": [], "n1": []}
        job = f"two-nodes-{trial}"
        async with contextlib.AsyncExitStack() as stack:
            gens = []
            for rank, node in enumerate(("n0", "n1")):
                (tmp_path / f"{trial}-{node}").mkdir()
                # The nodes' calls in a seeded order: either may publish.
                backend = MemoryBackend(node, store=store,
                                        interleave=random.Random(trial * 2 + rank))
                scheduler, ledger, staging, _ended = await stack.enter_async_context(
                    running_scheduler(tmp_path / f"{trial}-{node}", backend, told[node]))
                gens.append((scheduler, await _staged_generation(
                    ledger, staging, job, rank=rank, world_size=2)))
            for scheduler, gen in gens:
                for shard in gen.shards.values():
                    scheduler.enqueue(gen, shard)
            deadline = time.monotonic() + 15
            while not all(g.terminal for _s, g in gens) or not (told["n0"] or told["n1"]):
                assert time.monotonic() < deadline, [g.state for _s, g in gens]
                await asyncio.sleep(0.01)
            assert [g.state for _s, g in gens] == [GenerationState.COMMITTED] * 2
            publisher = [node for node, gens_told in told.items() if gens_told]
            assert len(publisher) == 1, told
            assert [(g.job, g.step) for g in told[publisher[0]]] == [(job, 1)]


@pytest.mark.asyncio
async def test_a_failed_latest_write_after_the_create_still_tells_the_publisher(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """LATEST is a hint: when raising it fails right after this node's create made the
    manifest, the commit stays this node's. Before, the publish was retried, found the
    manifest and answered ACCEPTED, and no node ran retention for that commit."""
    backend = MemoryBackend("n0")
    # Refused for good (a permission, a planted link): no retry helps.
    backend.inject("put_bytes", BackendError("403 AccessDenied", kind="auth"), times=10,
                   key_contains="latest-refused/LATEST")
    # Throttled once: the next try raises it.
    backend.inject("put_bytes", BackendError("503 SlowDown", transient=True, kind="throttled"),
                   key_contains="latest-throttled/LATEST")
    told: list[GenerationRecord] = []
    with caplog.at_level(logging.WARNING, logger="ckptdrain.daemon.commit"):
        async with running_scheduler(tmp_path, backend, told) as (scheduler, ledger, staging, _):
            gens = [await _staged_generation(ledger, staging, job)
                    for job in ("latest-refused", "latest-throttled")]
            await drain_all(scheduler, gens)
    assert [g.state for g in gens] == [GenerationState.COMMITTED] * 2
    assert sorted(g.job for g in told) == ["latest-refused", "latest-throttled"]
    assert "latest-refused/LATEST could not be raised" in caplog.text
    assert "latest-throttled/LATEST could not" not in caplog.text
    assert await backend.get_bytes("latest-refused/LATEST") is None
    assert await backend.get_bytes("latest-throttled/LATEST") == b"1\n"


@pytest.mark.asyncio
async def test_a_new_drain_rate_does_not_let_paced_bytes_through(tmp_path: Path) -> None:
    # Found attacking the reload: every SIGHUP made a new token bucket and woke the paced
    # waiters, which then went at once: a reload that lowered the rate, or changed nothing
    # (logrotate, config management), let a capped drain through at full speed. What a
    # waiter still owes is paid at the new rate; only an unlimited rate lets it go.
    async with running_scheduler(tmp_path, MemoryBackend("n1")) as (scheduler, *_):
        scheduler.set_bandwidth(1000)
        waiter = asyncio.create_task(scheduler.pace(1_000_000))  # 1000 s at 1000 B/s

        async def still_paced() -> bool:
            for _ in range(20):  # every wake-up a new rate could cause has run by then
                await asyncio.sleep(0)
            return not waiter.done()

        assert await still_paced()
        scheduler.set_bandwidth(1000)  # a reload that changed nothing
        assert await still_paced()
        scheduler.set_bandwidth(100)  # lowered
        assert await still_paced()
        scheduler.set_bandwidth(2000)  # raised: still 500 s owed
        assert await still_paced()
        scheduler.set_bandwidth(0)  # unlimited: it goes
        async with asyncio.timeout(10):
            await waiter


@pytest.mark.asyncio
async def test_the_directories_prepared_for_generations_are_forgotten_once_they_end(
    tmp_path: Path,
) -> None:
    """Found soaking a daemon through 1,000 generations: the scheduler kept the prefix of
    every generation it ever drained (prepare_prefix's "done" set), one string per generation
    for the daemon's whole life, while everything else a generation holds goes when it ends.
    Committed or failed, an ended generation leaves nothing of it there."""
    backend = MemoryBackend("n0")
    backend.inject("put_file", BackendError("disk on fire", kind="auth"), times=10,
                   key_contains="fails/")
    jobs = [f"job-{i}" for i in range(12)] + ["fails"]
    async with running_scheduler(tmp_path, backend) as (scheduler, ledger, staging, ended):
        gens = [await _staged_generation(ledger, staging, job) for job in jobs]
        await drain_all(scheduler, gens)
        deadline = time.monotonic() + 5
        while len(ended) < len(gens):
            assert time.monotonic() < deadline, ended
            await asyncio.sleep(0.01)
        assert [g.state for g in gens] == [GenerationState.COMMITTED] * 12 + [
            GenerationState.FAILED]
        # Each directory was still prepared once while its generation drained ...
        assert backend.count("prepare_prefix") == len(jobs)
        # ... and none is remembered after.
        assert scheduler._prepared == set()
