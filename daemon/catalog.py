"""The read side of the commit protocol: what is committed, is it intact, and getting it back.

Used by ``ckptdrain ls / verify / restore`` and by the daemon to answer ``Client.latest``.
Only manifests count: a generation directory without ``MANIFEST.json`` is invisible here,
however many shards it holds, because a restart must only ever see committed generations.
Only the :class:`Backend` interface is used, so this works the same on POSIX and S3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from ckptdrain.client.errors import RejectedInput
from ckptdrain.client.manifest import (
    TMP_SUFFIX,
    Manifest,
    ManifestError,
    ShardEntry,
    generation_prefix,
    manifest_key,
    parse_generation_dir,
    shard_key,
)
from ckptdrain.client.names import validate_job
from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.latest import manifest_bytes, newest_committed, parse_manifest, read_latest
from ckptdrain.daemon.threads import outlast, settled

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


class RestoreError(CatalogError):
    """A restore stopped: a shard is damaged or would land outside the target directory."""


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


@dataclass(frozen=True)
class RestoreReport:
    job: str
    step: int
    files: int
    bytes: int
    to_dir: Path
    local_files: int = 0  # copied from this node's local copies (checksums verified)
    local_rejected: int = 0  # local copies whose checksum did not match: fetched remotely


# Restore's fast path: fill the open fd from a local copy of the shard; returns the checksum
# (with the manifest's algorithm) of what was written, or None when there is no local copy.
LocalSource = Callable[[ShardEntry, int], Awaitable[str | None]]


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
    the generation is not one a restart may use."""
    key = manifest_key(job, step)
    data = await manifest_bytes(backend, job, step)
    if data is None:
        return None
    try:
        manifest = await parse_manifest(data)
    except ManifestError as exc:
        log.warning("ignoring %s: %s", key, exc)
        return None
    if (manifest.job, manifest.generation) != (job, step):
        log.warning(
            "ignoring %s: it describes %r generation %d", key, manifest.job, manifest.generation
        )
        return None
    return manifest


async def list_generations(backend: Backend, job: str) -> list[GenerationInfo]:
    """Committed generations of ``job`` (manifest present and valid), newest first."""
    steps = await _manifest_steps(backend, job)
    found: dict[int, Manifest] = {}

    async def load(step: int) -> None:
        manifest = await read_manifest(backend, job, step)
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
    """The newest committed generation of ``job``, or None.

    The LATEST hint is trusted only when the manifest it names exists and parses, and even
    then only as a floor: a node can write a stale, lower hint over a newer one, so the
    generation directories above it are listed (one request, not a listing of shards) and
    the newest with a valid manifest wins. Never a step older than a generation whose
    manifest existed when the call began. ``use_hint=False`` skips the hint.
    """
    floor: int | None = None
    if use_hint:
        hinted = await read_latest(backend, job)
        if hinted is not None and await read_manifest(backend, job, hinted) is not None:
            floor = hinted
    newer = await newest_committed(backend, job, above=-1 if floor is None else floor)
    return newer if newer is not None else floor


async def resolve(backend: Backend, job: str, generation: int | Literal["latest"]) -> Manifest:
    """The manifest for ``generation`` (a step, or ``"latest"``), or NotCommitted."""
    if generation == "latest":
        step = await latest(backend, job)
        if step is None:
            raise NotCommitted(
                f"job {job!r} has no committed generation at {backend.uri}; "
                "check the job name with `ckptdrain ls`"
            )
    elif isinstance(generation, int) and not isinstance(generation, bool):
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
    backend: Backend, job: str, step: int | Literal["latest"], *, concurrency: int = 4,
    read: bool = False,
) -> VerifyReport:
    """Check every shard of a committed generation against its size and checksum.

    On a destination that validated each object's checksum when it was written and stores it
    (S3's full-object CRC64NVME), the stored checksum is compared without reading the bytes,
    unless ``read``; elsewhere (and for a shard without a stored checksum of the manifest's
    algorithm) every byte is re-read. Damage is reported, not raised: the report names every
    bad shard. Raises NotCommitted when there is no valid manifest, and BackendError when the
    destination itself fails.
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
                    await _hash(digest, chunk)
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

    await for_each_bounded(manifest.shards, check, concurrency)
    report.bad.sort()
    report.ok = not report.bad
    return report


# --- restore --------------------------------------------------------------------------------


async def restore(
    backend: Backend,
    job: str,
    step: int | Literal["latest"],
    to_dir: Path,
    *,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
    local: LocalSource | None = None,
) -> RestoreReport:
    """Copy a committed generation into ``to_dir`` (a loadable checkpoint directory).

    Each file is written under a temp name beside its final name, its checksum and size checked
    while writing, and renamed into place only if they match; a mismatch stops the restore with
    RestoreError naming the file. ``progress`` is called with each number of bytes written.
    The manifest is copied last, so a restored directory says what it holds and ``verify``
    can be re-run against it. Files are not fsynced: a restore is repeatable.
    """
    manifest = await resolve(backend, job, step)
    step = manifest.generation
    made = _Made()
    await _settled(made.makedirs, Path(to_dir))
    try:
        return await _restore_into(backend, manifest, await _settled(Path(to_dir).resolve),
                                   concurrency, progress, local, made)
    except BaseException:
        # A failed restore leaves the target as it found it: no half checkpoint, no empty
        # directories (files it replaced under --overwrite are not brought back, and an
        # earlier restore's MANIFEST.json there is gone, so the mix is no checkpoint). Every
        # thread call is settled before this runs, so none creates a file after it.
        await _settled(made.undo)
        raise


async def _restore_into(backend: Backend, manifest: Manifest, root: Path, concurrency: int,
                        progress: Callable[[int], None] | None, local: LocalSource | None,
                        made: _Made) -> RestoreReport:
    job, step = manifest.job, manifest.generation
    # Shard paths are validated when the manifest parses; this also refuses a symlink planted
    # in to_dir that would carry a write elsewhere.
    targets = {shard.path: _inside(root, shard.path) for shard in manifest.shards}
    written = local_files = local_rejected = 0
    # Under --overwrite the target may hold an earlier restore: its MANIFEST.json goes before
    # any file is replaced, so a restore that fails half-way leaves no directory claiming to
    # be a whole checkpoint (found attacking restore: the old manifest stayed, describing
    # files some of which were already another generation's).
    await _settled(_unlink, root / "MANIFEST.json")

    async def fetch(shard: ShardEntry) -> None:
        nonlocal written, local_files, local_rejected
        target = targets[shard.path]
        await _settled(_makedirs_inside, root, target, made)
        if local is not None:
            outcome = await _write_local(local, target, shard)
            if outcome == "ok":
                written += shard.size
                local_files += 1
                if progress is not None:
                    progress(shard.size)
                return
            if outcome == "rejected":
                local_rejected += 1
        count = await _write_verified(
            backend, shard_key(job, step, shard.path), target, shard, progress
        )
        written += count

    try:
        await for_each_bounded(manifest.shards, fetch, concurrency)
    except BackendError as exc:
        # A shard missing or not a file at the destination is the generation's damage, as a
        # checksum mismatch is: say what to do about it, as that one does.
        hint = ("; the generation at the destination is damaged: restore an older generation "
                "(`ckptdrain ls` lists them)" if exc.kind in ("integrity", "unsafe") else "")
        raise RestoreError(f"restore of {job!r} generation {step} failed: {exc}{hint}") from exc
    made.file(root / "MANIFEST.json")
    await _settled(_write_file, root / "MANIFEST.json", manifest.to_json())
    return RestoreReport(job=job, step=step, files=len(manifest.shards), bytes=written, to_dir=root,
                         local_files=local_files, local_rejected=local_rejected)


async def _write_local(local: LocalSource, target: Path, shard: ShardEntry) -> str:
    """"ok" when the local copy was written and matches the manifest's checksum; "missing"
    when there is none; "rejected" when it did not match (never trusted: the caller fetches
    the shard from the destination instead)."""
    tmp, fd = await _create_temp(target)
    outcome = "missing"
    try:
        try:
            checksum = await local(shard, fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if checksum is not None:
            outcome = "ok" if checksum == shard.checksum and size == shard.size else "rejected"
        if outcome == "ok":
            await _settled(os.replace, tmp, target)
    finally:
        if outcome != "ok":
            await _settled(_unlink, tmp)
    if outcome == "rejected":
        log.warning("local copy of %s failed its checksum; restoring it from the destination",
                    shard.path)
    return outcome


def _inside(root: Path, rel: str) -> Path:
    target = root.joinpath(*rel.split("/"))
    if not target.is_relative_to(root) or ".." in rel.split("/") or rel.startswith("/"):
        raise RestoreError(f"shard path {rel!r} would land outside {root}; refusing to restore")
    return target


class _Made:
    """What a restore created (directories, and files that did not exist before), so that a
    failed restore removes exactly that. Appended to from worker threads (list.append is
    atomic)."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.files: list[Path] = []

    def makedirs(self, directory: Path) -> None:
        missing = []
        for d in (directory, *directory.parents):
            if d.exists():
                break
            missing.append(d)
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue  # another worker made it: theirs to record
            self.dirs.append(d)
        if not directory.is_dir():
            raise RestoreError(f"{directory} exists and is not a directory; restore elsewhere")

    def file(self, path: Path) -> None:
        if not os.path.lexists(path):
            self.files.append(path)

    def undo(self) -> None:
        for f in self.files:
            with contextlib.suppress(OSError):
                f.unlink(missing_ok=True)
        for d in sorted(self.dirs, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()  # only if empty: never what was there before


def _makedirs_inside(root: Path, target: Path, made: _Made) -> None:
    directory = target.parent
    made.makedirs(directory)
    if not directory.resolve().is_relative_to(root):
        raise RestoreError(
            f"{directory} resolves outside {root} (a symlink?); restore into an empty directory"
        )
    made.file(target)


async def _write_verified(
    backend: Backend,
    key: str,
    target: Path,
    shard: ShardEntry,
    progress: Callable[[int], None] | None,
) -> int:
    # A shard that does not match the manifest is read once more before the destination is
    # blamed: bytes damaged on the way (a proxy, a resumed range) read right the second time,
    # and "the shard at the destination is damaged" sent operators to an older checkpoint
    # for nothing (found attacking). Twice the same way, it is the destination's. The second
    # read's bytes were counted by the first (no progress past 100%).
    size, problem = await _write_checked(backend, key, target, shard, progress)
    if problem:
        size, problem = await _write_checked(backend, key, target, shard, None)
    if problem:
        raise RestoreError(f"{problem}, read twice; the shard at the destination is damaged: "
                           "restore an older generation (`ckptdrain ls` lists them)")
    return size


async def _write_checked(
    backend: Backend,
    key: str,
    target: Path,
    shard: ShardEntry,
    progress: Callable[[int], None] | None,
) -> tuple[int, str]:
    """Copy ``key`` into a temp file beside ``target`` and rename it into place if it is the
    shard the manifest lists: (its size, "") or (its size, what is wrong with it)."""
    tmp, fd = await _create_temp(target)
    # The temp exists from here: renamed when verified, unlinked on every other way out.
    done = False
    try:
        try:
            size, checksum = await backend.copy_into(key, fd, algo=shard.algo,
                                                     progress=progress, owned=True,
                                                     expected_size=shard.size)
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            # A write into the file without its name (pwritev): the target named, or a full
            # disk said only "No space left on device" (found attacking).
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        finally:
            os.close(fd)
        if size != shard.size:
            relation = "longer than" if size > shard.size else "shorter than"
            return size, (f"{shard.path} is {relation} the {shard.size} bytes the manifest "
                          f"lists ({size})")
        if checksum != shard.checksum:
            return size, (f"{shard.path} does not match its checksum in the manifest "
                          f"({checksum} != {shard.checksum})")
        await _settled(os.replace, tmp, target)
        done = True
        return size, ""
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# --- bounded concurrency --------------------------------------------------------------------


async def for_each_bounded(
    items: Sequence[_T], fn: Callable[[_T], Awaitable[object]], concurrency: int
) -> None:
    """Run ``fn`` over ``items`` with at most ``concurrency`` in flight, all owned by one
    TaskGroup; the first failure cancels the rest and is raised as itself."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    work: Iterator[_T] = iter(items)

    async def worker() -> None:
        # Workers pull from one iterator: no task per shard, so 100,000 shards cost
        # `concurrency` tasks, not 100,000.
        for item in work:
            await fn(item)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(items))):
                group.create_task(worker())
    except BaseExceptionGroup as group_exc:
        raise group_exc.exceptions[0] from None


async def _hash(digest: checksums.Digest, chunk: bytes) -> None:
    if len(chunk) >= _THREAD_HASH_BYTES:
        await _settled(digest.update, chunk)
    else:
        digest.update(chunk)


async def _create_temp(target: Path) -> tuple[Path, int]:
    """A new temp file beside ``target`` and its fd. Cancelled once the thread has created
    it, the file is closed and removed here: nobody else knows it exists."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
    # Readable too: the POSIX backend checksums what it wrote by mapping this file.
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    future = asyncio.get_running_loop().run_in_executor(None, os.open, tmp, flags, 0o644)
    try:
        return tmp, await asyncio.shield(future)
    except asyncio.CancelledError:
        await outlast(future)
        if not future.cancelled() and future.exception() is None:
            os.close(future.result())
            tmp.unlink(missing_ok=True)
        raise


async def _settled(fn: Callable[..., _T], *args: object) -> _T:
    """Run ``fn`` in a thread; if cancelled, wait for the thread to finish before re-raising,
    so no thread still writes to an fd the caller is about to close."""
    return await settled(asyncio.get_running_loop().run_in_executor(None, fn, *args))
