"""``ckptdrain restore``: a committed generation copied into a directory, checked as it lands.

Each file is written under a temp name beside its final name, its size and checksum checked
while it is written, and renamed into place only if they match; the manifest goes last, so a
restored directory says what it holds. A failed restore leaves the target as it found it. A
shard with a verified copy on this node is taken from it (the daemon's fast path) instead of
the destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ckptdrain.client.manifest import TMP_SUFFIX, Manifest, ShardEntry, manifest_key, shard_key
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.backends.posixfs import NAME_MAX, RANDOM_HEX
from ckptdrain.daemon.catalog import CatalogError, resolve
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.threads import in_thread, outlast

__all__ = ["LocalSource", "RestoreError", "RestoreReport", "restore"]

log = logging.getLogger(__name__)


class RestoreError(CatalogError):
    """A restore stopped: a shard is damaged or would land outside the target directory."""


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
    await in_thread(made.makedirs, Path(to_dir))
    root = await in_thread(Path(to_dir).resolve)
    lock = await in_thread(_lock_target, root)  # refused: nothing of this restore's to undo
    try:
        return await _restore_into(backend, manifest, root, concurrency, progress, local, made)
    except BaseException:
        # A failed restore leaves the target as it found it: no half checkpoint, no empty
        # directories (files it replaced under --overwrite are not brought back, and an
        # earlier restore's MANIFEST.json there is gone, so the mix is no checkpoint). Every
        # thread call is settled before this runs, so none creates a file after it.
        await in_thread(made.undo)
        raise
    finally:
        os.close(lock)


def _lock_target(root: Path) -> int:
    """An fd holding an exclusive lock (flock) on the target directory for the restore's
    length; the kernel drops it when the fd closes, also when the process is killed. Found
    attacking restore: a second restore into the same directory took the first one's temp
    files for a killed restore's and removed them, and one of the two failed, or left a
    MANIFEST.json over files the other's undo had removed. A filesystem without flock goes
    unlocked."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RestoreError(f"another `ckptdrain restore` is writing into {root}; wait for it "
                           "to finish, or restore elsewhere") from None
    except OSError:
        pass
    return fd


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
    await in_thread(_unlink, root / "MANIFEST.json")
    stale = await in_thread(_remove_stale_temps, root, targets.values())
    if stale:
        log.info("removed %d temp files an earlier restore into %s left behind", stale, root)

    async def fetch(shard: ShardEntry) -> None:
        nonlocal written, local_files, local_rejected
        target = targets[shard.path]
        await in_thread(_makedirs_inside, root, target, made)
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
        if exc.kind in ("integrity", "not_found") and not await _still_there(backend, job, step):
            hint = ("; the generation was removed while it was restored (retention keeps the "
                    "newest retention.keep_last): restore a newer one (`ckptdrain ls` lists "
                    "them)")
        raise RestoreError(f"restore of {job!r} generation {step} failed: {exc}{hint}") from exc
    made.file(root / "MANIFEST.json")
    await in_thread(_write_file, root / "MANIFEST.json", manifest.to_json())
    return RestoreReport(job=job, step=step, files=len(manifest.shards), bytes=written, to_dir=root,
                         local_files=local_files, local_rejected=local_rejected)


async def _still_there(backend: Backend, job: str, step: int) -> bool:
    """Whether the generation's manifest is still at the destination (True when that cannot
    be told: the damage stays the likelier reading)."""
    try:
        return await backend.stat(manifest_key(job, step)) is not None
    except BackendError:
        return True


async def _write_local(local: LocalSource, target: Path, shard: ShardEntry) -> str:
    """"ok" when the local copy was written and matches the manifest's checksum; "missing"
    when there is none; "rejected" when it did not match (never trusted: the caller fetches
    the shard from the destination instead)."""
    tmp, fd = await _create_temp(target)
    outcome = "missing"
    try:
        checksum = await local(shard, fd)
        size = os.fstat(fd).st_size
        if checksum is not None:
            outcome = "ok" if checksum == shard.checksum and size == shard.size else "rejected"
        if outcome == "ok":
            await in_thread(os.replace, tmp, target)
    finally:
        if outcome != "ok":
            await in_thread(_unlink, tmp)
        os.close(fd)  # (its lock held until the temp name is gone: _remove_stale_temps)
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
        if size != shard.size:
            relation = "longer than" if size > shard.size else "shorter than"
            return size, (f"{shard.path} is {relation} the {shard.size} bytes the manifest "
                          f"lists ({size})")
        if checksum != shard.checksum:
            return size, (f"{shard.path} does not match its checksum in the manifest "
                          f"({checksum} != {shard.checksum})")
        try:
            await in_thread(os.replace, tmp, target)
        except OSError as exc:
            # Named by the shard's place, not the temp's (a directory there under --overwrite
            # said ".a.bin.<random>.ckptdrain-tmp: Is a directory"; found attacking restore).
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        done = True
        return size, ""
    finally:
        if not done:
            tmp.unlink(missing_ok=True)
        os.close(fd)  # (its lock held until the temp name is gone: _remove_stale_temps)


def _remove_stale_temps(root: Path, targets: Iterable[Path]) -> int:
    """Remove the temp files an earlier restore into ``root`` left when it was killed
    (``.<name>.<random>.ckptdrain-tmp`` beside a shard's place) from the directories this one
    writes; how many. Found attacking restore: the rerun with ``--overwrite`` that the docs
    advise after a kill left them beside the restored checkpoint, hundreds of MiB each. A
    name with that suffix is never a shard's (refused at hand-off), and a directory that
    resolves outside ``root`` (a planted link) is not looked into. A live restore holds a lock
    on each of its temp files (:func:`_open_temp`) until its name is gone: such a file is
    left (found attacking: a restore into a parent or a child of another's target removed
    that one's temp files, and it failed)."""
    removed = 0
    for directory in {target.parent for target in targets}:
        try:
            if not directory.resolve().is_relative_to(root):
                continue
            entries = list(os.scandir(directory))
        except OSError:  # not there yet (or not a directory: the restore says so)
            continue
        for entry in entries:
            if (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)
                    and entry.is_file(follow_symlinks=False)):
                removed += _remove_unheld(entry.path)
    return removed


def _remove_unheld(path: str) -> bool:
    """Unlink the temp file at ``path`` unless a live restore holds its lock (or it cannot be
    told: a filesystem without flock); whether it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone, or not ours to open: left
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:  # held by a live restore (BlockingIOError), or cannot be told
        return False
    finally:
        os.close(fd)
    return True


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(_temp_name(path.name))
    fd = _open_temp(tmp)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        os.close(fd)


def _temp_name(name: str) -> str:
    """``.<name>.<random>.ckptdrain-tmp``, the name part shortened to keep the whole within
    NAME_MAX, as the daemon's own temp names are (``posixfs.temp_name``). Found attacking
    restore: a shard's name may be 255 bytes (MAX_COMPONENT_BYTES), its temp name was 28
    more, and every restore of it failed "File name too long", from the destination and
    from the local copy alike. The sweep (:func:`_remove_stale_temps`) knows a temp file by
    its leading '.' and its suffix alone, so a shortened one is swept as well."""
    tail = f".{secrets.token_hex(RANDOM_HEX // 2)}{TMP_SUFFIX}"
    return f".{name[:NAME_MAX - 1 - len(tail)]}{tail}"


def _open_temp(tmp: Path) -> int:
    """Create ``tmp`` (readable too: the POSIX backend checksums what it wrote by mapping
    it) and lock it, so that another restore's sweep (:func:`_remove_unheld`) leaves it."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with contextlib.suppress(OSError):  # a filesystem without flock: unlocked
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


async def _create_temp(target: Path) -> tuple[Path, int]:
    """A new temp file beside ``target`` and its fd. Cancelled once the thread has created
    it, the file is closed and removed here: nobody else knows it exists."""
    tmp = target.with_name(_temp_name(target.name))
    future = asyncio.get_running_loop().run_in_executor(None, _open_temp, tmp)
    try:
        return tmp, await asyncio.shield(future)
    except asyncio.CancelledError:
        await outlast(future)
        if not future.cancelled() and future.exception() is None:
            os.close(future.result())
            tmp.unlink(missing_ok=True)
        raise
