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
from types import SimpleNamespace
from typing import Any

import pytest

from ckptdrain.daemon.ledger import Ledger
from ckptdrain.daemon.records import GenerationRecord, ShardRecord
from ckptdrain.daemon.state import (
    TRANSITIONS,
    UNDRAINED_SHARD,
    GenerationState,
    ShardEvent,
    ShardState,
)
from ckptdrain.daemon.status import refresh_snapshot, shards_draining, status


class RecordingJournal:
    """A journal that writes nothing and records what it was asked to write."""

    def __init__(self) -> None:
        self.writes: list[tuple[Any, ...]] = []

    async def write(self, *statements: Any, before: Any = ()) -> None:
        self.writes.append(statements)


def _shard(ledger: Ledger, gen: GenerationRecord, path: str, size: int) -> ShardRecord:
    return ShardRecord(id=ledger.shard_ids(), job=gen.job, step=gen.step, rank=0, path=path,
                       size=size, staged_name=f"n-{path}", state=ShardState.STAGED,
                       handed_at=1.0, staged_at=float(size))


def _recount(gen: GenerationRecord) -> tuple[dict[Any, int], dict[Any, int], set[int]]:
    by_state = collections.Counter(s.state for s in gen.shards.values())
    size: collections.Counter[Any] = collections.Counter()
    for s in gen.shards.values():
        size[s.state] += s.size
    undrained = {s.id for s in gen.shards.values() if s.state in UNDRAINED_SHARD}
    return dict(by_state), dict(size), undrained


def _tallied(gen: GenerationRecord) -> tuple[dict[Any, int], dict[Any, int], set[int]]:
    return ({st: n for st, n in gen.by_state.items() if n},
            {st: n for st, n in gen.bytes_by_state.items() if gen.by_state[st]},
            set(gen.open_shards))


@pytest.mark.asyncio
async def test_the_tallies_match_a_recount_after_every_move() -> None:
    rng = random.Random(5)
    journal = RecordingJournal()
    ledger = Ledger(journal)  # type: ignore[arg-type]
    gen = GenerationRecord(job="j", step=1, world_size=1, ack="local", created_at=0.0,
                           state=GenerationState.OPEN, attempt="a")
    ledger.generations[gen.key] = gen
    moves = 0
    for i in range(600):
        if not gen.shards or rng.random() < 0.2:
            await ledger.add_shard(gen, _shard(ledger, gen, f"s{i}", rng.randrange(1, 1 << 20)))
        else:
            shard = rng.choice(list(gen.shards.values()))
            events = [e for (st, e) in TRANSITIONS if st is shard.state
                      and isinstance(e, ShardEvent)]
            if not events:
                continue
            event = rng.choice(events)
            fields: dict[str, Any] = {}
            if event is ShardEvent.DRAINED:
                fields["checksum"] = "crc64nvme:" + "0" * 16
            await ledger.apply(shard, event, **fields)
            moves += 1
        assert _tallied(gen) == _recount(gen)
    assert moves > 150 and {s.state for s in gen.shards.values()} >= {
        ShardState.STAGED, ShardState.DRAINING, ShardState.DRAINED, ShardState.FAILED,
        ShardState.DISCARDED}


@pytest.mark.asyncio
async def test_a_refused_shard_leaves_the_tallies_as_they_were() -> None:
    class FailingJournal(RecordingJournal):
        async def write(self, *statements: Any, before: Any = ()) -> None:
            raise OSError("the journal's disk is full")

    ledger = Ledger(FailingJournal())  # type: ignore[arg-type]
    gen = GenerationRecord(job="j", step=1, world_size=1, ack="local", created_at=0.0,
                           state=GenerationState.OPEN, attempt="a")
    ledger.generations[gen.key] = gen
    with pytest.raises(OSError):
        await ledger.add_shard(gen, _shard(ledger, gen, "x", 10))
    assert _tallied(gen) == _recount(gen) == ({}, {}, set())


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
        gen = GenerationRecord(job="j", step=step, world_size=1, ack="local", created_at=0.0,
                               state=GenerationState.OPEN, attempt="a")
        ledger.generations[gen.key] = gen
        for i in range(50):
            await ledger.add_shard(gen, _shard(ledger, gen, f"s{i}", 100 + i))
        for shard in list(gen.shards.values())[:40]:
            await ledger.apply(shard, ShardEvent.DRAIN_STARTED)
            if shard.size % 2:
                await ledger.apply(shard, ShardEvent.DRAINED, checksum="crc64nvme:" + "0" * 16)
        gen.shards = CountedShards(gen.shards)
    d = _daemon(ledger)
    CountedShards.walks = 0
    reply = status(d)  # type: ignore[arg-type]
    refresh_snapshot(d)  # type: ignore[arg-type]
    assert CountedShards.walks == 0
    shown = {(g["job"], g["step"]): g for g in reply["generations"]}
    assert shown[("j", 3)]["shards"] == {"staged": 10, "draining": 20, "drained": 20}
    assert shown[("j", 3)]["bytes"]["staged"] == sum(range(140, 150))
    assert len(reply["shards_draining"]) == 32  # MAX_STATUS_DRAINING of the 400 draining
    assert d.metrics.snapshot.shards_by_state == {"staged": 200, "draining": 400,
                                                  "drained": 400}
    assert shards_draining(list(ledger.generations.values()))[0]["drained_bytes"] == 0


def _daemon(ledger: Ledger) -> SimpleNamespace:
    """What status() and refresh_snapshot() read of a daemon, with a real ledger."""
    from ckptdrain.daemon.config import load_config

    budget = SimpleNamespace(used=0, limit=1, waiting=0)
    metrics = SimpleNamespace(snapshot=None)
    metrics.set_snapshot = lambda snap: setattr(metrics, "snapshot", snap)
    return SimpleNamespace(
        ledger=ledger, node_id="n", started_at=0.0, config=load_config(None),
        metrics_address=None, staging_free=(0, 0), copies=SimpleNamespace(kept_bytes=0),
        admission=SimpleNamespace(staged=budget, memory=budget, shards=budget, waiting=0,
                                  slots_waiting=0),
        scheduler=SimpleNamespace(drain_rate_bytes_per_s=lambda: 0.0, yielded=0),
        dataplane=SimpleNamespace(threads=1, busy=0, stuck=0), draining=0,
        journal=SimpleNamespace(open_uploads={}), metrics=metrics)
