"""This node's retention runs: after each generation it published, retention at the
destination for that job (:mod:`.retention`), one run per job at a time, and the manifests the
runs found valid kept for the next."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ckptdrain.daemon.keptmanifests import KeptManifests
from ckptdrain.daemon.locks import CoalescedRuns
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.retention import apply_retention

if TYPE_CHECKING:
    from ckptdrain.daemon.ledger import GenerationRecord
    from ckptdrain.daemon.server import Daemon

# The name these lines had when they were the daemon's own: log filters select on it.
log = logging.getLogger("ckptdrain.server")

# Retention runs of one job start at least this far apart: a job committing every few
# milliseconds (a test loop, a tiny model) pays for one run a second, not one per commit.
RETENTION_INTERVAL_S = 1.0


class RetentionRuns:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self._retention_runs = CoalescedRuns(RETENTION_INTERVAL_S)  # by job
        self._kept_manifests = KeptManifests()

    def published(self, gen: GenerationRecord) -> None:
        job = gen.job
        self.d.supervisor.spawn(lambda: self._retain(job), what=f"retention {job}")

    async def _retain(self, job: str) -> None:
        """Retention at the destination after this node published a generation of ``job``.

        Only the publishing node runs it: every node of a 100-node job listing the job and
        deleting the same old generation would multiply its requests by 100. A publisher that
        dies before its run leaves the old generation to the next commit's run (or
        ``ckptdrain gc``). One run per job at a time, and a commit during a run asks for one
        more after it (CoalescedRuns): the newest commit is always seen by a run that began
        after it. Runs of a job start at least RETENTION_INTERVAL_S apart.
        """
        await self._retention_runs.run(job, lambda: self._retain_once(job))

    async def _retain_once(self, job: str) -> None:
        retention = self.d.config.retention
        try:
            report = await apply_retention(self.d.backend, job, keep_last=retention.keep_last,
                                           abandoned_grace_s=retention.abandoned_grace_s,
                                           kept=self._kept_manifests)
        except Exception as exc:  # a destination hiccup: the next commit runs it again
            log_event(log, logging.WARNING, "retention_failed", job=job, error=str(exc))
            return
        if report.deleted or report.abandoned_deleted or report.failed:
            # A failed removal leaves the destination growing: worth a warning.
            log_event(log, logging.WARNING if report.failed else logging.INFO, "retention",
                      job=job, kept=report.kept,
                      deleted=report.deleted, abandoned=report.abandoned_deleted,
                      failed=[step for step, _ in report.failed],
                      error=report.failed[0][1] if report.failed else None)
        self.d.committer.manifests.forget(job, [*report.deleted, *report.abandoned_deleted])
