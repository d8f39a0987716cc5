"""Retention: which generations of a job stay at the destination, and removing the rest.

Rules (docs/layout.md, "Retention"):

- Keep the newest ``keep_last`` committed generations (manifest present and valid). The newest
  committed generation is never deleted, since ``keep_last`` is at least 1.
- An older committed generation loses its ``MANIFEST.json`` first, then its part records, then
  its shards. The manifest is the commit point, so from the moment any shard is gone no reader
  can see a manifest that lists it; a crash in the middle leaves an uncommitted directory,
  which the abandoned rule below removes on a later run.
- An uncommitted generation (no manifest) older than the newest committed one is abandoned once
  nothing under it has been written for ``abandoned_grace_s``: a node died or a rank aborted.
  Uncommitted generations newer than the newest committed one may be in flight: never touched.
- A generation whose manifest exists but cannot be read is not counted as committed and is
  kept for inspection until ``keep_last`` newer valid generations exist.

Any node may run it, all nodes at once included: every decision is taken from one listing,
deletes are idempotent, and a key that is already gone is not an error. Only the
:class:`Backend` interface is used, so POSIX and S3 behave the same.

Planning (:func:`plan_retention`) is pure; :func:`apply_retention` does the I/O around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ckptdrain.client.manifest import (
    Manifest,
    ManifestError,
    generation_prefix,
    latest_key,
    manifest_key,
    parse_generation_dir,
    parts_prefix,
)
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo
from ckptdrain.daemon.catalog import for_each_bounded
from ckptdrain.daemon.commit import raise_latest, read_latest

log = logging.getLogger(__name__)

# Deletes in flight per generation: S3 has no cheap bulk delete through the Backend interface,
# and one request at a time would take minutes for a 100,000-shard generation; an unbounded
# burst would be throttled (503 SlowDown) or swamp a Lustre MDS.
DELETE_CONCURRENCY = 16


@dataclass(frozen=True)
class RetentionReport:
    """What one run decided for one job. Steps are sorted newest first.

    ``deleted``: committed (or damaged-manifest) generations removed; ``abandoned_deleted``:
    uncommitted ones removed; ``skipped``: generations left alone and why; ``failed``:
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


@dataclass(frozen=True)
class GenerationKeys:
    """Everything listed under one generation directory."""

    step: int
    keys: tuple[str, ...]
    has_manifest: bool
    # Unix time of the newest object, or None when the destination did not say for some key.
    newest_write: float | None


@dataclass(frozen=True)
class RetentionPlan:
    kept: list[int]
    delete_committed: list[int]
    delete_abandoned: list[int]
    skipped: list[tuple[int, str]]
    newest_committed: int | None


# --- planning (pure) ------------------------------------------------------------------------


def group_generations(job: str, infos: Iterable[ObjectInfo]) -> dict[int, GenerationKeys]:
    """The generation directories of ``job`` in a listing of ``<job>/``, by step.

    Keys that are not under a ``<20 digits>/`` directory (``LATEST``, stray files) are
    ignored: retention removes only what the layout says is a generation.
    """
    head = f"{job}/"
    keys: dict[int, list[str]] = {}
    newest: dict[int, float | None] = {}
    for info in infos:
        if not info.key.startswith(head):
            continue
        dirname, sep, rest = info.key[len(head) :].partition("/")
        if not sep or not rest:
            continue
        step = parse_generation_dir(dirname)
        if step is None:
            continue
        keys.setdefault(step, []).append(info.key)
        before = newest.get(step, 0.0)
        if before is None or info.modified is None:
            newest[step] = None
        else:
            newest[step] = max(before, info.modified)
    return {
        step: GenerationKeys(
            step=step,
            keys=tuple(sorted(found)),
            has_manifest=manifest_key(job, step) in found,
            newest_write=newest[step],
        )
        for step, found in keys.items()
    }


def manifests_to_read(generations: Mapping[int, GenerationKeys]) -> list[int]:
    """Steps with a manifest key, newest first: the order in which to validate them."""
    return sorted((g.step for g in generations.values() if g.has_manifest), reverse=True)


def plan_retention(
    generations: Mapping[int, GenerationKeys],
    valid: Sequence[int],
    unreadable: Mapping[int, str],
    *,
    keep_last: int,
    abandoned_grace_s: float,
    now: float,
) -> RetentionPlan:
    """Decide what to keep and what to remove.

    ``valid`` are the steps whose manifests were read and are valid, newest first, and
    ``unreadable`` the steps whose manifest key was listed but did not read back as a valid
    manifest (with the reason). Manifests are validated newest first until ``keep_last``
    valid ones are found; older manifest keys need not have been read, they are removed.
    """
    _check_arguments(keep_last, abandoned_grace_s)
    kept = sorted(valid, reverse=True)[:keep_last]
    newest = kept[0] if kept else None
    # Manifest-bearing generations below the oldest kept one go; with fewer than keep_last
    # valid generations there is no such boundary and none goes.
    boundary = kept[-1] if len(kept) == keep_last else None
    delete_committed: list[int] = []
    delete_abandoned: list[int] = []
    skipped: list[tuple[int, str]] = []
    for step in sorted(generations, reverse=True):
        gen = generations[step]
        if step in kept:
            continue
        if gen.has_manifest:
            if boundary is not None and step < boundary:
                delete_committed.append(step)
            else:
                reason = unreadable.get(step, "its manifest was not read")
                skipped.append((step, f"manifest not usable ({reason}); kept for inspection"))
            continue
        if newest is None:
            skipped.append((step, "uncommitted, and the job has no committed generation yet"))
        elif step > newest:
            skipped.append((step, "uncommitted and newer than the newest committed: in flight"))
        elif gen.newest_write is None:
            skipped.append(
                (step, "uncommitted, but the destination does not report write times")
            )
        elif now - gen.newest_write < abandoned_grace_s:
            skipped.append(
                (
                    step,
                    f"uncommitted, last written {max(now - gen.newest_write, 0.0):.0f}s ago, "
                    f"within the {abandoned_grace_s:g}s grace period",
                )
            )
        else:
            delete_abandoned.append(step)
    return RetentionPlan(
        kept=kept,
        delete_committed=delete_committed,
        delete_abandoned=delete_abandoned,
        skipped=skipped,
        newest_committed=newest,
    )


def deletion_order(job: str, gen: GenerationKeys) -> tuple[list[str], list[str], list[str]]:
    """``(manifest, part records, everything else)``: the three batches, deleted in order."""
    manifest = manifest_key(job, gen.step)
    parts = parts_prefix(job, gen.step)
    first = [k for k in gen.keys if k == manifest]
    second = [k for k in gen.keys if k.startswith(parts)]
    rest = [k for k in gen.keys if k != manifest and not k.startswith(parts)]
    return first, second, rest


def _check_arguments(keep_last: int, abandoned_grace_s: float) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(
            f"keep_last must be an integer >= 1 (the newest committed generation is always "
            f"kept), not {keep_last!r}"
        )
    if not abandoned_grace_s >= 0:
        raise ValueError(f"abandoned_grace_s must be >= 0 seconds, not {abandoned_grace_s!r}")


# --- doing ----------------------------------------------------------------------------------


async def apply_retention(
    backend: Backend,
    job: str,
    *,
    keep_last: int,
    abandoned_grace_s: float,
    now: float | None = None,
    dry_run: bool = False,
) -> RetentionReport:
    """Apply the retention rules to ``job`` at ``backend`` (see the module docstring).

    ``now`` is the time abandoned generations are aged against (default: the current time;
    the destination's clock stamps the objects, so the grace period should dwarf clock skew).
    Raises BackendError when the job cannot be listed or its kept manifests cannot be read;
    an error while removing one generation is reported in ``failed`` and the run goes on.
    """
    _check_arguments(keep_last, abandoned_grace_s)
    generation_prefix(job, 0)  # validates the job name before anything is listed
    if now is None:
        now = time.time()
    generations = group_generations(job, await backend.list(f"{job}/"))
    valid, unreadable = await _validate_newest(backend, job, generations, keep_last)
    plan = plan_retention(
        generations,
        valid,
        unreadable,
        keep_last=keep_last,
        abandoned_grace_s=abandoned_grace_s,
        now=now,
    )
    deleted: list[int] = []
    abandoned: list[int] = []
    skipped = list(plan.skipped)
    failed: list[tuple[int, str]] = []
    # Oldest first: if a run is interrupted, what is left is the newer end of the history.
    for step in sorted(plan.delete_committed):
        if dry_run:
            deleted.append(step)
            continue
        try:
            await _delete_committed(backend, job, generations[step])
        except BackendError as exc:
            failed.append((step, f"removal interrupted: {exc}; the next run retries it"))
            continue
        log.info("retention removed committed generation %d of job %r", step, job)
        deleted.append(step)
    for step in sorted(plan.delete_abandoned):
        if dry_run:
            abandoned.append(step)
            continue
        try:
            removed = await _delete_abandoned(backend, job, generations[step])
        except BackendError as exc:
            failed.append((step, f"removal interrupted: {exc}; the next run retries it"))
            continue
        if removed:
            log.info("retention removed abandoned generation %d of job %r", step, job)
            abandoned.append(step)
        else:
            skipped.append((step, "committed while retention was removing it; kept"))
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
    _check_arguments(keep_last, abandoned_grace_s)
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


async def _validate_newest(
    backend: Backend, job: str, generations: Mapping[int, GenerationKeys], keep_last: int
) -> tuple[list[int], dict[int, str]]:
    """Read manifests newest first until ``keep_last`` valid ones are found.

    Only the generations that will be kept are read (normally ``keep_last`` small objects),
    never the older ones about to be removed.
    """
    valid: list[int] = []
    unreadable: dict[int, str] = {}
    for step in manifests_to_read(generations):
        if len(valid) == keep_last:
            break
        data = await backend.get_bytes(manifest_key(job, step))
        if data is None:
            # Listed a moment ago, gone now: another node's retention is removing it.
            unreadable[step] = "removed while this run was reading it"
            continue
        reason = _manifest_problem(job, step, data)
        if reason:
            log.warning("retention: %s: %s", manifest_key(job, step), reason)
            unreadable[step] = reason
        else:
            valid.append(step)
    return valid, unreadable


def _manifest_problem(job: str, step: int, data: bytes) -> str:
    """Why these bytes are not the valid manifest of ``job`` step ``step`` ("" if they are)."""
    try:
        manifest = Manifest.from_json(data)
    except ManifestError as exc:
        return f"unreadable: {exc}"
    if (manifest.job, manifest.generation) != (job, step):
        return f"it describes {manifest.job!r} generation {manifest.generation}"
    return ""


async def _delete_committed(backend: Backend, job: str, gen: GenerationKeys) -> None:
    manifest, parts, rest = deletion_order(job, gen)
    # The manifest goes alone and first; each batch starts only after the previous one
    # finished, so no shard is missing while its manifest can still be read.
    await _delete_all(backend, manifest)
    # Part records before shards: once they are gone no node re-running the commit step for
    # this generation (a daemon restarted with it in its journal) can publish it again.
    await _delete_all(backend, parts)
    await _delete_all(backend, rest)


async def _delete_abandoned(backend: Backend, job: str, gen: GenerationKeys) -> bool:
    """Remove an uncommitted generation; False (nothing but part records removed) if its
    manifest appeared since the listing."""
    _, parts, rest = deletion_order(job, gen)
    await _delete_all(backend, parts)
    # A node could have published between the listing and now (with its part records gone,
    # no node can from here on): never take shards from under a manifest.
    if await backend.get_bytes(manifest_key(job, gen.step)) is not None:
        return False
    await _delete_all(backend, rest)
    return True


async def _delete_all(backend: Backend, keys: Sequence[str]) -> None:
    """Delete ``keys`` with at most DELETE_CONCURRENCY in flight; the first failure cancels
    the rest and is raised as itself."""
    await for_each_bounded(keys, backend.delete, DELETE_CONCURRENCY)


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
