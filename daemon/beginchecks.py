"""What a ``begin`` of a generation this node does not hold asks the destination first: is
the step committed already (nothing may overwrite it), would retention remove it as soon as
it committed (a job rolled back below its newest steps), and, for a job this node does not
track, whose the job is. Each question within its own timeout, and asked at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon import owners
from ckptdrain.daemon.access import is_operator
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.commit import StepUnusable
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.latest import committed_above, read_latest
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.server")

# How long `begin` asks the destination each question. Past it the hand-off goes on: shard
# writes are create-once, so a committed step is safe either way.
COMMITTED_CHECK_TIMEOUT_S = 5.0
# When LATEST names no step above the one begun (the usual new newest step), the rollback
# check reads the manifests of at most keep_last + this many of the newest directories above
# it: generations in flight, and the odd abandoned one.
UNCOMMITTED_ABOVE = 8


@dataclass(frozen=True, slots=True)
class _Uncounted:
    """The committed steps above a step below LATEST could not be counted: why."""

    latest: int
    why: str


class BeginChecks:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def new_job(self, job: str, step: int, uid: int) -> tuple[int, bool]:
        """:meth:`refuse_if_committed` and :meth:`job_owner` at once, for a job this node
        does not track: (owner, verified)."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.refuse_if_committed(job, step))
                looked_up = tg.create_task(self.job_owner(job, uid))
        except BaseExceptionGroup as group:
            raise _one_of(group) from None
        return looked_up.result()

    async def job_owner(self, job: str, uid: int) -> tuple[int, bool]:
        """Whose a job this node does not track is to be, and whether the destination said so
        (owners.py); raises the refusal of another user's job."""
        if is_operator(uid):
            # Root saving a user's job saves it for its owner: the part records name the
            # owner, who keeps the job (a record naming root took it from them).
            return await owners.for_operator(self.d, job, uid)
        return uid, await owners.refuse_if_elsewhere(self.d, job, uid)

    async def refuse_if_committed(self, job: str, step: int) -> None:
        """Refuse a step another node already committed: nothing may overwrite it. Refuse
        too a step with ``retention.keep_last`` committed steps above it: retention would
        remove it as soon as it committed (found attacking retention: a job rolled back to an
        older step was told its save was committed, and a second later it was gone). The two
        questions are asked at once; the second timing out or failing never loses the
        first's answer, and a committed step is refused without waiting for the second."""
        try:
            async with asyncio.TaskGroup() as tg:
                newer = tg.create_task(self._committed_above(job, step))
                if await self._committed(job, step):
                    # Raised here, the TaskGroup cancels the other question at once.
                    raise RequestError(wire.COMMITTED, f"step {step} of job {job!r} is "
                                       "committed; save a new step (after rolling back to an "
                                       "older step, save under a new job name: a restart "
                                       "resumes from this job's newest committed step)")
        except BaseExceptionGroup as group:
            raise _one_of(group) from None
        keep = self.d.config.retention.keep_last
        above = newer.result()
        if isinstance(above, _Uncounted):
            # Raised here, after the committed answer: a committed step is told so.
            raise RequestError(
                wire.BAD_REQUEST,
                f"step {step} of job {job!r} is below its newest committed step "
                f"{above.latest}, and whether retention.keep_last = {keep} would remove it as "
                f"soon as it committed could not be told ({above.why}); save it as a step "
                f"above {above.latest}, or under a new job name")
        if len(above) >= keep:
            raise RequestError(
                wire.BAD_REQUEST,
                f"step {step} of job {job!r} is older than its {keep} newest committed steps "
                f"({', '.join(map(str, above))}): retention.keep_last = {keep} would remove it "
                "as soon as it committed, and a restart resumes from the newest step anyway; "
                f"save it as a step above {above[0]}, or under a new job name")

    async def _committed(self, job: str, step: int) -> bool:
        """Whether ``step`` is committed; False when the destination cannot say in time (the
        create-once shard writes still protect a committed step). RequestError for a step no
        attempt can use (damaged or tombstoned)."""
        try:
            async with asyncio.timeout(COMMITTED_CHECK_TIMEOUT_S):
                return await self.d.committer.is_committed(job, step)
        except StepUnusable as exc:
            raise RequestError(wire.COMMITTED, str(exc)) from None
        except (BackendError, OSError, TimeoutError) as exc:
            # A timeout says which, and what follows (it said "TimeoutError" alone: found
            # attacking the operator's view of a stalled destination).
            error = (f"the destination did not answer within {COMMITTED_CHECK_TIMEOUT_S:g} s"
                     if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__)
            log_event(log, logging.WARNING, "committed_check_failed", job=job, step=step,
                      error=error, action="the begin goes on; the create-once shard writes "
                      "still keep a committed step from being overwritten")
            return False

    async def _committed_above(self, job: str, step: int) -> list[int] | _Uncounted:
        """Up to ``retention.keep_last`` committed steps of ``job`` above ``step``: one listing
        of the job's generation directories, then a manifest read each, newest first (none in
        the usual begin of a new newest step). Found attacking it, round after round: reading
        every directory on every begin cost 1-3 s with 20,000 uncommitted ones above (which
        retention leaves alone) and, past the timeout, took the committed check with it;
        trusting LATEST refused nothing when it was missing or behind; and a bound on the
        reads let uncommitted directories hide the commits behind them. So the reads are
        bounded (:data:`UNCOMMITTED_ABOVE` more than ``keep_last``) only when LATEST names a
        step at or below this one; and when LATEST names one above and the count does not
        finish in time, the begin is refused. Otherwise best effort: none found when the
        destination cannot say in time."""
        keep = self.d.config.retention.keep_last
        latest: int | None = None
        try:
            async with asyncio.timeout(COMMITTED_CHECK_TIMEOUT_S):
                latest = await read_latest(self.d.backend, job)
                unbounded = latest is None or latest > step  # a rollback, or nothing known
                return await committed_above(
                    self.d.backend, job, step, enough=keep,
                    look_at=None if unbounded else keep + UNCOMMITTED_ABOVE)
        except (BackendError, ManifestError, OSError, TimeoutError) as exc:
            log_event(log, logging.WARNING, "rollback_check_failed", job=job, step=step,
                      error=str(exc) or type(exc).__name__)
            if latest is not None and latest > step:
                # A commit above it is known and the rest could not be counted in time:
                # refused rather than committed and then removed (found attacking it with
                # 150,000 uncommitted directories above). A restart resumes from the newest.
                return _Uncounted(latest, str(exc) or type(exc).__name__)
            return []


def _one_of(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """What a failed TaskGroup of the begin's questions raises as itself: a refusal first (a
    refusal and another error together had come out as a group, and the refusal was lost),
    else the first error (an unexpected one came out as "unhandled errors in a TaskGroup")."""
    refusals = group.subgroup(RequestError)
    found: BaseException = refusals if refusals is not None else group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found
