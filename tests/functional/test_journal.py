"""The journal: durable records in SQLite, group commit of concurrent acknowledgements, and the
ledger's state changes as the journal records them."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from ckptdrain.daemon import journalrows as j
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.journalfaults import JournalError, JournalFull
from ckptdrain.daemon.journalrows import GroupCommit
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    IllegalTransition,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
)


def shard_row(i: int) -> dict[str, object]:
    return {"id": i, "job": "j", "step": 1, "rank": 0, "path": f"s{i}", "size": i,
            "staged_name": f"n{i}", "state": "staged", "checksum": "", "handed_at": 1.0,
            "staged_at": 2.0, "drained_at": None, "error": "", "deferred": False}


@pytest.mark.asyncio
async def test_concurrent_acknowledgements_share_commits(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    fsyncs: list[int] = []
    group = GroupCommit(journal, before=lambda: fsyncs.append(1))
    try:
        await asyncio.gather(*(group(j.put_shard(shard_row(i))) for i in range(1, 101)))
    finally:
        snap = await journal.load()
        await journal.close()
    assert sorted(s["id"] for s in snap.shards) == list(range(1, 101))
    assert 1 <= group.batches < 100, "every acknowledgement paid its own fsyncs"
    assert len(fsyncs) == group.batches


@pytest.mark.asyncio
async def test_a_failed_commit_fails_its_whole_batch_and_the_next_one_works(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    calls = 0

    def before() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(28, "No space left on device")

    group = GroupCommit(journal, before=before)
    try:
        with pytest.raises(OSError, match="No space"):
            await group(j.put_shard(shard_row(1)))
        await group(j.put_shard(shard_row(2)))
        snap = await journal.load()
    finally:
        await journal.close()
    assert [s["id"] for s in snap.shards] == [2]


@pytest.mark.asyncio
async def test_concurrent_writes_share_transactions_in_order(tmp_path: Path) -> None:
    # Every write, not only acknowledgements: a drain of many small shards journals one row
    # per shard, and each used to be a transaction (an fsync of the WAL) of its own.
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    try:
        rows = [shard_row(i) for i in range(1, 201)]
        await asyncio.gather(*(journal.write(j.put_shard(r)) for r in rows))
        # Queued in order: the last write of a row wins, as it did one transaction at a time.
        await asyncio.gather(*(journal.write(j.put_shard({**r, "state": s}))
                               for r in rows[:50] for s in ("draining", "drained")))
        snap = await journal.load()
    finally:
        await journal.close()
    assert sorted(s["id"] for s in snap.shards) == list(range(1, 201))
    assert {s["state"] for s in snap.shards if s["id"] <= 50} == {"drained"}
    assert journal.transactions < 300 // 4, (
        f"{journal.transactions} transactions for 300 writes: they were not batched")


@pytest.mark.asyncio
async def test_a_write_that_fails_in_a_batch_fails_only_itself(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    try:
        bad = ("INSERT INTO no_such_table VALUES (?)", (1,))
        results = await asyncio.gather(
            *(journal.write(j.put_shard(shard_row(i))) for i in range(1, 11)),
            journal.write(j.put_shard(shard_row(11)), bad),
            *(journal.write(j.put_shard(shard_row(i))) for i in range(12, 21)),
            return_exceptions=True)
        snap = await journal.load()
    finally:
        await journal.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and "no_such_table" in str(failed[0])
    # The failed write's statements went together: none of its rows was kept.
    assert sorted(s["id"] for s in snap.shards) == [*range(1, 11), *range(12, 21)]


@pytest.mark.asyncio
async def test_a_cancelled_waiter_does_not_undo_its_write_or_fail_the_others(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    try:
        first = asyncio.ensure_future(journal.write(j.put_shard(shard_row(1))))
        others = [asyncio.ensure_future(journal.write(j.put_shard(shard_row(i))))
                  for i in range(2, 6)]
        await asyncio.sleep(0)  # every task has queued its write
        first.cancel()
        await asyncio.gather(*others)
        snap = await journal.load()
    finally:
        await journal.close()
    assert sorted(s["id"] for s in snap.shards) == [1, 2, 3, 4, 5]


# -- the ledger's state changes, as the journal records them --------------------------------


def new_shard(gen: GenerationRecord, sid: int, *, rank: int = 0, state: ShardState = ShardState.STAGED,
              deferred: bool = False, checksum: str = "") -> ShardRecord:
    return ShardRecord(id=sid, job=gen.job, step=gen.step, rank=rank, path=f"s{sid}", size=sid,
                       staged_name=f"n{sid}", state=state, handed_at=1.0, staged_at=2.0,
                       deferred=deferred, checksum=checksum)


async def reloaded(path: Path) -> Ledger:
    journal = Journal(path)
    await journal.open()
    ledger = Ledger(journal)
    await ledger.load()
    await journal.close()
    return ledger


@pytest.mark.asyncio
async def test_apply_journals_every_lifecycle_and_a_restart_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal(path)
    await journal.open()
    ledger = Ledger(journal)
    try:
        gen = await ledger.open_generation("j", 1, 1, "local", uid=0, attempt="a")
        await ledger.open_rank(gen, 0)
        drained, draining = new_shard(gen, 1), new_shard(gen, 2)
        await ledger.add_shard(gen, drained)
        await ledger.add_shard(gen, draining)
        assert gen.unsettled == {0: 2}
        assert await ledger.apply(drained, ShardEvent.DRAIN_STARTED) is ShardState.DRAINING
        await ledger.apply(drained, ShardEvent.DRAINED, checksum="c1", drained_at=3.0)
        await ledger.apply(draining, ShardEvent.DRAIN_STARTED)
        assert gen.unsettled == {0: 1} and not gen.rank_drained(0)
        assert await ledger.apply((gen, 0), RankEvent.SEALED) is RankState.SEALED
        woke = asyncio.Event()

        changed = ledger.change()

        async def waiter() -> None:
            await changed.wait()
            woke.set()

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        await ledger.apply(gen, GenerationEvent.FAILED, error="boom")
        await asyncio.wait_for(task, 5)
        assert woke.is_set() and gen.terminal
    finally:
        await journal.close()
    again = await reloaded(path)
    gen2 = again.get("j", 1)
    assert gen2 is not None
    assert (gen2.state, gen2.error) == (GenerationState.FAILED, "boom")
    assert gen2.ranks == {0: RankState.SEALED}
    assert gen2.shards["s1"].state is ShardState.DRAINED and gen2.shards["s1"].checksum == "c1"
    # Mid-copy at the crash: on disk only staged, so the restart drains it again.
    assert gen2.shards["s2"].state is ShardState.STAGED
    assert gen2.unsettled == {0: 1}


@pytest.mark.asyncio
async def test_an_illegal_move_raises_and_changes_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    ledger = Ledger(journal)
    try:
        gen = await ledger.open_generation("j", 1, 1, "local", uid=0)
        shard = new_shard(gen, 1)
        await ledger.add_shard(gen, shard)
        with pytest.raises(IllegalTransition, match=r"ShardEvent.DRAINED is not allowed in ShardState.STAGED"):
            await ledger.apply(shard, ShardEvent.DRAINED, checksum="c")
        assert (shard.state, shard.checksum, gen.unsettled) == (ShardState.STAGED, "", {0: 1})
        with pytest.raises(IllegalTransition, match=r"REOPENED is not allowed in GenerationState.OPEN"):
            await ledger.apply(gen, GenerationEvent.REOPENED)
        with pytest.raises(IllegalTransition, match="never began"):
            await ledger.apply((gen, 3), RankEvent.SEALED)
        await ledger.open_rank(gen, 0)
        with pytest.raises(IllegalTransition, match="already began"):
            await ledger.open_rank(gen, 0)
        with pytest.raises(IllegalTransition, match="begins held or staged"):
            await ledger.add_shard(gen, new_shard(gen, 2, state=ShardState.DRAINED))
        with pytest.raises(TypeError):
            await ledger.apply(gen, ShardEvent.DISCARDED)
        with pytest.raises(TypeError, match="'state'"):
            await ledger.apply(shard, ShardEvent.DISCARDED, state=ShardState.DRAINED)
        with pytest.raises(TypeError, match="'erorr'"):
            await ledger.update_generation(gen, erorr="typo")
        snap = await journal.load()
    finally:
        await journal.close()
    assert [s["state"] for s in snap.shards] == ["staged"]
    assert [g["state"] for g in snap.generations] == ["open"]


@pytest.mark.asyncio
async def test_a_replaced_attempt_never_writes_over_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal(path)
    await journal.open()
    ledger = Ledger(journal)
    try:
        old = await ledger.open_generation("j", 1, 1, "local", uid=0, attempt="a")
        await ledger.open_rank(old, 0)
        old_shard = new_shard(old, 1)
        await ledger.add_shard(old, old_shard)
        await ledger.apply(old, GenerationEvent.CANCELLED)
        await ledger.forget(old)
        new = await ledger.open_generation("j", 1, 1, "local", uid=0, attempt="b")
        await ledger.open_rank(new, 0)
        await ledger.add_shard(new, new_shard(new, 2))
        # The old attempt's connection leaves late, and its queued shard is dropped.
        await ledger.apply((old, 0), RankEvent.ABORTED)
        await ledger.apply(old_shard, ShardEvent.DISCARDED)
        assert old.ranks == {0: RankState.ABORTED} and old_shard.state is ShardState.DISCARDED
        assert new.unsettled == {0: 1}
    finally:
        await journal.close()
    again = await reloaded(path)
    gen = again.get("j", 1)
    assert gen is not None and gen.attempt == "b"
    assert gen.ranks == {0: RankState.OPEN}
    assert list(gen.shards) == ["s2"]


@pytest.mark.asyncio
async def test_forgetting_an_old_attempt_late_never_takes_the_new_one(tmp_path: Path) -> None:
    """Forgetting is keyed by the attempt: a second forget of the replaced attempt (retention
    after a replace, say) leaves the new attempt in memory and in the journal, and the old
    attempt's hand-off that finishes late cannot journal a row over the new one's."""
    path = tmp_path / "journal.sqlite3"
    journal = Journal(path)
    await journal.open()
    ledger = Ledger(journal)
    try:
        old = await ledger.open_generation("j", 1, 2, "local", uid=0, attempt="a")
        await ledger.open_rank(old, 0)
        await ledger.add_shard(old, new_shard(old, 1))
        await ledger.apply(old, GenerationEvent.CANCELLED)
        await ledger.forget(old)
        new = await ledger.open_generation("j", 1, 2, "local", uid=0, attempt="b")
        await ledger.open_rank(new, 0)
        await ledger.add_shard(new, new_shard(new, 2))
        await ledger.forget(old)
        assert ledger.get("j", 1) is new
        with pytest.raises(IllegalTransition, match="replaced"):
            late = new_shard(old, 3)
            late.path = "s2"  # the same file name the new attempt already handed off
            await ledger.add_shard(old, late)
        # The journal's own delete is keyed by the attempt too.
        await journal.write(*j.delete_generation("j", 1, "a"))
    finally:
        await journal.close()
    again = await reloaded(path)
    gen = again.get("j", 1)
    assert gen is not None and gen.attempt == "b"
    assert gen.ranks == {0: RankState.OPEN}
    assert list(gen.shards) == ["s2"] and gen.shards["s2"].id == 2


@pytest.mark.asyncio
async def test_deferred_shards_settle_once_their_checksum_is_known(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    ledger = Ledger(journal)
    try:
        gen = await ledger.open_generation("j", 1, 1, "memory", uid=0)
        held = new_shard(gen, 1, state=ShardState.HELD, deferred=True)
        await ledger.add_shard(gen, held)
        assert not gen.rank_drained(0)
        held.checksum = "c"  # computed while writing the memfd to staging
        await ledger.apply(held, ShardEvent.STAGED, staged_at=5.0)
        assert gen.rank_drained(0) and gen.pending_deferred() == [held]
    finally:
        await journal.close()


@pytest.mark.asyncio
async def test_a_drained_batch_is_journalled_in_one_write_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal(path)
    await journal.open()
    ledger = Ledger(journal)
    try:
        gen = await ledger.open_generation("j", 1, 1, "local", uid=0)
        shards = [new_shard(gen, i) for i in range(1, 6)]
        for shard in shards:
            await ledger.add_shard(gen, shard)
        for shard in shards[:4]:
            await ledger.apply(shard, ShardEvent.DRAIN_STARTED, persist=False)
        # One of them is not draining: the whole batch is refused before anything moves.
        with pytest.raises(IllegalTransition):
            await ledger.apply_shards([(s, {"checksum": f"c{s.id}"}) for s in shards],
                                      ShardEvent.DRAINED)
        assert [s.state for s in shards] == [ShardState.DRAINING] * 4 + [ShardState.STAGED]
        before = journal.transactions
        await ledger.apply_shards([(s, {"checksum": f"c{s.id}", "drained_at": 3.0})
                                   for s in shards[:4]], ShardEvent.DRAINED)
        assert journal.transactions == before + 1
        assert gen.unsettled == {0: 1}
    finally:
        await journal.close()
    again = await reloaded(path)
    gen2 = again.get("j", 1)
    assert gen2 is not None
    assert {p: (s.state, s.checksum) for p, s in gen2.shards.items()} == {
        **{f"s{i}": (ShardState.DRAINED, f"c{i}") for i in range(1, 5)},
        "s5": (ShardState.STAGED, "")}


# A full disk, injected: SQLite's own "database or disk is full" from the transaction, for as
# long as the test says. Runs without root (the tmpfs tests in test_staging_full.py need it).

class _FullDisk:
    def __init__(self, journal: Journal) -> None:
        self.full = True
        self.refused = 0
        self._tx = journal._tx
        journal._tx = self.tx  # type: ignore[method-assign]

    def tx(self, statements: object) -> None:
        if self.full:
            self.refused += 1
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
            raise error
        self._tx(statements)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_full_disk_refuses_new_records_at_once_and_keeps_the_rest_waiting(
    tmp_path: Path
) -> None:
    # Found reviewing the first version: a new record in the batch that met the full disk
    # was refused only once room came back (its begin hung meanwhile, holding its slot), and
    # new records queued behind that batch waited, then were written.
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    disk = _FullDisk(journal)
    try:
        happened = asyncio.ensure_future(journal.write(j.put_shard(shard_row(1))))
        new_in_batch = asyncio.ensure_future(journal.write(j.put_shard(shard_row(2)), new=True))
        with pytest.raises(JournalFull):
            await asyncio.wait_for(new_in_batch, timeout=10)
        assert journal.full and not happened.done()  # refused while the other still waits
        with pytest.raises(JournalFull):
            await journal.write(j.put_shard(shard_row(3)), new=True)  # refused without queueing
        disk.full = False
        await asyncio.wait_for(happened, timeout=10)
        assert not journal.full
        await journal.write(j.put_shard(shard_row(4)), new=True)  # room again: taken
        snap = await journal.load()
        assert sorted(row["id"] for row in snap.shards) == [1, 4]
    finally:
        disk.full = False
        await journal.close()


@pytest.mark.asyncio
async def test_a_record_waiting_for_room_gives_up_when_the_journal_closes(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    disk = _FullDisk(journal)
    waiting = asyncio.ensure_future(journal.write(j.put_shard(shard_row(1))))
    while not journal.full:
        await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(journal.close())
    with pytest.raises(JournalError, match="stayed full until the daemon stopped"):
        await asyncio.wait_for(waiting, timeout=10)
    await asyncio.wait_for(closing, timeout=10)
    assert disk.refused >= 2
