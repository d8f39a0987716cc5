"""A step of the wall clock (NTP; a daemon started before its node's clock was set) moves no
age the daemon acts on: ages are read on the monotonic clock from when each moment happened
(records.monotonic_of), never from the wall clock again.

Found attacking the clocks: with the clock stepped a day forward, a generation that failed a
minute earlier was forgotten with its local copies (no `retry` left); stepped back, the newest
failure was the one `keep_failed` dropped. The commit wait and the figures are checked against
real daemons in tests/functional/test_clock_steps.py."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptdrain.daemon.configload import load_config
from ckptdrain.daemon.expiry import Expiry
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.ledger import Ledger
from ckptdrain.daemon.records import GenerationRecord, monotonic_of
from ckptdrain.daemon.state import GenerationEvent, GenerationState
from ckptdrain.daemon.waits import Retired

DAY = 86_400.0


class Wall:
    """time.time, stepped by the test; the monotonic clock runs on untouched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = 0.0
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.offset)


async def _daemon(tmp_path: Path, **env: str) -> tuple[SimpleNamespace, list[Any]]:
    journal = Journal(tmp_path / "journal.sqlite3")
    await journal.open()
    discarded: list[Any] = []

    async def compact() -> None:
        return None

    d = SimpleNamespace(
        config=load_config(env={"HOME": str(tmp_path), **env}), ledger=Ledger(journal),
        journal=SimpleNamespace(compact=compact),
        copies=SimpleNamespace(discard_generation=discarded.append),
        admission=SimpleNamespace(forget_job=lambda job: True),
        committer=SimpleNamespace(owners=SimpleNamespace(unverified=set())),
        metrics=SimpleNamespace(forget_job=lambda job: None), retired=Retired())
    d.close = journal.close
    return d, discarded


async def _failed(d: SimpleNamespace, step: int) -> GenerationRecord:
    gen = await d.ledger.open_generation("job", step, 1, "local", uid=1000)
    await d.ledger.apply(gen, GenerationEvent.FAILED, error="the destination is down")
    assert gen.state is GenerationState.FAILED
    return gen


def test_a_moment_that_has_passed_keeps_its_age_across_a_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wall = Wall(monkeypatch)
    gen = GenerationRecord(job="j", step=1, world_size=1, ack="local", created_at=time.time())
    wall.offset = DAY  # forward a day: the generation is not a day old
    assert time.monotonic() - gen.created_mono < 60
    wall.offset = -DAY  # back a day: not "in the future" either
    assert 0 <= time.monotonic() - gen.created_mono < 60
    # A journalled moment (read back after a restart) counts from when it happened.
    assert monotonic_of(time.time() - 100) == pytest.approx(time.monotonic() - 100, abs=1)


@pytest.mark.asyncio
async def test_a_failed_generation_is_not_forgotten_by_a_forward_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wall = Wall(monkeypatch)
    d, discarded = await _daemon(tmp_path)
    try:
        gen = await _failed(d, 7)
        expiry = Expiry(d)  # type: ignore[arg-type]
        wall.offset = 1.5 * DAY
        assert await expiry.expire() == 0
        assert d.ledger.get("job", 7) is gen and not discarded  # `retry job 7` still works
        # Its own age past forget_after_s (a day by default) forgets it, as before.
        assert await expiry.expire(now=time.monotonic() + DAY + 60) == 1
        assert d.ledger.get("job", 7) is None and discarded == [gen]
    finally:
        await d.close()


@pytest.mark.asyncio
async def test_keep_failed_keeps_the_newest_failures_across_a_backward_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wall = Wall(monkeypatch)
    d, discarded = await _daemon(tmp_path, CKPTDRAIN_RETENTION__KEEP_FAILED="1")
    try:
        expiry = Expiry(d)  # type: ignore[arg-type]
        older = await _failed(d, 5)
        await expiry.trim("job")
        wall.offset = -7200.0  # back two hours
        newer = await _failed(d, 6)
        await expiry.trim("job")
        assert d.ledger.get("job", 6) is newer
        assert d.ledger.get("job", 5) is None and discarded == [older]
    finally:
        await d.close()
