"""What a retention run knows of a job before it decides: its generation directories, the
newest manifests until ``keep_last`` valid ones are found, and the keys of only the generations
it may remove (retention.py's docstring says why the rest are never listed). Apart from
retention.py, which decides from it (with retention_plan.py) and removes.
"""

from __future__ import annotations

import logging

from ckptdrain.client.keys import generation_prefix, manifest_key, parse_generation_dir
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.keptmanifests import KeptManifests
from ckptdrain.daemon.latest import NOT_A_COMMIT, parse_manifest
from ckptdrain.daemon.retention_plan import GenerationKeys, group_generations
from ckptdrain.daemon.tombstone import is_tombstone

# Retention's own logger: its lines stay under the name operators know.
log = logging.getLogger("ckptdrain.daemon.retention")

# Generations listed at once: usually one goes per commit, many on a first `gc` of a long job.
LIST_CONCURRENCY = 4

async def survey(
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
