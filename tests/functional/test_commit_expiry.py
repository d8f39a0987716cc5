"""A step that drain.commit_wait_s ends on one node is ended on every node.

Two daemons ("nodes") on one file:// destination, world_size 2: rank 0 on node-a, rank 1 on
node-b. Found attacking multi-node commits: node-a waited out its commit_wait_s and told its
ranks the step had failed, but left its part record saying rank 0 was recorded; node-b,
slower, came later, found every rank covered and published MANIFEST.json and LATEST from
node-a's record. The step node-a's ranks heard had failed became the job's latest checkpoint.
node-a now rewrites its record with its ranks aborted before it ends the step, and ends it
as committed instead where the manifest is there already (before it writes that record, or
after: then it writes its record back).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from ckptdrain.client import GenerationFailed
from ckptdrain.client.keys import manifest_key, part_key
from ckptdrain.client.manifest import PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.assembly import build_manifest
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.config import Config, DestinationConfig, DrainConfig
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.latest import parse_latest
from ckptdrain.daemon.ledger import Ledger
from ckptdrain.daemon.metrics import Metrics
from ckptdrain.daemon.scheduler import Scheduler
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import GenerationState
from tests.conftest import DaemonProcess, wait_for
from tests.functional.test_scheduler import _staged_generation

JOB = "expiry"



def seal(d: DaemonProcess, step: int, rank: int, world_size: int = 2) -> None:
    with d.client().generation(JOB, step, rank=rank, world_size=world_size) as g:
        g.put(f"rank{rank}.bin", bytes([rank]) * 1000)


def state(d: DaemonProcess, step: int) -> str:
    for g in d.client().status()["generations"]:
        if (g["job"], g["step"]) == (JOB, step):
            return str(g["state"])
    return "unknown"


def recorded(d: DaemonProcess, step: int) -> None:
    wait_for(lambda: state(d, step) == "recorded", 30, what=f"step {step} recorded")


def part_record(d: DaemonProcess, step: int, node: str) -> PartRecord | None:
    path = d.dest / JOB / f"{step:020d}" / "_parts" / f"{node}.json"
    return PartRecord.from_json(path.read_bytes()) if path.exists() else None


def fails_quickly(d: DaemonProcess, step: int, match: str, within_s: float = 15.0) -> None:
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match=match):
        d.client().wait(JOB, step, timeout_s=within_s)
    assert time.monotonic() - started < within_s


def not_committed(d: DaemonProcess, step: int) -> None:
    assert not (d.dest / JOB / f"{step:020d}" / "MANIFEST.json").exists()
    latest = d.dest / JOB / "LATEST"
    assert parse_latest(latest.read_bytes() if latest.exists() else None) != step


def manifest_with(part: PartRecord, other_node: str, other_rank: int) -> bytes:
    """MANIFEST.json of ``part``'s step as another node's create would have made it: from
    ``part`` and a record of ``other_node`` (never written here, as if retention or an
    operator had since removed it) covering ``other_rank``."""
    entry = ShardEntry(f"rank{other_rank}.bin", 1000, "crc64nvme:" + "0" * 16, other_rank,
                       other_node)
    other = PartRecord(part.job, part.step, part.world_size, other_node, (other_rank,),
                       (entry,), dict(part.clocks), attempt=part.attempt,
                       owner_uid=part.owner_uid)
    return build_manifest([part, other], time.time()).to_json()


def publish_with(d: DaemonProcess, step: int, part: PartRecord, other_node: str,
                 other_rank: int) -> None:
    path = d.dest / JOB / f"{step:020d}" / "MANIFEST.json"
    path.write_bytes(manifest_with(part, other_node, other_rank))


def test_a_step_expired_on_one_node_is_never_committed_by_a_later_one(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="1")
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    fails_quickly(a, 1, r"not committed within drain.commit_wait_s = 1 s")
    seal(b, 1, 1)  # the slow node, after node-a's ranks were told the step failed
    fails_quickly(b, 1, r"rank 0 aborted on node 'node-a': .*expired on node 'node-a' after "
                        r"drain.commit_wait_s = 1 s")
    assert state(b, 1) == "failed"
    not_committed(a, 1)
    # What node-a's ranks heard is what its record says, for every node that comes later.
    record = part_record(a, 1, "node-a")
    assert record is not None and record.ranks == () and record.aborted_ranks == (0,)


def retried_on_node_a_after_it_expired(make_daemon) -> tuple[DaemonProcess, DaemonProcess]:  # type: ignore[no-untyped-def]
    """Step 1 expired on node-a (commit_wait_s 1 s), ended on node-b by node-a's failure
    record, then node-a restarted with time to commit and the step retried there."""
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="1")
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    fails_quickly(a, 1, r"not committed within drain.commit_wait_s = 1 s")
    seal(b, 1, 1)
    fails_quickly(b, 1, r"rank 0 aborted on node 'node-a'")
    a.overrides["CKPTDRAIN_DRAIN__COMMIT_WAIT_S"] = "60"
    assert a.stop() == 0
    a.start()
    a.client().retry(JOB, 1)
    return a, b


def test_a_retry_of_an_expired_step_rewrites_its_record_and_commits(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The failure record is what a `retry` undoes: node-a's record says recorded again, and
    # node-b's retry (it ended the step on node-a's failure record) finds both.
    a, b = retried_on_node_a_after_it_expired(make_daemon)
    wait_for(lambda: (r := part_record(a, 1, "node-a")) is not None and r.ranks == (0,)
             and r.aborted_ranks == (), 30, what="node-a's record rewritten as recorded")
    b.client().retry(JOB, 1)
    assert a.client().wait(JOB, 1, timeout_s=30)["committed"] is True
    assert b.client().wait(JOB, 1, timeout_s=30)["committed"] is True
    assert (a.dest / JOB / f"{1:020d}" / "MANIFEST.json").exists()


def test_a_step_another_nodes_retry_committed_is_committed_for_this_nodes_waiters(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node commits: node-b ended the step on node-a's failure record
    # (its waiters heard "failed"), then `retry` on node-a alone committed it from both
    # records; node-b's waiters still heard "failed, this attempt never will" for a step whose
    # MANIFEST.json and LATEST were there.
    a, b = retried_on_node_a_after_it_expired(make_daemon)
    assert a.client().wait(JOB, 1, timeout_s=30)["committed"] is True
    assert b.client().wait(JOB, 1, timeout_s=5)["committed"] is True


def test_a_step_committed_before_it_expires_here_is_committed_here(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The race, decided by the manifest: another node published from node-a's record before
    # node-a's commit_wait_s ran out, and node-a's own look at the part records cannot tell
    # (node-b's record is gone: removed after the commit). node-a's ranks hear "committed",
    # and its record is left as it was (a failure record there would end the step on every
    # node still waiting for it).
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="600")
    seal(a, 1, 0)
    recorded(a, 1)
    assert a.stop() == 0
    part = part_record(a, 1, "node-a")
    assert part is not None
    publish_with(a, 1, part, "node-b", 1)
    # As if node-a recorded its part 700 s ago: its first poll after the start expires it.
    db = sqlite3.connect(a.staging / "journal.sqlite3")
    db.execute("UPDATE generations SET drained_at = drained_at - 700")
    db.commit()
    db.close()
    a.start()
    assert a.client().wait(JOB, 1, timeout_s=15)["committed"] is True
    assert state(a, 1) == "committed"
    assert part_record(a, 1, "node-a") == part


def test_a_failure_record_landing_after_the_commit_does_not_fail_the_step_elsewhere(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The window the expiry leaves (a node that read the part records just before the
    # failure record landed publishes after it): the manifest is the truth, so a node that
    # then reads the failure record looks for it before it ends the step as aborted.
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="600")
    seal(b, 1, 1)
    recorded(b, 1)
    part = part_record(b, 1, "node-b")
    assert part is not None
    publish_with(b, 1, part, "node-a", 0)
    failure = PartRecord(JOB, 1, 2, "node-a", (), (), dict(part.clocks), attempt=part.attempt,
                         aborted_ranks=(0,), owner_uid=part.owner_uid,
                         abort_reason="the step expired on node 'node-a'")
    (b.dest / JOB / f"{1:020d}" / "_parts" / "node-a.json").write_bytes(failure.to_json())
    assert b.client().wait(JOB, 1, timeout_s=15)["committed"] is True
    assert state(b, 1) == "committed"


@pytest.mark.asyncio
async def test_a_step_published_as_the_failure_record_lands_is_committed_here(
        tmp_path: Path) -> None:
    # The race the other way round, in-process so that it is exact: node-b read node-a's
    # record while it still said "recorded" and created the manifest from it at the instant
    # node-a's failure record landed. node-a's second look finds it: its ranks hear
    # "committed", and its record says "recorded" again (node-c, still waiting, would end
    # a committed step on the failure record).
    store = MemoryStore()
    backend = MemoryBackend("node-a", store=store)
    key = part_key(JOB, 1, "node-a")
    records: list[PartRecord] = []

    def on_write(written: str, data: bytes) -> None:
        if written != key:
            return
        record = PartRecord.from_json(data)
        if record.aborted_ranks and not records[-1].aborted_ranks:
            store.objects[manifest_key(JOB, 1)] = manifest_with(records[-1], "node-b", 1)
        records.append(record)

    store.on_write = on_write
    config = Config(node_id="node-a", socket=tmp_path / "d.sock",
                    staging_dir=tmp_path / "staging",
                    destination=DestinationConfig(uri="memory://expiry"),
                    drain=DrainConfig(commit_poll_interval_s=0.05, commit_wait_s=0.2,
                                      retry_initial_backoff_s=0.01))
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    try:
        ledger = Ledger(journal)
        staging = Staging(tmp_path / "staging")
        staging.prepare()
        scheduler = Scheduler(
            config=config, ledger=ledger, staging=staging, backend=backend,
            committer=Committer(backend, "node-a"), metrics=Metrics("node-a", "test"),
            on_drained=lambda shard: None, on_terminal=lambda gen: None)
        running = asyncio.create_task(scheduler.run())
        try:
            gen = await _staged_generation(ledger, staging, JOB, rank=0, world_size=2)
            for shard in gen.shards.values():
                scheduler.enqueue(gen, shard)
            deadline = time.monotonic() + 15
            # Committed, then its record written back (after the commit point).
            while not gen.terminal or (gen.state is GenerationState.COMMITTED
                                       and len(records) < 3):
                assert time.monotonic() < deadline, (gen.state, records)
                await asyncio.sleep(0.01)
            assert gen.state is GenerationState.COMMITTED, gen.error
            assert [(r.ranks, r.aborted_ranks) for r in records] == [
                ((0,), ()), ((), (0,)), ((0,), ())]
            assert not running.done(), running
        finally:
            running.cancel()
            await asyncio.wait([running], timeout=10)
    finally:
        await journal.close()
