"""The ``<job>/LATEST`` hint: read it, raise it, and find the commits it may lag behind.

LATEST names the newest committed step as decimal text. It is only a hint: writers raise it
after a manifest is published, and readers (catalog.latest) use it as a floor, never as the
answer, because without a compare-and-swap that works on every destination a node can write
a stale, lower step over a newer one. :func:`raise_latest` repairs that from the writer's side
and :func:`newest_committed` lets a reader look past it, both with one listing of the job's
generation directories.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ckptdrain.client.keys import STEP_DIGITS, latest_key, manifest_key, parse_generation_dir
from ckptdrain.client.manifest import Manifest, NewerFormat, PartRecord
from ckptdrain.client.names import MAX_STEP
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.tombstone import is_tombstone, was_committed

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_LATEST_MAX_BYTES = 64
# Write-then-check rounds of raise_latest: two racing writers settle within two.
LATEST_ROUNDS = 5
# Scans for the newest commit (catalog.latest) while retention removes what a scan found
# committed: each round needs another commit during the scan, so a few settle it.
LATEST_SCANS = 4
# JSON larger than this is parsed, built or serialised in a worker thread.
OFF_LOOP_BYTES = 1 << 20
# About how many bytes of JSON one shard's entry takes in a manifest or part record: what
# off_loop_if_large is told for a record not encoded yet.
PART_ENTRY_BYTES = 200


# What a MANIFEST.json key may hold that is no commit at all, beside invalid JSON: a symbolic
# link planted there ("unsafe") or an object over the small-object limit ("integrity"). Readers
# skip it as they skip invalid JSON (found attacking the read side: one such key in one
# generation failed `ls`, `verify` and `restore` of the whole job, and every save of it).
NOT_A_COMMIT = frozenset({"integrity", "unsafe"})


def parse_latest(data: bytes | None) -> int | None:
    """The step a LATEST hint names, or None when absent or not a valid step number."""
    if data is None:
        return None
    text = data.strip()
    if not text.isdigit() or len(text) > STEP_DIGITS:
        return None
    step = int(text)
    return step if step <= MAX_STEP else None


async def read_latest(backend: Backend, job: str) -> int | None:
    """The step ``<job>/LATEST`` names; None when absent, garbage, or not a hint we wrote:
    too large, or a symbolic link planted there (a hint only: readers list; found attacking,
    a link failed `verify` and `restore` of the job's latest, which `ls` listed fine)."""
    try:
        return parse_latest(await backend.get_bytes(latest_key(job), max_bytes=_LATEST_MAX_BYTES))
    except BackendError as exc:
        if exc.kind not in NOT_A_COMMIT:
            raise
        return None  # replaced by the next raise


async def raise_latest(backend: Backend, job: str, step: int) -> None:
    """Point LATEST at ``step``, or at a newer committed step, and never lower it for good.

    Destinations offer no compare-and-swap on one key that works everywhere (POSIX has none),
    so a node that read the hint just before another node raised it can write its older step
    over the newer one. Every writer therefore looks, after its write, for a committed
    generation newer than what it wrote, and writes that instead. Whoever writes last also
    checks last, and all manifests it could have lowered were created before its check, so
    the hint ends at the newest commit. A writer that dies between its write and its check
    can leave the hint low: readers treat it as a floor, never as the answer
    (catalog.latest). Bounded, so a store that keeps changing cannot hold a publish here.
    """
    key = latest_key(job)
    target = step
    for _ in range(LATEST_ROUNDS):
        current = await read_latest(backend, job)
        if current is not None and current >= target:
            return
        await backend.put_bytes(key, f"{target}\n".encode())
        newer = await newest_committed(backend, job, above=target)
        if newer is not None:
            target = newer
            continue
        current = await read_latest(backend, job)
        if current is not None and current >= target:
            return
    log.warning(
        "%s did not settle at step %d after %d rounds (another node keeps writing it); "
        "readers still find the newest commit by listing", key, target, LATEST_ROUNDS,
    )


async def manifest_bytes(backend: Backend, job: str, step: int) -> bytes | None:
    """What ``job`` step ``step``'s MANIFEST.json key holds; None when nothing, or when it
    holds what no commit can be (logged). Raises what the destination raises otherwise."""
    key = manifest_key(job, step)
    try:
        return await backend.get_bytes(key)
    except BackendError as exc:
        if exc.kind not in NOT_A_COMMIT:
            raise
        log.warning("ignoring %s: %s", key, exc)
        return None


async def newest_committed(backend: Backend, job: str, above: int, *,
                           removed: list[int] | None = None,
                           newer_format: bool = False) -> int | None:
    """The newest step of ``job`` above ``above`` with a valid manifest, or None (``removed``:
    as :func:`committed_above`). ``newer_format``: a manifest a newer ckptdrain wrote
    (:class:`NewerFormat`) raises rather than being passed by, for readers that must not
    answer an older step without saying why."""
    found = await _committed_manifests(backend, job, above, enough=1, removed=removed,
                                       newer_format=newer_format)
    return found[0][0] if found else None


async def committed_above(backend: Backend, job: str, above: int, *, enough: int,
                          look_at: int | None = None) -> list[int]:
    """Up to ``enough`` steps of ``job`` above ``above`` with a valid manifest, newest first.

    One listing of the job's generation directories (not of their shards), then a manifest
    read per directory, newest first, until ``enough`` are valid: directories above the newest
    commit are usually just the generations in flight. ``look_at`` bounds the directories
    read (the newest ones): a best effort for a question asked on every begin.
    """
    found = await _committed_manifests(backend, job, above, enough=enough, look_at=look_at)
    return [step for step, _ in found]


async def _committed_manifests(backend: Backend, job: str, above: int, *, enough: int,
                               look_at: int | None = None,
                               removed: list[int] | None = None,
                               newer_format: bool = False) -> list[tuple[int, Manifest]]:
    """:func:`committed_above`, with each step's manifest as read. ``removed`` gets the steps
    read whose key holds the tombstone of a committed generation (retention removed it: a
    newer commit exists). ``newer_format``: see :func:`newest_committed`."""
    steps = sorted(
        (
            step
            for name in await backend.list_dirs(f"{job}/")
            if (step := parse_generation_dir(name)) is not None and step > above
        ),
        reverse=True,
    )
    found: list[tuple[int, Manifest]] = []
    for step in steps[:look_at]:
        data = await manifest_bytes(backend, job, step)
        if data is None or is_tombstone(data):
            if removed is not None and data is not None and was_committed(data):
                removed.append(step)
            continue
        try:
            manifest = await parse_manifest(data)
        except NewerFormat as exc:
            if newer_format:
                exc.step = step
                raise
            continue
        except ManifestError:
            continue  # damaged: not a commit a restart may use (catalog logs it)
        if (manifest.job, manifest.generation) == (job, step):
            found.append((step, manifest))
            if len(found) >= enough:
                break
    return found


async def newest_commit(
    backend: Backend, job: str, read_hinted: Callable[[int], Awaitable[Manifest | None]] | None,
    *, newer_format: bool = False,
) -> tuple[int, Manifest] | None:
    """The newest committed generation of ``job`` and its manifest, as read once; None when
    it has none. The one lookup of "the newest commit": `latest`, `restore` and `verify` of
    "latest" (catalog) and the owner lookup (owners) all find it here.

    ``read_hinted`` reads the manifest of the step LATEST names (None: not a commit); the hint
    is trusted only as a floor, as a node can write a stale, lower hint over a newer one: the
    generation directories above it are listed (one request, not a listing of shards) and the
    newest with a valid manifest wins. ``read_hinted=None`` skips the hint. ``newer_format``:
    see :func:`newest_committed`.

    Never a step older than a generation whose manifest existed when the call began.
    Retention removes a committed generation only once newer ones committed, so one it
    removed during the scan, above the answer, was committed when the call began and its
    successors committed after the scan read their keys: the scan goes round again, a few
    times at most (found attacking: with commits landing during the scan, a job that always
    had a committed generation was answered "no committed generation", a restart from
    scratch; the owner lookup answered an older generation's owner, or none). The manifest
    is returned with the step, so a caller never reads it again: retention removing it
    between two reads failed `restore --generation latest` with "generation 30 is not
    committed" while 31 had just committed.
    """
    answer: tuple[int, Manifest] | None = None
    for _ in range(LATEST_SCANS):
        floor: tuple[int, Manifest] | None = None
        if read_hinted is not None:
            hinted = await read_latest(backend, job)
            if hinted is not None and (manifest := await read_hinted(hinted)) is not None:
                floor = (hinted, manifest)
        removed: list[int] = []
        newer = await _committed_manifests(backend, job, -1 if floor is None else floor[0],
                                           enough=1, removed=removed,
                                           newer_format=newer_format)
        answer = newer[0] if newer else floor
        if not any(answer is None or step > answer[0] for step in removed):
            return answer
    return answer


async def overtaken(backend: Backend, job: str, step: int, *, keep: int) -> list[int]:
    """The ``keep`` committed steps of ``job`` above ``step`` (newest first) when there are
    that many: retention (``keep_last = keep``) would remove ``step`` as soon as it committed,
    after its ``wait`` had said it was. Asked only when LATEST names a step above it, so the
    usual commit of a new newest step costs one small read; else []."""
    latest = await read_latest(backend, job)
    if latest is None or latest <= step:
        return []
    above = await committed_above(backend, job, step, enough=keep)
    return above if len(above) >= keep else []


async def off_loop_if_large(nbytes: int, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` on the loop when small (a thread hop costs more), in a worker thread when
    about ``nbytes`` of JSON is at stake: a 100,000-shard manifest is 20 MB of JSON, too much
    for the event loop."""
    if nbytes < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def parse_manifest(data: bytes) -> Manifest:
    """Every manifest the daemon reads is parsed here: a 10,000-shard manifest took 83 ms
    to parse and validate, a 50,000-shard one 430 ms, which on the event loop would stall
    every other client's hand-off (a ``wait`` or a local read asks for one)."""
    return await off_loop_if_large(len(data), Manifest.from_json, data)


async def parse_part(data: bytes) -> PartRecord:
    """:func:`parse_manifest` for one node's part record (as long as its node's shards)."""
    return await off_loop_if_large(len(data), PartRecord.from_json, data)
