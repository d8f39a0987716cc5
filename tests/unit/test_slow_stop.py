"""A stop that takes too long says what it still waits for: each live task and its line."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ckptdrain.daemon.supervisor import report_slow_stop


async def _stuck(release: asyncio.Event) -> None:
    await release.wait()


@pytest.mark.asyncio
async def test_a_slow_stop_logs_each_live_task_and_where_it_waits(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ckptdrain.supervisor")
    release = asyncio.Event()
    stuck = asyncio.create_task(_stuck(release), name="stuck-drain")
    handle = report_slow_stop(0.01)
    try:
        async with asyncio.timeout(10):
            while not any("stop_slow" in r.getMessage() for r in caplog.records):
                await asyncio.sleep(0.01)
    finally:
        handle.cancel()
        release.set()
        await stuck
    line = next(r.getMessage() for r in caplog.records if "stop_slow" in r.getMessage())
    assert "stuck-drain at " in line and "test_slow_stop.py:" in line, line

