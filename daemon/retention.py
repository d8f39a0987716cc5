"""Retention: which generations of a job stay at the destination, and removing the rest.

Rules (docs/layout.md, "Retention"):

- Keep the newest ``keep_last`` committed generations (manifest present and valid). The newest
  committed generation is never deleted, since ``keep_last`` is at least 1.
- An older committed generation loses its ``MANIFEST.json`` first, then a tombstone takes the
  key (below), then its part records go, then its shards. The manifest is the commit point, so
  from the moment any shard is gone no reader can see a manifest that lists it; a crash in the
  middle leaves an uncommitted directory, which the abandoned rule below removes on a later
  run.
- An uncommitted generation (no manifest) older than the newest committed one is abandoned once
  nothing under it has been written for ``abandoned_grace_s``: a node died or a rank aborted.
  Uncommitted generations newer than the newest committed one may be in flight: never touched.
- A generation whose manifest exists but cannot be read is not counted as committed and is
  kept for inspection until ``keep_last`` newer valid generations exist. One whose manifest
  key no reader reads (a link, an oversized object, no regular file) is kept for good: retention can neither
  read it nor take the key with a tombstone, so it deletes nothing of it.

Removing an abandoned generation races a late publish of it (a slow node may still hold every
part record), and so does removing a committed one (another node of the job running its own
commit step of it). The two meet at the one key both must create, ``MANIFEST.json``:
retention first creates it exclusively, holding a tombstone (tombstone.py; a committed
generation's right after its manifest is deleted), and deletes shards only if that create
succeeded or found a tombstone; a publish whose create finds the tombstone does not commit
(it hears "committed" where the tombstone says the generation was). So whichever create
lands first wins, on S3 as on POSIX, and no manifest ever lists deleted shards. Two separate keys (an ``ABANDONED`` marker beside the manifest) would not do: each
side would write its key and then read the other's, and on a store without multi-key
transactions both reads can come before both writes. The tombstone stays for one grace period
after the shards are gone, so that a publisher which read the part records just before they
were deleted finds it too; a later run removes it.

A run lists what it decides on, not the whole job: the generation directories (one request),
the newest manifests until ``keep_last`` valid ones are found, and then only the generations it
may remove (older than the newest commit, or tombstoned). The kept generations' shards are
never listed: a job with 10,000-shard generations and ``keep_last = 3`` lists about 10,000
keys per commit, not 40,000. Each generation is decided from its own listing and the
manifests read, so the runs of several nodes may overlap: deletes are idempotent, a key that
is already gone is not an error, and the tombstone settles every race with a publish. Only
the :class:`Backend` interface is used, so POSIX and S3 behave the same.

Planning (retention_plan.py) is pure; :func:`apply_retention` does the I/O around it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptdrain.client.keys import generation_prefix, latest_key, manifest_key, parse_generation_dir
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon import catalog
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.keptmanifests import KeptManifests
from ckptdrain.daemon.latest import NOT_A_COMMIT, parse_manifest, raise_latest, read_latest
from ckptdrain.daemon.retention_plan import (
    GenerationKeys,
    RetentionPlan,
    check_arguments,
    deletion_order,
    group_generations,
    plan_retention,
)
from ckptdrain.daemon.tombstone import is_tombstone, placed_at, tombstone_json, was_committed

# Re-exported: retention's planning lived here first.
__all__ = [
    "GenerationKeys", "RetentionPlan", "RetentionReport", "apply_retention", "deletion_order",
    "gc", "group_generations", "plan_retention",
]

log = logging.getLogger(__name__)

# Generations listed at once: usually one goes per commit, many on a first `gc` of a long job.
LIST_CONCURRENCY = 4


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



class _Abandoned(enum.Enum):
    REMOVED = "removed"  # shards and part records gone (the tombstone may stay a while)
    TOMBSTONE_KEPT = "kept"  # only a tombstone left, younger than the grace period
    COMMITTED = "committed"  # a manifest was created before the tombstone: nothing removed
    # The tombstone of a committed generation (its removal was reported when it began):
    RETIRED_REMOVED = "retired_removed"  # an interrupted removal finished now
    RETIRED = "retired"  # nothing left but the tombstone, or not even that now: say nothing


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
    generations, valid, unreadable, tombstoned, empty = await _survey(backend, job, keep_last,
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
            held = (await _read_manifest_key(backend, job, step)
                    if committed or dry_run else None)
            tomb = held if held is not None and is_tombstone(held) else None
            if dry_run and committed and tomb is None:
                deleted.append(step)
                continue
            if dry_run:  # a tombstoned or abandoned step: as the real run would settle it
                outcome = _foreseen(job, gen, tomb, now, abandoned_grace_s)
                if outcome is _Abandoned.RETIRED_REMOVED:
                    deleted.append(step)
                elif outcome is _Abandoned.REMOVED:
                    abandoned.append(step)
                elif outcome is _Abandoned.TOMBSTONE_KEPT:
                    skipped.append((step, _kept_tombstone(abandoned_grace_s)))
                continue
            if committed and tomb is None:
                if await _delete_committed(backend, job, gen, now, held):
                    log.info("retention removed committed generation %d of job %r", step, job)
                    deleted.append(step)
                else:
                    skipped.append((step, "published again while retention was removing it "
                                          "(its shards were all there); kept"))
                continue
            outcome = await _delete_abandoned(backend, job, gen, now, abandoned_grace_s)
        except _NotUsable as exc:
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
        if outcome is _Abandoned.RETIRED:
            continue
        if outcome is _Abandoned.RETIRED_REMOVED:
            log.info("retention removed committed generation %d of job %r", step, job)
            deleted.append(step)
        elif outcome is _Abandoned.REMOVED:
            log.info("retention removed abandoned generation %d of job %r", step, job)
            abandoned.append(step)
        elif outcome is _Abandoned.TOMBSTONE_KEPT:
            skipped.append((step, _kept_tombstone(abandoned_grace_s)))
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


async def _survey(
    backend: Backend, job: str, keep_last: int, kept: KeptManifests | None = None,
) -> tuple[dict[int, GenerationKeys], list[int], dict[int, str], set[int], list[int]]:
    """What retention needs to know of ``job``: (its generations, the valid steps newest first,
    the unreadable ones with the reason, the tombstoned ones, the steps it may remove whose
    directories hold no key).

    Manifests are read newest first until ``keep_last`` valid ones are found, never the older
    ones about to be removed; with ``kept``, a large manifest an earlier run found valid is
    checked by a stat instead (keptmanifests.py). Only the generations a run may remove are
    listed key by key:
    those older than the newest commit and not kept, and tombstoned ones. The others stand
    for themselves with no keys (kept, in flight, or kept for inspection: none is deleted).
    """
    steps = sorted(
        (step for name in await backend.list_dirs(f"{job}/")
         if (step := parse_generation_dir(name)) is not None),
        reverse=True,
    )
    valid: list[int] = []
    unreadable: dict[int, str] = {}
    tombstoned: set[int] = set()
    present: dict[int, bool] = {}  # read: whether a manifest key held anything
    for step in steps:
        if len(valid) == keep_last:
            break
        if kept is not None and await _still_valid(backend, kept, job, step):
            present[step] = True
            valid.append(step)
            continue
        try:
            data = await backend.get_bytes(manifest_key(job, step))
        except BackendError as exc:
            if exc.kind not in NOT_A_COMMIT:
                raise
            # A link or an oversized object at the key: unreadable, as invalid JSON is (it
            # failed every retention run of the job).
            present[step] = True
            unreadable[step] = str(exc)
            log.warning("retention: %s: %s", manifest_key(job, step), exc)
            continue
        present[step] = data is not None
        if data is None:
            continue  # uncommitted (or removed since the listing by another node's run)
        if is_tombstone(data):
            tombstoned.add(step)
            continue
        reason = await _manifest_problem(job, step, data)
        if reason:
            log.warning("retention: %s: %s", manifest_key(job, step), reason)
            unreadable[step] = reason
        else:
            valid.append(step)
            if kept is not None and len(data) >= kept.min_bytes:
                info = await _stat_or_none(backend, manifest_key(job, step))
                if info is not None and info.modified is not None and info.size == len(data):
                    kept.remember(job, step, info.size, info.modified)
    if kept is not None:
        kept.keep_only(job, valid)
    newest = valid[0] if valid else None
    doomed = [s for s in steps if s not in valid and s not in unreadable
              and (s in tombstoned or (newest is not None and s < newest))]
    generations = {
        step: GenerationKeys(step=step, keys=(), has_manifest=found, newest_write=None)
        for step, found in present.items()
    }
    listed: dict[int, dict[int, GenerationKeys]] = {}

    async def list_one(step: int) -> None:
        listed[step] = group_generations(job, await backend.list(generation_prefix(job, step)))

    await for_each_bounded(doomed, list_one, LIST_CONCURRENCY)
    empty: list[int] = []
    for step in doomed:
        found = listed[step].get(step)
        if found is None:
            # Directories and no key: a removal interrupted before its directories went, or a
            # generation that never wrote a shard. Nothing to delete; the directories may go.
            generations.pop(step, None)
            empty.append(step)
        else:
            generations[step] = found
    return generations, valid, unreadable, tombstoned, empty


async def _still_valid(backend: Backend, kept: KeptManifests, job: str, step: int) -> bool:
    """Whether a manifest an earlier run found valid is still there as it was then."""
    known = kept.known(job, step)
    if known is None:
        return False
    info = await _stat_or_none(backend, manifest_key(job, step))
    return info is not None and (info.size, info.modified) == known


async def _stat_or_none(backend: Backend, key: str) -> ObjectInfo | None:
    """Size and write time of ``key`` without its checksum (POSIX: one fstat, never a hash
    nor an xattr write, which a full destination would refuse); None when it is absent or
    the stat failed: remembering is only a shortcut, and reading the manifest decides."""
    try:
        return await backend.stat(key, checksum=False)
    except BackendError as exc:
        log.info("retention: could not stat %s (%s); reading it instead", key, exc)
        return None


async def _manifest_problem(job: str, step: int, data: bytes) -> str:
    """Why these bytes are not the valid manifest of ``job`` step ``step`` ("" if they are)."""
    try:
        manifest = await parse_manifest(data)
    except ManifestError as exc:
        return f"unreadable: {exc}"
    if (manifest.job, manifest.generation) != (job, step):
        return f"it describes {manifest.job!r} generation {manifest.generation}"
    return ""


async def _committed_by(job: str, step: int,
                        data: bytes | None) -> tuple[int, tuple[str, ...]] | None:
    """The world size and nodes of the manifest ``data`` (None where it is no manifest of
    the step): what its tombstone says of it."""
    if data is None:
        return None
    try:
        manifest = await parse_manifest(data)
    except ManifestError:
        return None
    if (manifest.job, manifest.generation) != (job, step):
        return None
    return manifest.world_size, manifest.nodes


async def _delete_committed(backend: Backend, job: str, gen: GenerationKeys,
                            now: float, held: bytes | None) -> bool:
    """Remove a committed generation beyond keep_last (``held``: what its manifest key held
    when read just before); False where a publish recreated its manifest before the
    tombstone below (then nothing else was removed)."""
    by = await _committed_by(job, gen.step, held)
    manifest, parts, rest = deletion_order(job, gen)
    # The manifest goes alone and first; each batch starts only after the previous one
    # finished, so no shard is missing while its manifest can still be read.
    await _delete_all(backend, manifest)
    # Then the key is taken with a tombstone, as an abandoned generation's is. Found
    # attacking: a second node whose publish of this generation had checked the part records
    # and shards before they went, and created the manifest after it was deleted, brought it
    # back over a directory whose shards retention then deleted. Its create now meets the
    # tombstone; one that landed first means a manifest whose shards are all still there.
    key = manifest_key(job, gen.step)
    # It names the manifest's world size and nodes: a node still waiting on the step tells
    # from them whether its own part was the one committed (found attacking: one whose
    # attempt had been replaced by another node's heard its step committed).
    # A key that held no manifest of the step (damaged, or gone since the listing) committed
    # nothing anyone can name: its tombstone says not "was committed" (found attacking: a
    # node waiting on the step then heard it committed, from a tombstone that said nothing
    # more, as older ones do).
    tombstone = tombstone_json(job, gen.step, backend.node_id, now,
                               was_committed=by is not None, committed_by=by)
    if not await backend.put_bytes(key, tombstone, exclusive=True):
        data = await _read_manifest_key(backend, job, gen.step)
        if data is not None and not is_tombstone(data):
            return False
    # Part records before shards: once they are gone no node re-running the commit step for
    # this generation (a daemon restarted with it in its journal) can publish it again. The
    # tombstone stays one grace period (a later run removes it, as an abandoned one's).
    await _delete_all(backend, parts)
    await _delete_all(backend, rest)
    return True


def _kept_tombstone(grace_s: float) -> str:
    return (f"abandoned and removed; its tombstone stays until it is {grace_s:g}s old, so no "
            "late publish can commit it")


def _tombstone_written(gen: GenerationKeys, data: bytes | None, now: float,
                       grace_s: float) -> float | None:
    """When the tombstone at ``gen``'s manifest key was written: by its own word where that
    is later than the listing's time (found attacking: a run that listed a committed
    generation's old manifest just before another run replaced it by a tombstone took the
    manifest's age for the tombstone's and removed it at once, and a late publish then
    brought the manifest back). A time past ``now + grace_s`` is garbage: the listing's."""
    written = gen.manifest_written
    at = placed_at(data) if data is not None else None
    if at is not None and at <= now + grace_s:
        written = max(at, written or at)
    return written


def _settled(retired: bool, left: bool, tombstone_goes: bool) -> _Abandoned:
    """What removing a tombstoned generation comes to: ``left``, whether part records or
    shards were still there; ``tombstone_goes``, whether the tombstone is old enough to go."""
    if retired:
        return _Abandoned.RETIRED_REMOVED if left else _Abandoned.RETIRED
    return _Abandoned.REMOVED if left or tombstone_goes else _Abandoned.TOMBSTONE_KEPT


def _foreseen(job: str, gen: GenerationKeys, tomb: bytes | None, now: float,
              grace_s: float) -> _Abandoned:
    """What :func:`_delete_abandoned` would come to for ``gen`` (a dry run), its manifest key
    holding ``tomb`` (None: nothing yet, so this run's tombstone would go there)."""
    left = any(deletion_order(job, gen)[1:])
    if tomb is None:
        return _settled(False, left, False)
    written = _tombstone_written(gen, tomb, now, grace_s)
    return _settled(was_committed(tomb), left, written is not None and now - written >= grace_s)


async def _delete_abandoned(
    backend: Backend, job: str, gen: GenerationKeys, now: float, grace_s: float
) -> _Abandoned:
    """Remove an uncommitted generation, tombstone first (see the module docstring)."""
    key = manifest_key(job, gen.step)
    tombstone = tombstone_json(job, gen.step, backend.node_id, now)
    retired = False
    written: float | None = now  # this run's own tombstone
    if not await backend.put_bytes(key, tombstone, exclusive=True):
        data = await _read_manifest_key(backend, job, gen.step)
        if data is not None and not is_tombstone(data):
            # A node published before our create: it is committed now, and its shards stay.
            # (A damaged manifest stays too: the rules keep those for inspection.)
            return _Abandoned.COMMITTED
        # A tombstone (ours from an earlier run, or another node's running now), or gone
        # since (another run removed an old tombstone after the shards): finish the removal.
        retired = data is not None and was_committed(data)
        written = _tombstone_written(gen, data, now, grace_s)
    _, parts, rest = deletion_order(job, gen)
    await _delete_all(backend, parts)
    await _delete_all(backend, rest)
    goes = written is not None and now - written >= grace_s
    if goes:
        # A publisher that read the part records before they went has had a whole grace
        # period to reach its create and meet the tombstone: the key can go now.
        await backend.delete(key)
    return _settled(retired, bool(parts or rest), goes)


class _NotUsable(DaemonError):
    """The manifest key of a generation to remove holds what no reader takes for a commit
    and retention may neither read nor replace (a link, an oversized object, a FIFO, a
    directory: anything but a regular file)."""


async def _read_manifest_key(backend: Backend, job: str, step: int) -> bytes | None:
    """What the manifest key of ``step`` holds; :class:`_NotUsable` when it is no object a
    reader would read, before anything of the generation is deleted."""
    try:
        return await backend.get_bytes(manifest_key(job, step))
    except BackendError as exc:
        if exc.kind not in NOT_A_COMMIT:
            raise
        raise _NotUsable(str(exc)) from None


async def _delete_all(backend: Backend, keys: Sequence[str]) -> None:
    """Delete ``keys`` in bulk (Backend.delete_many: DeleteObjects on S3, a directory fsync
    per batch on POSIX); every delete is done and durable when this returns."""
    if keys:
        await backend.delete_many(keys)


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
