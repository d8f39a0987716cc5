"""What the node forgets, and when: ended generations and idle jobs, with their metric series.

Nothing a client does may grow what the daemon holds without bound. Each job keeps at most
``retention.keep_failed`` failed or cancelled generations (the newest); one nobody retried,
and every generation of a job that has not begun one for
``retention.forget_after_s``, are forgotten (their local copies go, their journal rows are
deleted and the journal compacted); a job with nothing left on the node is forgotten with its
per-job series in /metrics. ``limits.max_jobs`` bounds the jobs tracked at once: a new job
past it forgets the longest-idle job with nothing in flight first, and is refused only when
every job has a generation in flight.
Committed data at the destination is never touched here: that is retention's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.daemon.access import is_operator
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import GenerationState

if TYPE_CHECKING:
    from ckptdrain.daemon.ledger import GenerationRecord
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.expiry")

# How often the node looks for what to forget.
PERIOD_S = 60.0


class Expiry:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        # job -> when it last began a generation here (monotonic; jobs found at start-up
        # count from then).
        self.seen: dict[str, float] = {}

    def touch(self, job: str) -> None:
        self.seen[job] = time.monotonic()

    async def trim(self, job: str) -> None:
        """Keep at most ``retention.keep_failed`` ended, uncommitted generations of ``job``:
        a job that fails every save must not grow the node by one generation a step."""
        d = self.d
        keep = d.config.retention.keep_failed
        ended = sorted((g for g in d.ledger.generations.values()
                        if g.job == job and g.terminal and g.state is not GenerationState.COMMITTED),
                       key=lambda g: (g.created_mono, g.step))
        for g in ended[: max(0, len(ended) - keep)]:
            d.copies.discard_generation(g)
            await d.ledger.forget(g)

    async def forget_older(self, job: str) -> None:
        """After a commit, on every node: forget this job's committed generations beyond the
        newest ``keep_last`` (retention removes them at the destination), and its failed or
        cancelled ones older than the newest commit once the grace period is over (nobody
        will retry them now), so the journal and the local copies stay bounded."""
        retention = self.d.config.retention
        mine = [g for g in self.d.ledger.generations.values() if g.job == job]
        committed = sorted((g.step for g in mine if g.state is GenerationState.COMMITTED),
                           reverse=True)
        if not committed:
            return
        older = set(committed[retention.keep_last:])
        self.d.committer.manifests.forget(job, older)
        cutoff = time.monotonic() - retention.abandoned_grace_s
        for old in mine:
            stale = (old.state in (GenerationState.FAILED, GenerationState.CANCELLED)
                     and old.step < committed[0] and old.created_mono < cutoff)
            # Another run may have forgotten it while this one waited on the journal.
            if (old.terminal and (old.step in older or stale)
                    and self.d.ledger.generations.get(old.key) is old):
                self.d.copies.discard_generation(old)
                if old.state is GenerationState.COMMITTED:
                    self.d.retired.add(old)
                await self.d.ledger.forget(old)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, min(PERIOD_S, self.d.config.retention.forget_after_s / 2)))
            try:
                await self.expire()
            except Exception:
                log.exception("could not forget expired generations; trying again later")
                self.d.metrics.internal_error("background")

    async def expire(self, now: float | None = None) -> int:
        """Forget what is past ``forget_after_s``; returns how many generations went."""
        d = self.d
        after = d.config.retention.forget_after_s
        mono = time.monotonic() if now is None else now
        by_job: dict[str, list[GenerationRecord]] = {}
        for g in d.ledger.generations.values():
            by_job.setdefault(g.job, []).append(g)
        gone: list[GenerationRecord] = []
        for job, gens in by_job.items():
            idle = mono - self.seen.setdefault(job, mono) > after
            for g in gens:
                if not g.terminal:
                    continue
                ended_long_ago = (g.state is not GenerationState.COMMITTED
                                  and mono - g.created_mono > after)
                if ended_long_ago or (idle and all(o.terminal for o in gens)):
                    gone.append(g)
        for g in gone:
            d.copies.discard_generation(g)
            await d.ledger.forget(g)
        holding = {g.job for g in d.ledger.generations.values()}
        jobs = [job for job in d.ledger.jobs
                if job not in holding and mono - self.seen.setdefault(job, mono) > after]
        forgotten = await self.forget_jobs(jobs)
        if gone or forgotten:
            await d.journal.compact()
            log_event(log, logging.INFO, "forgotten", generations=len(gone), jobs=forgotten,
                      after_s=after)
        return len(gone)

    def busy_jobs(self) -> set[str]:
        return {g.job for g in self.d.ledger.generations.values() if not g.terminal}

    async def forget_jobs(self, jobs: list[str]) -> int:
        """Forget those of ``jobs`` with no generation in flight here: their ended
        generations (committed ones stay at the destination), their owner, their series."""
        d = self.d
        busy = self.busy_jobs()
        empty = [job for job in jobs if job not in busy and d.admission.forget_job(job)]
        if not empty:
            return 0
        chosen = set(empty)
        for g in [g for g in d.ledger.generations.values() if g.job in chosen]:
            d.copies.discard_generation(g)
            await d.ledger.forget(g)
        await d.ledger.forget_jobs(empty)
        for job in empty:
            self.seen.pop(job, None)
            d.retired.forget_job(job)
            d.committer.owners.unverified.discard(job)
            d.metrics.forget_job(job)
        return len(empty)

    async def make_room_for(self, job: str, uid: int) -> None:
        """Before ``uid``'s ``job`` is tracked: keep the jobs tracked within limits.max_jobs.
        The idle jobs forgotten first are ``uid``'s own, least recently used first: a user
        who begins job after job (and aborts them) pushes out their own, not another user's
        (forgotten, a job's node-local state and copies go). And one user keeps at most half
        of them busy (a generation in flight): busy jobs are never forgotten, and a user
        holding all of them open kept every other user's new job off the node. The caller
        checks again with :meth:`check_room` right before it tracks the job."""
        d = self.d
        cap = d.config.limits.max_jobs
        if job in d.ledger.jobs:
            self.touch(job)
            return
        self._check_share(uid)
        owners = d.ledger.jobs
        # Again after each round of forgetting, with the next idle jobs: begins at the same
        # moment choose from the same idle jobs, and one that found its choice forgotten by
        # another chooses again; a job that cannot be forgotten yet (it still holds a slot)
        # does not stop the others being forgotten.
        tried: set[str] = set()
        while len(owners) >= cap:
            busy = self.busy_jobs()
            idle_first = sorted((name for name in owners if name not in busy and name not in tried),
                                key=lambda name: (owners[name] != uid, self.seen.get(name, 0.0)))
            if not idle_first:
                break
            chosen = idle_first[: len(owners) - cap + 1]
            tried.update(chosen)
            await self.forget_jobs(chosen)
        self.check_room(job, uid)
        self.touch(job)

    def check_room(self, job: str, uid: int) -> None:
        """Whether ``uid`` may have ``job`` tracked now; synchronous, so that a check made right
        before the job is tracked holds for it (begins at the same moment were each checked
        against the jobs busy before any of them opened, and together passed the limits)."""
        if job in self.d.ledger.jobs:
            return
        self._check_share(uid)
        cap = self.d.config.limits.max_jobs
        if len(self.d.ledger.jobs) >= cap:
            self.d.metrics.backpressure("rejected", "max_jobs")
            raise RequestError(wire.BACKPRESSURE, f"backpressure: this node already tracks "
                               f"{len(self.d.ledger.jobs)} jobs with generations on it, the most "
                               f"limits.max_jobs allows ({cap}); let them commit or raise the "
                               "limit", {"limit": "max_jobs", "limit_value": cap,
                                         "retry_after_s": 60.0})

    def _check_share(self, uid: int) -> None:
        cap = self.d.config.limits.max_jobs
        share = max(1, cap // 2)
        owners = self.d.ledger.jobs
        held = sum(1 for name in self.busy_jobs() if owners.get(name) == uid)
        if held >= share and not is_operator(uid):
            self.d.metrics.backpressure("rejected", "max_jobs")
            raise RequestError(wire.BACKPRESSURE, f"backpressure: uid {uid} already has {held} "
                               "jobs with generations in flight on this node, half of "
                               f"limits.max_jobs ({cap}); let them commit first",
                               {"limit": "max_jobs", "limit_value": cap, "current": held,
                                "retry_after_s": 60.0})
