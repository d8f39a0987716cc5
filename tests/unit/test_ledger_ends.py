"""A generation's end frees its slot before anyone can see the end.

Found by a fresh clone's CI at 06ff096 (`test_an_abort_seen_after_a_restart_ends_the_generation`;
it had passed in two runs before): a generation's state turned terminal in memory, then its row was
journalled, and only after that write did the publisher free its generation slot. A `wait`
woken during the write answered "failed", and the job's next `begin` was refused:
max_generations_in_flight full, by the generation that had just ended."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.daemon.journalfaults import JournalFull
from ckptdrain.daemon.ledger import Ledger
from ckptdrain.daemon.records import GenerationRecord
from ckptdrain.daemon.state import GenerationEvent, GenerationState


class HeldJournal:
    """A journal whose writes wait until released, recording what they were asked to write."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.writes: list[tuple[Any, ...]] = []

    async def write(self, *statements: Any, new: bool = False) -> None:
        self.writes.append(statements)
        await self.release.wait()


@pytest.mark.asyncio
@pytest.mark.parametrize("event", [GenerationEvent.FAILED, GenerationEvent.COMMITTED])
async def test_what_a_generation_held_is_freed_before_its_end_is_journalled(
        event: GenerationEvent) -> None:
    journal = HeldJournal()
    ledger = Ledger(journal)  # type: ignore[arg-type]
    ended: list[GenerationRecord] = []
    ledger.ended = ended.append
    gen = GenerationRecord(job="j", step=1, world_size=1, ack="local", created_at=0.0,
                           state=GenerationState.RECORDED, attempt="a")
    ledger.generations[gen.key] = gen
    applying = asyncio.create_task(ledger.apply(gen, event))
    async with asyncio.timeout(10):
        while not journal.writes:
            await asyncio.sleep(0)
    # The row is being written: whoever looks now sees the end, and the slot is free.
    assert gen.terminal
    assert ended == [gen]
    journal.release.set()
    async with asyncio.timeout(10):
        await applying
    assert ended == [gen]


class _RefusingJournal:
    """Holds each write until told how it ends: None (written) or the error to raise."""

    def __init__(self) -> None:
        self.writes: list[tuple[Any, ...]] = []
        self.outcomes: list[asyncio.Future[BaseException | None]] = []

    async def write(self, *statements: Any, new: bool = False) -> None:
        self.writes.append(statements)
        outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.outcomes.append(outcome)
        error = await outcome
        if error is not None:
            raise error


@pytest.mark.asyncio
@pytest.mark.parametrize("second", ["refused", "written"])
async def test_concurrent_begins_of_a_new_job_leave_its_owner_as_the_journal_has_it(
        second: str) -> None:
    # Found reviewing the claim's undo: of two begins of a new job refused together (a full
    # journal), the first saw the second's generation and kept the claim, the second had not
    # claimed it: the job stayed claimed in memory with nothing journalled.
    journal = _RefusingJournal()
    ledger = Ledger(journal)  # type: ignore[arg-type]
    first = asyncio.ensure_future(ledger.open_generation("job", 1, 1, "local", 1000))
    other = asyncio.ensure_future(ledger.open_generation("job", 2, 1, "local", 1000))
    while len(journal.outcomes) < 2:
        await asyncio.sleep(0)
    # Both carry the claim: whichever is written, the job has its owner at the next start.
    assert all(statements[0][0].startswith("INSERT OR IGNORE INTO jobs")
               for statements in journal.writes)
    journal.outcomes[0].set_result(JournalFull(Path("journal")))
    with pytest.raises(JournalFull):
        await first
    journal.outcomes[1].set_result(JournalFull(Path("journal")) if second == "refused" else None)
    if second == "refused":
        with pytest.raises(JournalFull):
            await other
        assert ledger.jobs == {}
    else:
        await other
        assert ledger.jobs == {"job": 1000}
