"""A step that fails on one node for a reason of that node's own is ended on every node.

Two schedulers ("nodes") in one process on one memory:// store, world_size 2: rank 1 on
node-b, rank 0 on node-a. Found attacking multi-node commits: node-a's own manifest create
was refused (a destination that refused that node only), after its part record said rank 0
was recorded; node-a told its ranks the step had failed, but left its record as it was (its
failure record was skipped when every rank of its was recorded: "it failed at the commit
itself; the other nodes see the same", which a cause of that node's own is not). node-b,
looking later, found every rank covered and published the step from node-a's record. Every
end that tells this node's ranks the step failed while other nodes may still publish it now
rewrites this node's record with its ranks aborted first, and ends it as committed instead
where the manifest with its part is there (Publisher.end).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from ckptdrain.client.keys import manifest_key, part_key
from ckptdrain.client.manifest import ManifestError, PartRecord, RecordTooLarge
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import Config, DestinationConfig, DrainConfig
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.ledger import GenerationRecord, Ledger
from ckptdrain.daemon.metrics import Metrics
from ckptdrain.daemon.scheduler import Scheduler
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import GenerationState
from tests.functional.test_commit_expiry import manifest_with
from tests.functional.test_scheduler import _staged_generation

JOB = "expiry"  # manifest_with's job


@contextlib.asynccontextmanager
async def node(tmp_path: Path, backend: MemoryBackend, rank: int
               ) -> AsyncIterator[tuple[Scheduler, GenerationRecord]]:
    """A running scheduler for ``backend``'s node, its generation of rank ``rank`` draining.
    Its poller looks only when poked (an hour's interval): each test says when a node looks."""
    name = backend.node_id
    config = Config(node_id=name, socket=tmp_path / f"{name}.sock",
                    staging_dir=tmp_path / name / "staging",
                    destination=DestinationConfig(uri="memory://own-failures"),
                    drain=DrainConfig(commit_poll_interval_s=3600, commit_wait_s=3600,
                                      retry_initial_backoff_s=0.01, retry_budget_s=0.5))
    journal = Journal(tmp_path / name / "journal.sqlite3")
    await journal.open()
    try:
        ledger = Ledger(journal)
        staging = Staging(tmp_path / name / "staging")
        staging.prepare()
        scheduler = Scheduler(
            config=config, ledger=ledger, staging=staging, backend=backend,
            committer=Committer(backend, name), metrics=Metrics(name, "test"),
            on_drained=lambda shard: None, on_terminal=lambda gen: None)
        running = asyncio.create_task(scheduler.run())
        try:
            gen = await _staged_generation(ledger, staging, JOB, rank=rank, world_size=2)
            for shard in gen.shards.values():
                scheduler.enqueue(gen, shard)
            yield scheduler, gen
            assert not running.done(), running
        finally:
            running.cancel()
            await asyncio.wait([running], timeout=10)
    finally:
        await journal.close()


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def record(store: MemoryStore, name: str) -> PartRecord | None:
    data = store.objects.get(part_key(JOB, 1, name))
    return None if data is None else PartRecord.from_json(data)


# Causes of node-a's own: each ends the step along another path (the publish's failures, the
# failure boundary around the commit), and node-b's create would go through.
CAUSES = {
    "refused": BackendError("node-a may not create MANIFEST.json here", kind="auth"),
    "too large": RecordTooLarge("node-a may not create MANIFEST.json here (too large)"),
    "conflict": ManifestError("node-a may not create MANIFEST.json here (a conflict)"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("cause", CAUSES)
async def test_a_step_whose_create_failed_on_one_node_is_never_committed_by_another(
        tmp_path: Path, cause: str) -> None:
    store = MemoryStore()
    a = MemoryBackend("node-a", store=store)
    b = MemoryBackend("node-b", store=store)
    a.inject("put_bytes", CAUSES[cause], key_contains="MANIFEST.json")
    async with node(tmp_path, b, 1) as (b_scheduler, b_gen):
        await until(lambda: b_gen.state is GenerationState.RECORDED, "node-b recorded")
        async with node(tmp_path, a, 0) as (_a_scheduler, a_gen):
            await until(lambda: a_gen.terminal, "node-a ended the step")
            assert a_gen.state is GenerationState.FAILED, a_gen.state
            assert "may not create MANIFEST.json" in (a_gen.error or "")
            # What node-a's ranks heard is what its record says, for every node that looks.
            mine = record(store, "node-a")
            assert mine is not None and (mine.ranks, mine.aborted_ranks) == ((), (0,)), mine
            # node-b looks only now, after node-a's ranks were told the step failed.
            b_scheduler.poke_commits()
            await until(lambda: b_gen.terminal, "node-b ended the step")
            assert b_gen.state is GenerationState.FAILED, b_gen.state
            assert "rank 0 aborted on node 'node-a'" in (b_gen.error or ""), b_gen.error
            assert "may not create MANIFEST.json" in (b_gen.error or ""), b_gen.error
    assert manifest_key(JOB, 1) not in store.objects


@pytest.mark.asyncio
async def test_a_step_another_node_committed_as_this_ones_create_failed_is_committed_here(
        tmp_path: Path) -> None:
    # The race, decided by the manifest: node-b published from node-a's record just before
    # node-a's own create failed. node-a's ranks hear "committed", and its record is left
    # saying "recorded" (a failure record would end a committed step on every node still
    # waiting for it).
    store = MemoryStore()
    a = MemoryBackend("node-a", store=store)
    b = MemoryBackend("node-b", store=store)
    a.inject("put_bytes", BackendError("node-a may not create MANIFEST.json here",
                                       kind="auth"), key_contains="MANIFEST.json")
    written: list[PartRecord] = []

    def on_write(key: str, data: bytes) -> None:
        if key == part_key(JOB, 1, "node-a"):
            written.append(PartRecord.from_json(data))
            if len(written) == 1:  # node-b's create, from node-a's record, as it lands
                store.objects[manifest_key(JOB, 1)] = manifest_with(written[0], "node-b", 1)

    async with node(tmp_path, b, 1) as (_b_scheduler, b_gen):
        await until(lambda: b_gen.state is GenerationState.RECORDED, "node-b recorded")
        store.on_write = on_write
        async with node(tmp_path, a, 0) as (_a_scheduler, a_gen):
            await until(lambda: a_gen.terminal, "node-a ended the step")
            assert a_gen.state is GenerationState.COMMITTED, a_gen.error
            assert a.count("put_bytes", "MANIFEST.json") == 1  # its own create was refused
    assert [(r.ranks, r.aborted_ranks) for r in written] == [((0,), ())]


@pytest.mark.asyncio
async def test_an_end_with_the_commit_point_held_writes_the_record_without_waiting_on_itself(
        tmp_path: Path) -> None:
    # end() takes the commit point for its looks; a caller holding it already (an abort, or a
    # failure path added at the create) must neither wait on itself nor skip the record.
    store = MemoryStore()
    b = MemoryBackend("node-b", store=store)
    async with node(tmp_path, b, 1) as (b_scheduler, b_gen):
        await until(lambda: b_gen.state is GenerationState.RECORDED, "node-b recorded")
        async with asyncio.timeout(10), b_gen.commit_point:
            await b_scheduler.publisher.end(b_gen, "failed at the commit point", kind="internal")
        assert b_gen.state is GenerationState.FAILED, b_gen.state
        mine = record(store, "node-b")
        assert mine is not None and (mine.ranks, mine.aborted_ranks) == ((), (1,)), mine
        assert mine.abort_reason == "failed at the commit point"
