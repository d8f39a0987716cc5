"""A generation's end frees its slot before anyone can see the end.

Found by a fresh clone's CI at 06ff096 (`test_an_abort_seen_after_a_restart_ends_the_generation`;
it had passed in two runs before): a generation's state turned terminal in memory, then its row was
journalled, and only after that write did the publisher free its generation slot. A `wait`
woken during the write answered "failed", and the job's next `begin` was refused:
max_generations_in_flight full, by the generation that had just ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

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
