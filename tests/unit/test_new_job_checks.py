"""A new job's begin asks the destination two things (is the step committed, whose is the
job) at once: one after the other, a destination that answered nothing held the begin for both
timeouts (10 s, found attacking an S3 outage). BeginChecks.new_job with its two checks
replaced by fakes that record when they start and wait for each other."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ckptdrain.client import wire
from ckptdrain.daemon.beginchecks import UNCOMMITTED_ABOVE, BeginChecks
from ckptdrain.daemon.errors import RequestError


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


def daemon_with(checks: _Checks) -> BeginChecks:
    d = BeginChecks.__new__(BeginChecks)
    d.refuse_if_committed = checks.committed  # type: ignore[method-assign]
    d.job_owner = checks.owner  # type: ignore[method-assign]
    return d


@pytest.mark.asyncio
async def test_both_checks_run_at_once() -> None:
    checks = _Checks()
    assert await daemon_with(checks).new_job("job", 1, 1000) == (1000, True)
    assert sorted(checks.started) == ["committed", "owner"]


@pytest.mark.asyncio
async def test_a_refusal_is_raised_as_itself() -> None:
    with pytest.raises(RequestError) as refused:
        await daemon_with(_Checks(refuse=True)).new_job("job", 1, 1000)
    assert refused.value.code == wire.COMMITTED


# Found attacking the rollback refusal: the begin listed every generation directory above the
# step and read each one's manifest, in the same timeout as the committed check. With 20,000
# uncommitted directories above (retention leaves those alone) every begin took 1-3 s, and
# past the timeout the committed check was given up with it: a committed step was accepted.

class _Destination:
    """What BeginChecks reads: the listing and manifest keys (all uncommitted here); records
    what it was asked, and can hang the listing."""

    def __init__(self, steps_above: int = 0, hang_listing: bool = False,
                 latest: int | None = None) -> None:
        self.dirs = [f"{step:020d}" for step in range(100, 100 + steps_above)]
        self.hang_listing = hang_listing
        self.latest = latest
        self.listings: list[str] = []
        self.reads: list[str] = []

    async def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes | None:
        self.reads.append(key)
        if key.endswith("/LATEST") and self.latest is not None:
            return str(self.latest).encode()
        return None

    async def list_dirs(self, prefix: str) -> list[str]:
        self.listings.append(prefix)
        if self.hang_listing:
            await asyncio.Event().wait()
        return self.dirs


class _Committer:
    def __init__(self, committed: bool) -> None:
        self.committed = committed

    async def is_committed(self, job: str, step: int) -> bool:
        for _ in range(5):  # a round trip: the other question gets going meanwhile
            await asyncio.sleep(0)
        return self.committed


def checks_on(destination: _Destination, committed: bool) -> BeginChecks:
    daemon = SimpleNamespace(backend=destination, committer=_Committer(committed),
                             config=SimpleNamespace(retention=SimpleNamespace(keep_last=2)))
    return BeginChecks(daemon)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_many_uncommitted_directories_above_cost_a_bounded_number_of_reads() -> None:
    destination = _Destination(steps_above=20_000, latest=41)  # LATEST: nothing above 42
    await checks_on(destination, committed=False).refuse_if_committed("job", 42)
    assert destination.listings == ["job/"]
    manifests = [key for key in destination.reads if key.endswith("/MANIFEST.json")]
    assert len(manifests) == 2 + UNCOMMITTED_ABOVE  # keep_last + the bound (no LATEST above)
    assert manifests[0].startswith(f"job/{100 + 20_000 - 1:020d}/")  # newest first


@pytest.mark.asyncio
async def test_a_slow_listing_does_not_take_the_committed_check_with_it() -> None:
    destination = _Destination(hang_listing=True)
    with pytest.raises(RequestError) as refused:
        await checks_on(destination, committed=True).refuse_if_committed("job", 10)
    assert refused.value.code == wire.COMMITTED
    assert destination.listings == ["job/"]  # it was looking, and was not waited for


@pytest.mark.asyncio
async def test_an_unexpected_error_is_raised_as_itself() -> None:
    # Found reviewing the checks: anything but a refusal came out as "unhandled errors in a
    # TaskGroup", and a refusal raised beside another error was lost in the group.
    class Broken(_Checks):
        async def owner(self, job: str, uid: int) -> tuple[int, bool]:
            await self._step("owner")
            raise KeyError("the owner lookup broke")

    with pytest.raises(KeyError, match="owner lookup broke"):
        await daemon_with(Broken()).new_job("job", 1, 1000)
    with pytest.raises(RequestError) as refused:
        await daemon_with(Broken(refuse=True)).new_job("job", 1, 1000)
    assert refused.value.code == wire.COMMITTED


@pytest.mark.asyncio
async def test_a_rollback_the_count_cannot_finish_for_is_refused() -> None:
    # Found attacking the check: with 150,000 uncommitted directories above, reading them ran
    # out the timeout, and a step below LATEST was taken, reported committed and removed.
    class Slow(_Destination):
        async def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes | None:
            if key.endswith("/LATEST"):
                return b"50"
            raise TimeoutError  # as the check's own timeout would
    with pytest.raises(RequestError, match="below its newest committed step 50") as refused:
        await checks_on(Slow(steps_above=3), committed=False).refuse_if_committed("job", 10)
    assert refused.value.code == wire.BAD_REQUEST


@pytest.mark.asyncio
async def test_a_committed_step_is_told_so_when_the_count_fails() -> None:
    # Found attacking the refusal above: raised inside the checks' TaskGroup, it cancelled
    # the committed check, and a committed step was answered bad_request, not committed.
    class NoListing(_Destination):
        async def list_dirs(self, prefix: str) -> list[str]:
            raise TimeoutError  # a listing refused (no s3:ListBucket) or too slow

    destination = NoListing(latest=50)
    with pytest.raises(RequestError) as refused:
        await checks_on(destination, committed=True).refuse_if_committed("job", 40)
    assert refused.value.code == wire.COMMITTED
    with pytest.raises(RequestError, match=r"could not be told \(TimeoutError\)") as other:
        await checks_on(destination, committed=False).refuse_if_committed("job", 40)
    assert other.value.code == wire.BAD_REQUEST

