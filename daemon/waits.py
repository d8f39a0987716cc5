"""`wait`: the answer for one step, for the waiter's attempt.

A waiter is told "committed" as soon as the step is committed, by any attempt (a committed step
is final). It is told "failed" only by its own attempt: a generation of an older attempt that
failed here is a crash the waiter's job is re-saving, so the waiter waits for the re-save
instead. Its own attempt's failure is looked up at the destination first: another node's
`retry` may have committed the step since (from this node's recorded part). Sleeps on the
ledger's change event, so a commit on this node (or the new attempt's first begin) wakes it at
once; the destination is asked at most once per ``drain.commit_poll_interval_s`` while this
node holds nothing of the waiter's attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.ledger import GenerationRecord
from ckptdrain.daemon.state import GenerationState

if TYPE_CHECKING:
    from ckptdrain.daemon.server import Daemon

# Even with nothing changing, a waiter looks again this often (a belt, not the mechanism).
RECHECK_S = 1.0
# Committed steps a job's retention removed that this node still answers for (its newest).
RETIRED_PER_JOB = 1024


class Retired:
    """The committed steps this node forgot because retention removes them (beyond
    ``retention.keep_last``), so that a wait for one still hears it committed. Found
    attacking: once its manifest was gone, a late ``wait`` (DrainWriter waiting on a save
    while the next one commits) took its whole timeout and then said "not committed; it may
    still commit". In memory, bounded per job; elsewhere (a restarted daemon, another
    node) the tombstone retention leaves at the manifest key for a grace period says so."""

    def __init__(self) -> None:
        self._steps: dict[str, dict[int, dict[str, Any]]] = {}

    def add(self, gen: GenerationRecord) -> None:
        steps = self._steps.setdefault(gen.job, {})
        steps[gen.step] = {"job": gen.job, "step": gen.step, "committed": True,
                           "committed_at": gen.committed_at, "attempt": gen.attempt}
        while len(steps) > RETIRED_PER_JOB:
            del steps[min(steps)]

    def get(self, job: str, step: int) -> dict[str, Any] | None:
        return self._steps.get(job, {}).get(step)

    def forget_job(self, job: str) -> None:
        self._steps.pop(job, None)


def is_of(gen: GenerationRecord, attempt: str) -> bool:
    """Whether ``gen`` answers a waiter of ``attempt`` ("" answers to every attempt; "A/x"
    is one of "A"'s, as DrainWriter names its saves within a torchrun restart)."""
    return not attempt or gen.attempt == attempt or gen.attempt.startswith(attempt + "/")


async def wait_for_commit(d: Daemon, job: str, step: int, timeout_s: float,
                          attempt: str, *, gone: asyncio.Future[None] | None = None
                          ) -> dict[str, Any]:
    """``gone``, when given, is done once the waiter has hung up: the wait ends then
    (ConnectionError), so an abandoned wait frees its connection at once."""
    deadline = time.monotonic() + timeout_s
    poll = d.config.drain.commit_poll_interval_s
    next_look = time.monotonic()  # when the destination may be asked next
    while True:
        changed = d.ledger.change()  # taken before looking, so no change falls in between
        gen = d.ledger.get(job, step)
        if gen is not None and gen.state is GenerationState.COMMITTED:
            return {"job": job, "step": step, "committed": True,
                    "committed_at": gen.committed_at, "attempt": gen.attempt}
        retired = d.retired.get(job, step) if gen is None else None
        if retired is not None:
            return dict(retired)
        ours = gen is not None and is_of(gen, attempt)
        if ours and gen is not None and gen.terminal:
            if gen.state is GenerationState.FAILED:
                committed = await _committed_elsewhere(d, gen)
                if committed is not None:
                    return committed
            raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} "
                               f"{gen.state}: {gen.error}")
        now = time.monotonic()
        if not ours and now >= next_look:
            # Nothing of this attempt here (yet): another node may commit it.
            next_look = now + poll
            try:
                manifest, removed = await d.committer.committed_or_removed(job, step)
            except (BackendError, ManifestError, OSError) as exc:
                from ckptdrain.daemon.errors import destination_error
                raise destination_error(job, step, exc) from None
            if manifest is not None or removed:
                committed_at = None if manifest is None else manifest.clocks.get("committed")
                return {"job": job, "step": step, "committed": True,
                        "committed_at": committed_at}
            continue  # the look took a while: look at the ledger again first
        left = deadline - time.monotonic()
        if left <= 0:
            raise _timed_out(job, step, timeout_s, gen if ours else None, attempt)
        nap = min(left, RECHECK_S) if ours else min(left, max(0.0, next_look - now))
        if gone is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(nap):
                    await changed.wait()
            continue
        async with asyncio.TaskGroup() as tg:
            woken = tg.create_task(changed.wait())
            either: list[asyncio.Future[Any]] = [woken, gone]
            await asyncio.wait(either, timeout=nap, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
        if gone.done():
            raise ConnectionError("the client hung up while waiting for a commit")


async def _committed_elsewhere(d: Daemon, gen: GenerationRecord) -> dict[str, Any] | None:
    """The answer for a step that failed here but that another node committed since with
    this node's part as recorded (a multi-node step ended here on another node's failure
    record, then that node's `retry` alone committed it): a committed step is final, whatever
    this node's ledger says. Found attacking multi-node commits: this node's waiters heard
    "failed, this attempt never will" for a step whose MANIFEST.json and LATEST were there.
    None when the step is not committed with this node's part (another attempt's commit
    fails this one: its bytes are not the ones committed), or the destination cannot say."""
    try:
        here, manifest = await d.scheduler.publisher.ends.committed_with_part(gen)
    except (BackendError, ManifestError, OSError):
        return None
    if not here:
        return None
    committed_at = None if manifest is None else manifest.clocks.get("committed")
    return {"job": gen.job, "step": gen.step, "committed": True, "committed_at": committed_at,
            "attempt": gen.attempt}


def _timed_out(job: str, step: int, timeout_s: float, gen: GenerationRecord | None,
               attempt: str) -> RequestError:
    if gen is not None:
        state = gen.summary()
    else:
        what = f"attempt {attempt!r} " if attempt else ""
        state = {"state": f"{what}unknown to this node"}
    return RequestError(wire.TIMEOUT, f"step {step} of job {job!r} is not committed after "
                        f"{timeout_s:g} s (state: {state['state']})", {"generation": state})
