"""Retention: which generations of a job stay at the destination, and removing the rest.

Rules (docs/layout.md, "Retention"):

- Keep the newest ``keep_last`` committed generations (manifest present and valid). The newest
  committed generation is never deleted, since ``keep_last`` is at least 1.
- An older committed generation loses its ``MANIFEST.json`` first: a tombstone replaces it in
  one write (retention_removal.py); then its part records go, then its shards. The manifest is the commit
  point, so from the moment any shard is gone no reader can see a manifest that lists it; a
  crash in the middle leaves a tombstoned directory, which a later run finishes removing.
- An uncommitted generation (no manifest) older than the newest committed one is abandoned once
  nothing under it has been written for ``abandoned_grace_s``: a node died or a rank aborted.
  Uncommitted generations newer than the newest committed one may be in flight: never touched.
- A generation whose manifest exists but cannot be read is not counted as committed and is
  kept for inspection until ``keep_last`` newer valid generations exist. One whose manifest
  key no reader reads (a link, an oversized object, no regular file) is kept for good: retention can neither
  read it nor take the key with a tombstone, so it deletes nothing of it.

Removing a generation races a late publish of it; the tombstone at its manifest key settles
the race (retention_removal.py says how).

A run lists what it decides on, not the whole job: the generation directories (one request),
the newest manifests until ``keep_last`` valid ones are found, and then only the generations it
may remove (older than the newest commit, or tombstoned). The kept generations' shards are
never listed: a job with 10,000-shard generations and ``keep_last = 3`` lists about 10,000
keys per commit, not 40,000. Each generation is decided from its own listing and the
manifests read, so the runs of several nodes may overlap: deletes are idempotent, a key that
is already gone is not an error, and the tombstone settles every race with a publish. Only
the :class:`Backend` interface is used, so POSIX and S3 behave the same.

Planning (retention_plan.py) is pure; :func:`apply_retention` does the I/O around it: the
survey of the job (retention_survey.py), then each removal (retention_removal.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ckptdrain.client.keys import generation_prefix, latest_key, manifest_key
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.keptmanifests import KeptManifests
from ckptdrain.daemon.latest import raise_latest, read_latest
from ckptdrain.daemon.retention_plan import (
    GenerationKeys,
    RetentionPlan,
    check_arguments,
    deletion_order,
    group_generations,
    plan_retention,
)
from ckptdrain.daemon.retention_removal import (
    Abandoned,
    NotUsable,
    delete_abandoned,
    delete_committed,
    foreseen,
    read_manifest_key,
)
from ckptdrain.daemon.retention_survey import survey
from ckptdrain.daemon.tombstone import is_tombstone

# Re-exported: retention's planning lived here first.
__all__ = [
    "GenerationKeys", "RetentionPlan", "RetentionReport", "apply_retention", "deletion_order",
    "gc", "group_generations", "plan_retention",
]

log = logging.getLogger(__name__)

# The least time a tombstone stays after it was written, whatever the grace period: it keeps
# a publish that checked the shards just before they went from creating the manifest over
# them, and a few hundred bytes cost nothing. Found attacking `gc --grace-s 0`: the tombstone
# went in the run that placed it, and a late publish (its checks done, its create a moment
# later) committed a manifest over the shards the run had deleted, which `ls` then listed.
TOMBSTONE_MIN_S = 600.0


@dataclass(frozen=True)
class RetentionReport:
    """What one run decided for one job. Steps are sorted newest first.

    ``deleted``: committed (or damaged-manifest) generations removed; ``abandoned_deleted``:
    uncommitted ones removed (and generation directories that held no key, only empty
    directories: those removed); ``skipped``: generations left alone and why; ``failed``:
    generations whose removal an error interrupted (the next run retries them). With
    ``dry_run`` nothing was removed and the lists say what a real run would remove.
    """

    job: str
    kept: list[int]
    deleted: list[int]
    abandoned_deleted: list[int]
    skipped: list[tuple[int, str]]
    failed: list[tuple[int, str]] = field(default_factory=list)
    dry_run: bool = False


async def apply_retention(
    backend: Backend,
    job: str,
    *,
    keep_last: int,
    abandoned_grace_s: float,
    now: float | None = None,
    dry_run: bool = False,
    kept: KeptManifests | None = None,
) -> RetentionReport:
    """Apply the retention rules to ``job`` at ``backend`` (see the module docstring).

    ``now`` is the time abandoned generations are aged against (default: the current time;
    the destination's clock stamps the objects, so the grace period should dwarf clock skew).
    Raises BackendError when the job cannot be listed or its kept manifests cannot be read;
    an error while removing one generation is reported in ``failed`` and the run goes on.
    ``kept`` remembers large valid manifests between runs (the daemon's, one per process).
    """
    check_arguments(keep_last, abandoned_grace_s)
    generation_prefix(job, 0)  # validates the job name before anything is listed
    if now is None:
        now = time.time()
    generations, valid, unreadable, tombstoned, empty = await survey(backend, job, keep_last,
                                                                     kept)
    plan = plan_retention(
        generations,
        valid,
        unreadable,
        keep_last=keep_last,
        abandoned_grace_s=abandoned_grace_s,
        now=now,
        tombstoned=tombstoned,
    )
    tombstone_s = max(abandoned_grace_s, TOMBSTONE_MIN_S)  # how long a tombstone stays
    deleted: list[int] = []
    abandoned: list[int] = []
    skipped = list(plan.skipped)
    failed: list[tuple[int, str]] = []
    # Oldest first: if a run is interrupted, what is left is the newer end of the history.
    removals = [(step, True) for step in plan.delete_committed]
    removals += [(step, False) for step in plan.delete_abandoned]
    for step, committed in sorted(removals):
        gen = generations[step]
        try:
            # Only the kept generations' manifests were read: a committed one older than them
            # may be a removal under way already (its tombstone at the manifest key).
            held = (await read_manifest_key(backend, job, step)
                    if committed or dry_run else None)
            tomb = held if held is not None and is_tombstone(held) else None
            if dry_run and committed and tomb is None:
                deleted.append(step)
                continue
            if dry_run:  # a tombstoned or abandoned step: as the real run would settle it
                outcome = foreseen(job, gen, tomb, now, tombstone_s)
                if outcome is Abandoned.RETIRED_REMOVED:
                    deleted.append(step)
                elif outcome is Abandoned.REMOVED:
                    abandoned.append(step)
                elif outcome is Abandoned.TOMBSTONE_KEPT:
                    skipped.append((step, _kept_tombstone(tombstone_s)))
                continue
            if committed and tomb is None:
                if await delete_committed(backend, job, gen, now, held):
                    log.info("retention removed committed generation %d of job %r", step, job)
                    deleted.append(step)
                else:
                    skipped.append((step, "published again while retention was removing it "
                                          "(its shards were all there); kept"))
                continue
            outcome = await delete_abandoned(backend, job, gen, now, tombstone_s)
        except NotUsable as exc:
            # Found attacking: a link at an old generation's manifest key failed every run
            # ("the next run retries it", exit 1, the dry run too), where a run that read it
            # among the kept ones left it for inspection. No run can remove it or take the key
            # with a tombstone, so it is left, as an unreadable manifest is, whatever keep_last.
            log.warning("retention: %s: %s", manifest_key(job, step), exc)
            skipped.append((step, f"manifest not usable ({exc}); kept for inspection"))
            continue
        except BackendError as exc:
            failed.append((step, f"removal interrupted: {exc}; the next run retries it"))
            continue
        except ValueError as exc:
            # A key another tool wrote that this destination cannot address (``a//b`` on
            # S3): that generation fails, the others and LATEST's repair still go ahead.
            failed.append((step, f"removal stopped at a key it cannot address: {exc}; "
                                 "remove it by hand"))
            continue
        if outcome is Abandoned.RETIRED:
            continue
        if outcome is Abandoned.RETIRED_REMOVED:
            log.info("retention removed committed generation %d of job %r", step, job)
            deleted.append(step)
        elif outcome is Abandoned.REMOVED:
            log.info("retention removed abandoned generation %d of job %r", step, job)
            abandoned.append(step)
        elif outcome is Abandoned.TOMBSTONE_KEPT:
            skipped.append((step, _kept_tombstone(tombstone_s)))
        else:
            skipped.append((step, "committed while retention was removing it; kept"))
    if empty:
        # Reported as abandoned generations, and foreseen by a dry run as a real run removes
        # them (found attacking gc: the dry run said "would delete none" of an old, empty
        # generation directory, and the real run removed it and said "deleted none").
        try:
            gone = await backend.remove_empty(
                [generation_prefix(job, step) for step in empty], now - abandoned_grace_s,
                dry_run=dry_run)
            for step in empty:
                if generation_prefix(job, step) in gone:
                    if not dry_run:
                        log.info("retention removed the empty directories of generation %d "
                                 "of job %r", step, job)
                    abandoned.append(step)
        except BackendError as exc:
            log.warning("retention: could not remove the empty directories of %s: %s",
                        ", ".join(generation_prefix(job, step) for step in empty), exc)
    if not dry_run and plan.newest_committed is not None and (deleted or abandoned):
        try:
            await _repair_latest(backend, job, set(deleted) | set(abandoned), plan.newest_committed)
        except BackendError as exc:
            # A hint only: readers fall back to listing manifests when it names nothing.
            log.warning("could not repair %s: %s", latest_key(job), exc)
    return RetentionReport(
        job=job,
        kept=plan.kept,
        deleted=sorted(deleted, reverse=True),
        abandoned_deleted=sorted(abandoned, reverse=True),
        skipped=sorted(skipped, reverse=True),
        failed=sorted(failed, reverse=True),
        dry_run=dry_run,
    )


async def gc(
    backend: Backend,
    jobs: list[str] | None,
    keep_last: int,
    abandoned_grace_s: float,
    dry_run: bool = False,
    *,
    now: float | None = None,
) -> list[RetentionReport]:
    """:func:`apply_retention` over ``jobs`` (default: every job with a committed manifest),
    one job after another so the destination sees one job's deletes at a time."""
    check_arguments(keep_last, abandoned_grace_s)
    if jobs is None:
        jobs = await catalog.list_jobs(backend)
    return [
        await apply_retention(
            backend,
            job,
            keep_last=keep_last,
            abandoned_grace_s=abandoned_grace_s,
            now=now,
            dry_run=dry_run,
        )
        for job in jobs
    ]


def _kept_tombstone(grace_s: float) -> str:
    return (f"abandoned and removed; its tombstone stays until it is {grace_s:g}s old, so no "
            "late publish can commit it")


async def _repair_latest(backend: Backend, job: str, removed: set[int], newest: int) -> None:
    """Point LATEST at ``newest`` if it names a generation this run removed.

    Readers trust LATEST only when its manifest exists, so a dangling hint is never wrong,
    only slow (a full listing per lookup); raising it saves that. It is raised the way a
    publish raises it (commit.raise_latest), so a commit racing this run is not undone.
    """
    hinted = await read_latest(backend, job)
    if hinted is not None and hinted in removed:
        await raise_latest(backend, job, newest)
        log.info("retention: %s named removed generation %d; raised to %d", latest_key(job),
                 hinted, newest)
