"""UploadAborts (owedaborts.py): an abort that failed is owed and tried again with backoff
until it is done; one try stands for all while the destination is down; a shard a retry
drains again is never aborted, and a drain waits for an abort of it in flight."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from ckptdrain.daemon import owedaborts
from ckptdrain.daemon.backends.base import BackendError, UploadLog
from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord
from ckptdrain.daemon.owedaborts import UploadAborts
from ckptdrain.daemon.state import GenerationState, ShardState


class Log:
    """One shard's journalled upload, in memory."""

    def __init__(self, upload_id: str | None) -> None:
        self.upload_id = upload_id

    async def load(self) -> tuple[str | None, dict[int, tuple[str, str]]]:
        return self.upload_id, {}

    async def begun(self, upload_id: str) -> None:
        self.upload_id = upload_id

    async def part_done(self, number: int, etag: str, checksum: str) -> None:
        pass

    async def finished(self) -> None:
        self.upload_id = None

    def is_open(self) -> bool:
        return self.upload_id is not None


class Destination:
    """abort_upload fails while ``down``; ``hold`` keeps a try in flight until set."""

    def __init__(self) -> None:
        self.down = True
        self.tries: list[str] = []
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def abort_upload(self, key: str, upload_log: UploadLog) -> bool:
        upload_id, _ = await upload_log.load()
        self.tries.append(str(upload_id))
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.down:
            raise BackendError("connection refused", transient=True)
        await upload_log.finished()
        return True


def failed(path: str, shard_id: int) -> tuple[GenerationRecord, ShardRecord]:
    now = time.time()
    gen = GenerationRecord("job", 1, 1, "local", now, state=GenerationState.FAILED)
    shard = ShardRecord(shard_id, "job", 1, 0, path, 1, f"s{shard_id}", ShardState.FAILED,
                        now, now)
    gen.shards[path] = shard
    return gen, shard


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owedaborts, "FIRST_RETRY_S", 0.05)
    monkeypatch.setattr(owedaborts, "MAX_RETRY_S", 0.2)


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_an_abort_that_failed_is_owed_and_done_once_the_destination_answers() -> None:
    async def main() -> None:
        dest = Destination()
        logs = {1: Log("u1"), 2: Log("u2")}
        aborts = UploadAborts(dest, lambda s: logs[s.id])  # type: ignore[arg-type]
        (g1, s1), (g2, s2) = failed("a", 1), failed("b", 2)
        assert not await aborts.abort(g1, s1)
        assert not await aborts.abort(g2, s2)
        assert aborts.owed == 2 and dest.tries == ["u1", "u2"]
        loop = asyncio.create_task(aborts.run())
        try:
            # Down: one try at a time stands for every owed abort, at a growing interval,
            # each in turn (the one tried longest ago first).
            await until(lambda: len(dest.tries) >= 6)
            again = dest.tries[2:6]
            assert aborts.owed == 2 and set(again) == {"u1", "u2"}
            assert all(a != b for a, b in itertools.pairwise(again))
            dest.down = False
            await until(lambda: aborts.owed == 0)
            assert logs[1].upload_id is None and logs[2].upload_id is None
        finally:
            loop.cancel()
    asyncio.run(main())


def test_a_retried_shard_is_not_aborted_and_its_drain_waits_for_an_abort_in_flight() -> None:
    async def main() -> None:
        dest = Destination()
        log = Log("u1")
        aborts = UploadAborts(dest, lambda s: log)  # type: ignore[arg-type]
        gen, shard = failed("a", 1)
        assert not await aborts.abort(gen, shard)
        dest.hold = asyncio.Event()
        dest.entered.clear()
        dest.down = False
        loop = asyncio.create_task(aborts.run())
        try:
            await asyncio.wait_for(dest.entered.wait(), 10)
            # `ckptdrain retry` now: the abort in flight ends before the drain sends.
            gen.state, shard.state = GenerationState.OPEN, ShardState.STAGED
            drain = asyncio.create_task(aborts.settled(shard))
            await asyncio.sleep(0.05)
            assert not drain.done()
            dest.hold.set()
            await asyncio.wait_for(drain, 10)
            assert log.upload_id is None  # aborted: the drain begins a new upload
            # And owed no more: a shard being drained is never aborted.
            log.upload_id = "u2"
            dest.hold = None
            assert not await aborts.abort(gen, shard)
            assert aborts.owed == 0 and log.upload_id == "u2" and dest.tries[-1] == "u1"
        finally:
            loop.cancel()
    asyncio.run(main())


class Refusing(Destination):
    """Up, but the abort of ``refused`` is refused every time (a bucket policy denying it on
    that key, or a store that keeps listing that one upload)."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused

    async def abort_upload(self, key: str, upload_log: UploadLog) -> bool:
        upload_id, _ = await upload_log.load()
        self.down = upload_id == self.refused
        return await super().abort_upload(key, upload_log)


def test_an_abort_refused_forever_does_not_hold_back_the_others() -> None:
    # Found attacking: the oldest owed abort was tried first at every round, and its failure
    # put every other off to its next try, so one upload whose abort was always refused kept
    # every other owed upload open for good, the destination answering them all along.
    async def main() -> None:
        dest = Refusing("u1")
        logs = {n: Log(f"u{n}") for n in (1, 2, 3)}
        aborts = UploadAborts(dest, lambda s: logs[s.id])  # type: ignore[arg-type]
        owed = [failed(f"p{n}", n) for n in (1, 2, 3)]
        for gen, shard in owed:
            aborts.owe(gen, shard, f"u{shard.id}")
        dest.down = True  # the first round: the destination down for all of them
        loop = asyncio.create_task(aborts.run())
        try:
            await until(lambda: logs[2].upload_id is None and logs[3].upload_id is None,
                        timeout_s=5)
            assert aborts.owed == 1 and logs[1].upload_id == "u1"
        finally:
            loop.cancel()
    asyncio.run(main())


class Record:
    """The journal's owed_aborts, in memory."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, int, str]] = {}

    async def owe(self, upload_id: str, job: str, step: int, path: str) -> None:
        self.rows[upload_id] = (job, step, path)

    async def done(self, upload_id: str) -> None:
        del self.rows[upload_id]


def test_an_owed_abort_is_recorded_until_done_or_taken_by_a_retry() -> None:
    async def main() -> None:
        dest = Destination()
        logs = {1: Log("u1"), 2: Log("u2")}
        aborts = UploadAborts(dest, lambda s: logs[s.id])  # type: ignore[arg-type]
        record = aborts.record = Record()
        (g1, s1), (g2, s2) = failed("a", 1), failed("b", 2)
        assert not await aborts.abort(g1, s1)
        await aborts.leave(g2, s2)  # a begin replacing it: owed, not tried
        assert dest.tries == ["u1"]
        assert record.rows == {"u1": ("job", 1, "a"), "u2": ("job", 1, "b")}
        g2.state, s2.state = GenerationState.OPEN, ShardState.STAGED  # `ckptdrain retry`
        assert not await aborts.abort(g2, s2)
        assert set(record.rows) == {"u1"} and logs[2].upload_id == "u2"
        dest.down = False
        loop = asyncio.create_task(aborts.run())
        try:
            await until(lambda: aborts.owed == 0)
            assert record.rows == {} and logs[1].upload_id is None
        finally:
            loop.cancel()
    asyncio.run(main())


def test_an_abort_after_the_generation_is_forgotten_keeps_the_one_owed() -> None:
    # A new attempt replaced one whose shard was mid-copy: its uploads were owed before the
    # forget deleted their rows (leave_all), then the cancelled copy's own abort found nothing
    # journalled and dropped the owed one, and the upload waited for the orphan sweep.
    async def main() -> None:
        dest = Destination()
        logs = {1: Log("u1"), 2: Log(None)}
        aborts = UploadAborts(dest, lambda s: logs[s.id])  # type: ignore[arg-type]
        record = aborts.record = Record()
        g, s1 = failed("a", 1)
        s2 = ShardRecord(2, "job", 1, 0, "b", 1, "s2", ShardState.DISCARDED, 0.0, 0.0)
        g.shards["b"] = s2
        s1.state = ShardState.DISCARDED  # its copy cancelled by the end
        await aborts.leave_all(g)
        assert aborts.owed == 1 and dest.tries == [] and record.rows == {"u1": ("job", 1, "a")}
        logs[1].upload_id = None  # forgotten: the journal's rows deleted
        assert not await aborts.abort(g, s1)  # the cancelled copy's, the destination down
        assert dest.tries == ["u1"] and aborts.owed == 1 and set(record.rows) == {"u1"}
        dest.down = False
        loop = asyncio.create_task(aborts.run())
        try:
            await until(lambda: aborts.owed == 0)
            assert dest.tries[-1] == "u1" and record.rows == {}
        finally:
            loop.cancel()
    asyncio.run(main())
