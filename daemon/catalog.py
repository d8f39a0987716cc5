"""The read side of the commit protocol: what is committed, is it intact, and getting it back.

Used by ``ckptdrain ls / verify / restore`` and by the daemon to answer ``Client.latest``.
Only manifests count: a generation directory without ``MANIFEST.json`` is invisible here,
however many shards it holds, because a restart must only ever see committed generations.
Only the :class:`Backend` interface is used, so this works the same on POSIX and S3.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from ckptdrain.client.errors import RejectedInput
from ckptdrain.client.keys import generation_prefix, manifest_key, parse_generation_dir, shard_key
from ckptdrain.client.manifest import FORMAT_VERSION, Manifest, NewerFormat
from ckptdrain.client.names import validate_job
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.latest import manifest_bytes, newest_commit, parse_manifest
from ckptdrain.daemon.threads import in_thread
from ckptdrain.daemon.tombstone import is_tombstone

log = logging.getLogger(__name__)

_T = TypeVar("_T")

MANIFEST_READ_CONCURRENCY = 8
# Below this a chunk is hashed on the event loop; above it in a thread, where hashlib releases
# the GIL and several shards are hashed in parallel.
_THREAD_HASH_BYTES = 256 << 10


class CatalogError(DaemonError):
    """A catalog operation cannot be done; the message says why and what to do."""


class NotCommitted(CatalogError):
    """The generation has no (readable) manifest: it was never committed or was removed."""


class NeedsUpgrade(CatalogError):
    """The generation's manifest is in a format a newer ckptdrain writes: it is committed,
    and only a newer version reads it. Passed by as damage, `latest` and `restore --generation
    latest` answered an older step, and a step named outright was "not committed"."""


def _needs_upgrade(backend: Backend, job: str, step: int, exc: NewerFormat) -> NeedsUpgrade:
    return NeedsUpgrade(
        f"generation {step} of job {job!r} at {backend.uri} was committed by a newer ckptdrain "
        f"(its manifest has format_version {exc.version}; this version reads up to "
        f"{FORMAT_VERSION}): upgrade ckptdrain here to read it")


@dataclass(frozen=True)
class GenerationInfo:
    job: str
    step: int
    shards: int
    bytes: int
    committed_at: float
    nodes: tuple[str, ...]


@dataclass
class VerifyReport:
    ok: bool
    checked: int
    bytes: int
    bad: list[tuple[str, str]] = field(default_factory=list)
    # Shards checked by the checksum the destination stored, without reading their bytes.
    stored: int = 0


# --- listing --------------------------------------------------------------------------------


async def list_jobs(backend: Backend) -> list[str]:
    """Jobs with at least one generation holding a MANIFEST.json key, sorted.

    By directory, never key by key: the job directories in one listing, then each job's
    generation directories, and a ``stat`` of manifest keys newest first until one is there
    (usually the newest or the one below, which is in flight). Listing every key walked every
    shard of every generation: a million keys on a busy destination for a few job names."""
    names = [name for name in await backend.list_dirs("") if _is_job(name)]
    found: dict[str, bool] = {}

    # One job that cannot be read (a directory the daemon's user may not list, a manifest
    # key that is a link) is left out with a warning, as a listing of every key passed it
    # by: it stopped `ls` and `gc` of every other job (found attacking).
    async def probe(job: str) -> None:
        try:
            steps = await _manifest_steps(backend, job)
        except BackendError as exc:
            log.warning("leaving out job %s: %s", job, exc)
            return
        for step in steps:
            try:
                if await backend.stat(manifest_key(job, step), checksum=False) is not None:
                    found[job] = True
                    return
            except BackendError as exc:
                log.warning("ignoring %s: %s", manifest_key(job, step), exc)

    await for_each_bounded(names, probe, MANIFEST_READ_CONCURRENCY)
    return sorted(found)


def _is_job(name: str) -> bool:
    try:
        validate_job(name)
    except RejectedInput:
        return False
    return True


async def _manifest_steps(backend: Backend, job: str) -> list[int]:
    """Steps of ``job`` that have a generation directory, newest first: the ones whose
    MANIFEST.json may exist (not read here)."""
    steps = [
        step
        for name in await backend.list_dirs(f"{job}/")
        if (step := parse_generation_dir(name)) is not None
    ]
    return sorted(steps, reverse=True)


async def read_manifest(backend: Backend, job: str, step: int) -> Manifest | None:
    """The generation's manifest, or None when it is absent or damaged (logged): either way
    the generation is not one a restart may use. :class:`NeedsUpgrade` when a newer ckptdrain
    wrote it."""
    key = manifest_key(job, step)
    data = await manifest_bytes(backend, job, step)
    if data is None or is_tombstone(data):
        # Retention's own mark of a generation it removes: no commit, and no damage to
        # report either (`ls` warned of every one for an hour; found attacking retention).
        return None
    try:
        manifest = await parse_manifest(data)
    except NewerFormat as exc:
        raise _needs_upgrade(backend, job, step, exc) from None
    except ManifestError as exc:
        log.warning("ignoring %s: %s", key, exc)
        return None
    if (manifest.job, manifest.generation) != (job, step):
        log.warning(
            "ignoring %s: it describes %r generation %d", key, manifest.job, manifest.generation
        )
        return None
    return manifest


async def still_committed(backend: Backend, job: str, step: int) -> bool:
    """Whether ``job`` step ``step``'s manifest key still holds a manifest (not nothing, not
    retention's tombstone), asked of a generation found committed a moment ago whose shards
    went missing: False means it was removed meanwhile, not damaged. True when that cannot be
    told (the destination failed): the damage stays the likelier reading."""
    try:
        data = await backend.get_bytes(manifest_key(job, step))
    except BackendError:
        return True
    return data is not None and not is_tombstone(data)


async def removed_meanwhile(backend: Backend, job: str, step: int, exc: BackendError) -> bool:
    """Whether a shard that could not be read went because its generation was removed (its
    manifest key holds no manifest now), not because it is damaged: restore and the daemon's
    fetch then say "removed: load a newer one", not "damaged". (S3 says not_found of a missing
    object, POSIX integrity.) A tombstone at the key is retention's removal under way: it
    replaces a committed manifest in one write before any shard goes."""
    if exc.kind not in ("integrity", "not_found"):
        return False
    return not await still_committed(backend, job, step)


async def list_generations(backend: Backend, job: str) -> list[GenerationInfo]:
    """Committed generations of ``job`` (manifest present and valid), newest first."""
    steps = await _manifest_steps(backend, job)
    found: dict[int, Manifest] = {}

    async def load(step: int) -> None:
        try:
            manifest = await read_manifest(backend, job, step)
        except NeedsUpgrade as exc:  # the others are listed; this one says why it is not
            log.warning("ignoring %s: %s", manifest_key(job, step), exc)
            return
        if manifest is not None:
            found[step] = manifest

    await for_each_bounded(steps, load, MANIFEST_READ_CONCURRENCY)
    return [
        GenerationInfo(
            job=m.job,
            step=m.generation,
            shards=len(m.shards),
            bytes=m.total_bytes,
            committed_at=m.clocks["committed"],
            nodes=m.nodes,
        )
        for m in (found[step] for step in steps if step in found)
    ]


async def latest(backend: Backend, job: str, *, use_hint: bool = True) -> int | None:
    """The newest committed generation of ``job``, or None (:func:`newest`).
    ``use_hint=False`` skips the LATEST hint."""
    found = await newest(backend, job, use_hint=use_hint)
    return None if found is None else found.generation


async def newest(backend: Backend, job: str, *, use_hint: bool = True) -> Manifest | None:
    """The manifest of the newest committed generation of ``job``, read once; None when it
    has none (:func:`~ckptdrain.daemon.latest.newest_commit`: LATEST as a floor only, and a
    scan again when retention removed a commit above the answer meanwhile).
    :class:`NeedsUpgrade` when the newest commit is one a newer ckptdrain wrote: the answer
    is never an older step.
    """

    async def read_hinted(step: int) -> Manifest | None:
        return await read_manifest(backend, job, step)

    try:
        found = await newest_commit(backend, job, read_hinted if use_hint else None,
                                    newer_format=True)
    except NewerFormat as exc:
        assert exc.step is not None  # (the scan names it)
        raise _needs_upgrade(backend, job, exc.step, exc) from None
    return None if found is None else found[1]


async def resolve(backend: Backend, job: str,
                  generation: int | Literal["latest"] | Manifest) -> Manifest:
    """The manifest for ``generation`` (a step, or ``"latest"``), or NotCommitted. A manifest
    a caller resolved already is taken as is: a command resolves its generation once and
    passes the manifest on (read again, a step retention removed meanwhile, once a newer one
    committed, was "not committed"; found attacking `restore --generation latest`)."""
    if isinstance(generation, Manifest):
        if generation.job != job:
            raise ValueError(f"a manifest of job {generation.job!r} given for job {job!r}")
        return generation
    if generation == "latest":
        manifest = await newest(backend, job)
        if manifest is None:
            raise NotCommitted(
                f"job {job!r} has no committed generation at {backend.uri}; "
                "check the job name with `ckptdrain ls`"
            )
        return manifest
    if isinstance(generation, int) and not isinstance(generation, bool):
        step = generation
    else:
        raise ValueError(f"generation must be a step number or 'latest', not {generation!r}")
    manifest = await read_manifest(backend, job, step)
    if manifest is None:
        raise NotCommitted(
            f"generation {step} of job {job!r} is not committed at {backend.uri} (no valid "
            "MANIFEST.json); pick one listed by `ckptdrain ls`"
        )
    return manifest


# --- verify ---------------------------------------------------------------------------------


async def verify(
    backend: Backend, job: str, step: int | Literal["latest"] | Manifest, *, concurrency: int = 4,
    read: bool = False,
) -> VerifyReport:
    """Check every shard of a committed generation against its size and checksum.

    On a destination that validated each object's checksum when it was written and stores it
    (S3's full-object CRC64NVME), the stored checksum is compared without reading the bytes,
    unless ``read``; elsewhere (and for a shard without a stored checksum of the manifest's
    algorithm) every byte is re-read. Damage is reported, not raised: the report names every
    bad shard. Raises NotCommitted when there is no valid manifest, and BackendError when the
    destination itself fails. ``step``: a step, ``"latest"``, or the manifest :func:`resolve`
    gave (not read again).
    """
    manifest = await resolve(backend, job, step)
    step = manifest.generation
    report = VerifyReport(ok=True, checked=0, bytes=0)
    # One listing finds missing shards without a failed read per shard (and without relying
    # on how each backend words "not found").
    prefix = generation_prefix(job, step)
    present = {info.key[len(prefix) :] for info in await backend.list(prefix)}

    async def check(shard: ShardEntry) -> None:
        report.checked += 1
        if shard.path not in present:
            report.bad.append((shard.path, "missing at the destination"))
            return
        key = shard_key(job, step, shard.path)
        if not read and backend.validates_checksums:
            info = await backend.stat(key)
            if info is None:
                report.bad.append((shard.path, "missing at the destination"))
                return
            if (info.validated and info.checksum is not None
                    and info.checksum.partition(":")[0] == shard.algo):
                report.stored += 1
                if info.size != shard.size:
                    report.bad.append(
                        (shard.path, f"{info.size} bytes, the manifest lists {shard.size}"))
                elif info.checksum != shard.checksum:
                    report.bad.append((shard.path, f"stored checksum {info.checksum} != "
                                                   f"{shard.checksum} in the manifest"))
                return
        digest = checksums.for_checksum(shard.checksum)
        size = 0
        try:
            # Closed on every way out: a read broken off lets its connection go at once.
            async with contextlib.aclosing(backend.read_chunks(key)) as chunks:
                async for chunk in chunks:
                    size += len(chunk)
                    report.bytes += len(chunk)
                    if size > shard.size:
                        break  # already wrong; no need to read a runaway object to its end
                    await hash_chunk(digest, chunk)
        except BackendError as exc:
            if exc.kind != "integrity":
                raise
            report.bad.append((shard.path, f"unreadable: {exc}"))
            return
        if size > shard.size:
            report.bad.append((shard.path, f"longer than the {shard.size} bytes in the manifest"))
        elif size < shard.size:
            report.bad.append((shard.path, f"{size} bytes, the manifest lists {shard.size}"))
        elif digest.value() != shard.checksum:
            report.bad.append(
                (shard.path, f"{digest.value()} != {shard.checksum} in the manifest")
            )

    try:
        await for_each_bounded(manifest.shards, check, concurrency)
    except BackendError as exc:
        if exc.kind == "not_found" and not await still_committed(backend, job, step):
            raise _removed_while_verified(job, step) from exc
        raise
    if report.bad and not await still_committed(backend, job, step):
        # Found attacking: retention removing the generation under a verify (its manifest
        # first, then its shards) had it report missing shards and say "restore an older
        # generation", which retention removes first.
        raise _removed_while_verified(job, step)
    report.bad.sort()
    report.ok = not report.bad
    return report


def _removed_while_verified(job: str, step: int) -> NotCommitted:
    return NotCommitted(f"generation {step} of job {job!r} was removed while it was verified "
                        "(retention keeps the newest retention.keep_last): verify a newer one "
                        "(`ckptdrain ls` lists them)")


async def hash_chunk(digest: checksums.Digest, chunk: bytes) -> None:
    if len(chunk) >= _THREAD_HASH_BYTES:
        await in_thread(digest.update, chunk)
    else:
        digest.update(chunk)
