"""``ckptdrain restore``: a committed generation copied into a directory, checked as it lands.

Each file is written under a temp name beside its final name, its size and checksum checked
while it is written, and renamed into place only if they match; the manifest goes last, so a
restored directory says what it holds. A failed restore leaves the target as it found it. A
shard with a verified copy on this node is taken from it (the daemon's fast path) instead of
the destination.

How a file reaches the target (never through a link, never into the destination; locked, and
undone on failure) is ``restoretarget.py``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ckptdrain.client.keys import shard_key
from ckptdrain.client.manifest import Manifest
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.catalog import removed_meanwhile, resolve
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.restoretarget import (
    Made,
    RestoreError,
    Walk,
    create_temp,
    identity,
    inside,
    lock_target,
    open_fd,
    put_in_place,
    refuse_links,
    remove_stale_temps,
    shard_dir,
    unlink,
    unlink_in,
    write_file,
)
from ckptdrain.daemon.threads import in_thread

__all__ = ["LocalSource", "RestoreError", "RestoreReport", "restore"]

log = logging.getLogger(__name__)


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


async def restore(
    backend: Backend,
    job: str,
    step: int | Literal["latest"] | Manifest,
    to_dir: Path,
    *,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
    local: LocalSource | None = None,
    keep_out: Path | None = None,
) -> RestoreReport:
    """Copy a committed generation into ``to_dir`` (a loadable checkpoint directory).

    Each file is written under a temp name beside its final name, its checksum and size checked
    while writing, and renamed into place only if they match; a mismatch stops the restore with
    RestoreError naming the file. ``progress`` is called with each number of bytes written.
    The manifest is copied last, so a restored directory says what it holds and ``verify``
    can be re-run against it. Files are not fsynced: a restore is repeatable. ``keep_out``
    (a ``file://`` destination's root) is a directory no file may land in: met below
    ``to_dir``, under any path, it is refused before anything is written. ``step``: a step,
    ``"latest"``, or the manifest ``catalog.resolve`` gave (not read again).
    """
    manifest = await resolve(backend, job, step)
    step = manifest.generation
    keep_out_id = await in_thread(identity, keep_out)
    made = Made()
    await in_thread(made.makedirs, Path(to_dir))
    root = await in_thread(Path(to_dir).resolve)
    lock = await in_thread(lock_target, root)  # refused: nothing of this restore's to undo
    walk = Walk(lock, root, keep_out_id)
    try:
        return await _restore_into(backend, manifest, walk, concurrency, progress, local, made)
    except BaseException:
        # A failed restore leaves the target as it found it: no half checkpoint, no empty
        # directories (files it replaced under --overwrite are not brought back, and an
        # earlier restore's MANIFEST.json there is gone, so the mix is no checkpoint). Every
        # thread call is settled before this runs, so none creates a file after it.
        await in_thread(made.undo, walk)
        raise
    finally:
        os.close(lock)


async def _restore_into(backend: Backend, manifest: Manifest, walk: Walk,
                        concurrency: int, progress: Callable[[int], None] | None,
                        local: LocalSource | None, made: Made) -> RestoreReport:
    job, step = manifest.job, manifest.generation
    root, root_fd = walk.root, walk.root_fd
    # Shard paths are validated when the manifest parses; checked here all the same.
    targets = {shard.path: inside(root, shard.path) for shard in manifest.shards}
    dirs = {tuple(shard.path.split("/")[:-1]) for shard in manifest.shards}
    # A link (or the destination) among the shards' directories is refused before anything
    # is changed.
    await in_thread(refuse_links, walk, dirs)
    written = local_files = local_rejected = 0
    # Under --overwrite the target may hold an earlier restore: its MANIFEST.json goes before
    # any file is replaced, so a restore that fails half-way leaves no directory claiming to
    # be a whole checkpoint (found attacking restore: the old manifest stayed, describing
    # files some of which were already another generation's).
    await in_thread(unlink, root / "MANIFEST.json")
    stale = await in_thread(remove_stale_temps, walk, dirs)
    if stale:
        log.info("removed %d temp files an earlier restore into %s left behind", stale, root)

    async def fetch(shard: ShardEntry) -> None:
        nonlocal written, local_files, local_rejected
        target = targets[shard.path]
        where = await open_fd(shard_dir, walk, shard.path, made)
        try:
            if local is not None:
                outcome = await _write_local(local, where, target, shard)
                if outcome == "ok":
                    written += shard.size
                    local_files += 1
                    if progress is not None:
                        progress(shard.size)
                    return
                if outcome == "rejected":
                    local_rejected += 1
            count = await _write_verified(
                backend, shard_key(job, step, shard.path), where, target, shard, progress
            )
            written += count
        finally:
            os.close(where)

    try:
        await for_each_bounded(manifest.shards, fetch, concurrency)
    except BackendError as exc:
        # A shard missing or not a file at the destination is the generation's damage, as a
        # checksum mismatch is: say what to do about it, as that one does. Unless the
        # manifest went too: then retention (or an operator) removed the generation while it
        # was read, and "damaged: restore an older one" sent the user to what goes first
        # (found attacking).
        # (S3 says not_found of a missing shard, where POSIX says integrity; a missing bucket
        # is no damage of the generation's.)
        damaged = exc.kind in ("integrity", "unsafe") or (
            exc.kind == "not_found" and getattr(exc, "code", "") != "NoSuchBucket")
        hint = ("; the generation at the destination is damaged: restore an older generation "
                "(`ckptdrain ls` lists them)" if damaged else "")
        if await removed_meanwhile(backend, job, step, exc):
            hint = ("; the generation was removed while it was restored (retention keeps the "
                    "newest retention.keep_last): restore a newer one (`ckptdrain ls` lists "
                    "them)")
        raise RestoreError(f"restore of {job!r} generation {step} failed: {exc}{hint}") from exc
    made.file(root / "MANIFEST.json")
    await in_thread(write_file, root_fd, root / "MANIFEST.json", manifest.to_json())
    return RestoreReport(job=job, step=step, files=len(manifest.shards), bytes=written, to_dir=root,
                         local_files=local_files, local_rejected=local_rejected)


async def _write_local(local: LocalSource, dir_fd: int, target: Path, shard: ShardEntry) -> str:
    """"ok" when the local copy was written and matches the manifest's checksum; "missing"
    when there is none; "rejected" when it did not match (never trusted: the caller fetches
    the shard from the destination instead). ``dir_fd`` is ``target``'s directory."""
    tmp, fd = await create_temp(dir_fd, target)
    outcome = "missing"
    try:
        checksum = await local(shard, fd)
        size = os.fstat(fd).st_size
        if checksum is not None:
            outcome = "ok" if checksum == shard.checksum and size == shard.size else "rejected"
        if outcome == "ok":
            await in_thread(put_in_place, dir_fd, tmp, target)
    finally:
        if outcome != "ok":
            await in_thread(unlink_in, dir_fd, tmp)
        os.close(fd)  # (its lock held until the temp name is gone: remove_stale_temps)
    if outcome == "rejected":
        log.warning("local copy of %s failed its checksum; restoring it from the destination",
                    shard.path)
    return outcome


async def _write_verified(
    backend: Backend,
    key: str,
    dir_fd: int,
    target: Path,
    shard: ShardEntry,
    progress: Callable[[int], None] | None,
) -> int:
    # A shard that does not match the manifest is read once more before the destination is
    # blamed: bytes damaged on the way (a proxy, a resumed range) read right the second time,
    # and "the shard at the destination is damaged" sent operators to an older checkpoint
    # for nothing (found attacking). Twice the same way, it is the destination's. The second
    # read's bytes were counted by the first (no progress past 100%).
    size, problem = await _write_checked(backend, key, dir_fd, target, shard, progress)
    if problem:
        size, problem = await _write_checked(backend, key, dir_fd, target, shard, None)
    if problem:
        raise RestoreError(f"{problem}, read twice; the shard at the destination is damaged: "
                           "restore an older generation (`ckptdrain ls` lists them)")
    return size


async def _write_checked(
    backend: Backend,
    key: str,
    dir_fd: int,
    target: Path,
    shard: ShardEntry,
    progress: Callable[[int], None] | None,
) -> tuple[int, str]:
    """Copy ``key`` into a temp file beside ``target`` (in ``dir_fd``) and rename it into
    place if it is the shard the manifest lists: (its size, "") or (its size, what is wrong
    with it)."""
    tmp, fd = await create_temp(dir_fd, target)
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
        if size != shard.size:
            relation = "longer than" if size > shard.size else "shorter than"
            return size, (f"{shard.path} is {relation} the {shard.size} bytes the manifest "
                          f"lists ({size})")
        if checksum != shard.checksum:
            return size, (f"{shard.path} does not match its checksum in the manifest "
                          f"({checksum} != {shard.checksum})")
        await in_thread(put_in_place, dir_fd, tmp, target)
        done = True
        return size, ""
    finally:
        if not done:
            unlink_in(dir_fd, tmp)
        os.close(fd)  # (its lock held until the temp name is gone: remove_stale_temps)


