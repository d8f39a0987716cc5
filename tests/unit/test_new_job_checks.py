"""A new job's begin asks the destination two things (is the step committed, whose is the
job) at once: one after the other, a destination that answered nothing held the begin for both
timeouts (10 s, found attacking an S3 outage). Daemon._check_new_job with its two checks
replaced by fakes that record when they start and wait for each other."""

from __future__ import annotations

import asyncio

import pytest

from ckptdrain.client import wire
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.server import Daemon


class _Checks:
    def __init__(self, refuse: bool = False) -> None:
        self.started: list[str] = []
        self.both = asyncio.Event()
        self.refuse = refuse

    async def _step(self, name: str) -> None:
        self.started.append(name)
        if len(self.started) == 2:
            self.both.set()
        async with asyncio.timeout(5):
            await self.both.wait()  # never set when they run one after the other

    async def committed(self, job: str, step: int) -> None:
        await self._step("committed")
        if self.refuse:
            raise RequestError(wire.COMMITTED, f"step {step} of job {job!r} is committed")

    async def owner(self, job: str, uid: int) -> tuple[int, bool]:
        await self._step("owner")
        return uid, True


def daemon_with(checks: _Checks) -> Daemon:
    d = Daemon.__new__(Daemon)
    d._refuse_if_committed = checks.committed  # type: ignore[method-assign]
    d._job_owner = checks.owner  # type: ignore[method-assign]
    return d


@pytest.mark.asyncio
async def test_both_checks_run_at_once() -> None:
    checks = _Checks()
    assert await daemon_with(checks)._check_new_job("job", 1, 1000) == (1000, True)
    assert sorted(checks.started) == ["committed", "owner"]


@pytest.mark.asyncio
async def test_a_refusal_is_raised_as_itself() -> None:
    with pytest.raises(RequestError) as refused:
        await daemon_with(_Checks(refuse=True))._check_new_job("job", 1, 1000)
    assert refused.value.code == wire.COMMITTED
