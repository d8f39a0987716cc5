"""BeginChecks: what a begin learns from the destination before it is let in."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ckptdrain.daemon import beginchecks


class _Hung:
    """A committer whose destination never answers; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    async def is_committed(self, job: str, step: int) -> bool:
        self.asked.append((job, step))
        await asyncio.sleep(3600)
        return True


@pytest.mark.asyncio
async def test_a_committed_check_that_times_out_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Found attacking the operator's view of a stalled destination: the log line said
    # `committed_check_failed error=TimeoutError` and nothing more.
    monkeypatch.setattr(beginchecks, "COMMITTED_CHECK_TIMEOUT_S", 0.05)
    committer = _Hung()
    checks = beginchecks.BeginChecks(cast(Any, SimpleNamespace(committer=committer)))
    with caplog.at_level(logging.WARNING, logger="ckptdrain.server"):
        assert await checks._committed("job", 7) is False
    assert committer.asked == [("job", 7)]
    [line] = [r.getMessage() for r in caplog.records if "committed_check_failed" in r.getMessage()]
    assert "did not answer within 0.05 s" in line and "create-once" in line, line
