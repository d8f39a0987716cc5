"""A generation's tallies (shards and bytes per state, the undrained shards) follow every move
the ledger makes, and `status` reads them instead of walking shards.

Found while measuring the `hostile` benchmark: a `status` reply cost the event loop 2.5-3.6 ms
with 600 generations in memory, because it walked every shard of every generation (the
summary's counts, the oldest undrained age, the shards draining) whoever asked; a
100,000-shard generation made every `status` from any local user that many steps on the loop.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptdrain.daemon import maintenance
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.ledger import Ledger
from ckptdrain.daemon.records import GenerationRecord, ShardRecord
from ckptdrain.daemon.state import (
    TRANSITIONS,
    UNDRAINED_SHARD,
    GenerationState,
    IllegalTransition,
    ShardEvent,
    ShardState,
)
from ckptdrain.daemon.status import refresh_snapshot, status


class RecordingJournal:
    """A journal that writes nothing and records what it was asked to write."""

    def __init__(self) -> None:
        self.writes: list[tuple[Any, ...]] = []

    async def write(self, *statements: Any, before: Any = (), new: bool = False) -> None:
        self.writes.append(statements)


def _shard(ledger: Ledger, gen: GenerationRecord, path: str, size: int, *,
           state: ShardState = ShardState.STAGED, deferred: bool = False) -> ShardRecord:
    return ShardRecord(id=ledger.shard_ids(), job=gen.job, step=gen.step, rank=size % 3,
                       path=path, size=size, staged_name=f"n-{path}", state=state,
                       handed_at=1.0, staged_at=float(size), deferred=deferred)


def _recount(gen: GenerationRecord) -> tuple[Any, ...]:
    by_state = collections.Counter(s.state for s in gen.shards.values())
    size: collections.Counter[Any] = collections.Counter()
    unsettled: collections.Counter[int] = collections.Counter()
    for s in gen.shards.values():
        size[s.state] += s.size
        if not s.settled:
            unsettled[s.rank] += 1
    undrained = {s.id: s for s in gen.shards.values() if s.state in UNDRAINED_SHARD}
    return dict(by_state), dict(size), undrained, dict(unsettled)


def _tallied(gen: GenerationRecord) -> tuple[Any, ...]:
    # Zero entries are dropped on both sides, bytes included: a byte count left behind in a
    # state with no shards would show here.
    return ({st: n for st, n in gen.by_state.items() if n},
            {st: n for st, n in gen.bytes_by_state.items() if n},
            dict(gen.open_shards),
            {r: n for r, n in gen.unsettled.items() if n})


def _indexed(ledger: Ledger) -> dict[int, tuple[int, int]]:
    every = {s.id: (id(g), id(s)) for g in ledger.generations.values()
             for s in g.shards.values()}
    assert {sid: (id(g), id(s)) for sid, (g, s) in ledger.shard_index.items()} == every
    return every


@pytest.mark.asyncio
async def test_the_tallies_match_a_recount_after_every_move_and_after_a_replay(
        tmp_path: Path) -> None:
    rng = random.Random(5)
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    ledger = Ledger(journal)
    gen = await ledger.open_generation("j", 1, 1, "local", uid=1000, attempt="a")
    moves = 0
    for i in range(600):
        if not gen.shards or rng.random() < 0.2:
            state = rng.choice([ShardState.HELD, ShardState.STAGED])
            await ledger.add_shard(gen, _shard(ledger, gen, f"d{i % 7}/s{i}",
                                               rng.randrange(1, 1 << 20), state=state,
                                               deferred=rng.random() < 0.2))
        else:
            shard = rng.choice(list(gen.shards.values()))
            events = [e for (st, e) in TRANSITIONS if st is shard.state
                      and isinstance(e, ShardEvent)]
            if not events:
                continue
            event = rng.choice(events)
            fields: dict[str, Any] = {}
            if event is ShardEvent.DRAINED or (shard.deferred and rng.random() < 0.5):
                fields["checksum"] = "crc64nvme:" + "0" * 16
            if event is ShardEvent.STAGED:
                fields["staged_at"] = float(i)
            if event is ShardEvent.DRAIN_FAILED:
                fields["error"] = "x" * 5000  # capped: the bracket must survive it
            await ledger.apply(shard, event, persist=rng.random() < 0.9, **fields)
            moves += 1
        assert _tallied(gen) == _recount(gen)
        _indexed(ledger)
    assert moves > 150 and {s.state for s in gen.shards.values()} >= {
        ShardState.HELD, ShardState.STAGED, ShardState.DRAINING, ShardState.DRAINED,
        ShardState.FAILED, ShardState.DISCARDED}
    await journal.close()

    # A restarted daemon's ledger, rebuilt from the journal, tallies the same way.
    again = Journal(tmp_path / "journal.sqlite3")
    await again.open()
    try:
        replayed = Ledger(again)
        await replayed.load()
        loaded = replayed.get("j", 1)
        assert loaded is not None and len(loaded.shards) > 50
        assert _tallied(loaded) == _recount(loaded)
        assert len(_indexed(replayed)) == len(loaded.shards)
        await replayed.forget(loaded)
        assert replayed.shard_index == {}
    finally:
        await again.close()


@pytest.mark.asyncio
async def test_a_refused_or_duplicate_shard_leaves_the_tallies_as_they_were() -> None:
    class FailingJournal(RecordingJournal):
        async def write(self, *statements: Any, before: Any = (), new: bool = False) -> None:
            raise OSError("the journal's disk is full")

    ledger = Ledger(FailingJournal())  # type: ignore[arg-type]
    gen = GenerationRecord(job="j", step=1, world_size=1, ack="local", created_at=0.0,
                           state=GenerationState.OPEN, attempt="a")
    ledger.generations[gen.key] = gen
    with pytest.raises(OSError):
        await ledger.add_shard(gen, _shard(ledger, gen, "x", 10))
    assert _tallied(gen) == _recount(gen) == ({}, {}, {}, {})
    assert ledger.shard_index == {}

    ok = Ledger(RecordingJournal())  # type: ignore[arg-type]
    ok.generations[gen.key] = gen
    await ok.add_shard(gen, _shard(ok, gen, "x", 10))
    with pytest.raises(IllegalTransition, match="already holds"):
        await ok.add_shard(gen, _shard(ok, gen, "x", 99))
    assert _tallied(gen) == _recount(gen)
    assert gen.bytes_by_state[ShardState.STAGED] == 10


class CountedShards(dict[str, ShardRecord]):
    """A generation's shards that count how often they are walked."""

    walks = 0

    def values(self) -> Any:
        CountedShards.walks += 1
        return super().values()

    def __iter__(self) -> Any:
        CountedShards.walks += 1
        return super().__iter__()

    def items(self) -> Any:
        CountedShards.walks += 1
        return super().items()


@pytest.mark.asyncio
async def test_status_and_the_metrics_snapshot_walk_no_generations_shards() -> None:
    journal = RecordingJournal()
    ledger = Ledger(journal)  # type: ignore[arg-type]
    for step in range(20):
        gen = GenerationRecord(job="j" if step < 19 else "other", step=step, world_size=1,
                               ack="local", created_at=0.0, state=GenerationState.OPEN,
                               attempt="a")
        ledger.generations[gen.key] = gen
        for i in range(50):
            await ledger.add_shard(gen, _shard(ledger, gen, f"s{i}", 100 + i + step))
        for shard in list(gen.shards.values())[:40]:
            await ledger.apply(shard, ShardEvent.DRAIN_STARTED)
            if shard.size % 2:
                await ledger.apply(shard, ShardEvent.DRAINED, checksum="crc64nvme:" + "0" * 16)
    j3, other = ledger.get("j", 3), ledger.get("other", 19)
    assert j3 is not None and other is not None
    draining = next(s for s in j3.shards.values() if s.state is ShardState.DRAINING)
    dropped = next(s for s in j3.shards.values() if s.state is ShardState.DRAINED)
    await ledger.apply(dropped, ShardEvent.DISCARDED)  # its upload's abort was left to a sweep
    hidden = next(s for s in other.shards.values() if s.state is ShardState.DRAINING)
    for gen in ledger.generations.values():
        gen.shards = CountedShards(gen.shards)
    d = _daemon(ledger)
    d.journal.open_uploads = {draining.id: ("u-draining", 100.0), dropped.id: ("u-dropped", 50.0),
                              hidden.id: ("u-hidden", 10.0), 999_999: ("u-forgotten", 1.0)}
    CountedShards.walks = 0
    reply = status(d, job="j")  # type: ignore[arg-type]
    refresh_snapshot(d)  # type: ignore[arg-type]
    left = maintenance.report(d)["left"]  # type: ignore[arg-type]
    assert CountedShards.walks == 0
    every = [s for g in ledger.generations.values() for s in dict.values(g.shards)]
    undrained = [s for s in every if s.state in (ShardState.STAGED, ShardState.DRAINING)]
    assert left["shards_undrained"] == len(undrained) == 600
    assert left["bytes_undrained"] == sum(s.size for s in undrained)
    shown = {(g["job"], g["step"]): g for g in reply["generations"]}
    assert shown[("j", 3)]["shards"] == {"staged": 10, "draining": 20, "drained": 19,
                                         "discarded": 1}
    assert shown[("j", 3)]["bytes"]["staged"] == sum(range(143, 153))
    # Oldest first (staged_at is the size here); another job's shards are not shown to "j".
    listed = reply["shards_draining"]
    assert len(listed) == 32 and {s["job"] for s in listed} == {"j"}
    assert [s["size"] for s in listed] == sorted(s["size"] for s in listed)
    assert listed[0]["size"] == 100
    # Open uploads: found by shard id, whatever the shard's state, only the asker's jobs'; an
    # id no shard held names any more is dropped.
    assert [(u["upload_id"], u["state"]) for u in reply["uploads_open"]] == [
        ("u-dropped", "discarded"), ("u-draining", "draining")]
    assert set(d.journal.open_uploads) == {draining.id, dropped.id, hidden.id}
    assert d.metrics.snapshot.shards_by_state == {"staged": 200, "draining": 400,
                                                  "drained": 399, "discarded": 1}


def _daemon(ledger: Ledger) -> SimpleNamespace:
    """What status() and refresh_snapshot() read of a daemon, with a real ledger."""
    from ckptdrain.daemon.configload import load_config

    budget = SimpleNamespace(used=0, limit=1, waiting=0)
    metrics = SimpleNamespace(snapshot=None)
    metrics.set_snapshot = lambda snap: setattr(metrics, "snapshot", snap)
    return SimpleNamespace(
        ledger=ledger, node_id="n", started_at=0.0, started_mono=0.0, config=load_config(None),
        metrics_address=None, staging_free=(0, 0), staged_limit_clamped_from=None, copies=SimpleNamespace(kept_bytes=0, pinned_bytes=0),
        admission=SimpleNamespace(staged=budget, memory=budget, shards=budget, waiting=0,
                                  slots_waiting=0, share_waiting={}),
        scheduler=SimpleNamespace(drain_rate_bytes_per_s=lambda: 0.0,
                                  yielding=SimpleNamespace(yielded=0)),
        dataplane=SimpleNamespace(threads=1, busy=0, stuck=0), draining=0,
        journal=SimpleNamespace(open_uploads={}), metrics=metrics,
        reloads=SimpleNamespace(failed=None, needs_restart=[]))
