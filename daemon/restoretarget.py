"""The directory a restore writes into: its lock, the walk of its directories, its temp files,
and the undo of a failed restore.

Under the target, every directory is reached from a descriptor of the target one component at
a time, never through a symbolic link nor into the destination's own directory, and every file
is made, renamed and removed by its own name in its directory's descriptor: a link in the
target, or the destination met below it, is refused, naming it, before anything is written.
Apart from ``restore.py``, which decides what is written where (the local copy or the
destination, checked against the manifest): this module is how any file gets there, and the
one place a path under the target is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptdrain.client.manifest import TMP_SUFFIX
from ckptdrain.daemon.backends.posixfs import NAME_MAX
from ckptdrain.daemon.backends.posixtemps import RANDOM_HEX
from ckptdrain.daemon.catalog import CatalogError
from ckptdrain.daemon.threads import outlast


class RestoreError(CatalogError):
    """A restore stopped: a shard is damaged or would land outside the target directory."""


def lock_target(root: Path) -> int:
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


def inside(root: Path, rel: str) -> Path:
    target = root.joinpath(*rel.split("/"))
    if not target.is_relative_to(root) or ".." in rel.split("/") or rel.startswith("/"):
        raise RestoreError(f"shard path {rel!r} would land outside {root}; refusing to restore")
    return target


class Made:
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

    def undo(self, walk: Walk) -> None:
        """Remove what was made, below the target as the restore reached it: by name in its
        directory's descriptor, never through a link. Found attacking restore: removed by
        path, a directory it made, swapped for a link while a later shard was read, led the
        undo out of the target to unlink a file of a shard's name where the link pointed.
        ``--to`` and the parents made for it are removed by path (empty only, as they are
        the operator's own path)."""
        for f in self.files:
            _remove_below(walk, f, os.unlink)
        for d in sorted(self.dirs, key=lambda p: len(p.parts), reverse=True):
            if d.is_absolute() and d != walk.root and d.is_relative_to(walk.root):
                _remove_below(walk, d, os.rmdir)  # only if empty: never what was there before
            else:
                with contextlib.suppress(OSError):
                    d.rmdir()


def _remove_below(walk: Walk, path: Path, remove: Callable[..., None]) -> None:
    """``remove(name, dir_fd=...)`` of ``path``, below the target, in its directory reached
    as :func:`open_dir` does; left where that meets a link (or it is gone)."""
    *parts, name = path.relative_to(walk.root).parts
    with contextlib.suppress(OSError, RestoreError):
        fd = open_dir(walk, parts, None)
        if fd is None:
            return
        try:
            remove(name, dir_fd=fd)
        finally:
            os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Walk:
    """The target as its directories are walked: its locked descriptor, its path, and the
    (st_dev, st_ino) of the directory no file may land in (a file:// destination's root)."""

    root_fd: int
    root: Path
    keep_out: tuple[int, int] | None


def identity(path: Path | None) -> tuple[int, int] | None:
    """``path``'s (st_dev, st_ino), links followed; None for no path, or none there."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def open_dir(walk: Walk, parts: Sequence[str], made: Made | None) -> int | None:
    """A descriptor of the directory ``root/parts``, reached from the target's descriptor one
    component at a time, never through a link: a link on the way is refused, naming it.
    Found attacking restore: with ``a -> .`` in the target, shards x.bin and a/x.bin were
    written to one file, "checksums verified"; with ``a -> /outside``, a/x/y/b.bin's
    directories were made in /outside before a check of the path refused it. The
    destination's directory is refused as a link is, known by identity: found attacking,
    with the destination bind-mounted at z/ of an --overwrite target (its path names no
    destination), a shard z/<job>/<step>/a.bin replaced another job's committed shard. A
    missing directory is made (and recorded in ``made``), or None returned when ``made`` is
    None."""
    fd = os.dup(walk.root_fd)
    try:
        for i, name in enumerate(parts):
            where = walk.root.joinpath(*parts[: i + 1])
            try:
                nxt = _open_component(fd, name, where)
            except FileNotFoundError:
                if made is None:
                    os.close(fd)
                    return None
                try:
                    os.mkdir(name, dir_fd=fd)
                    made.dirs.append(where)
                except FileExistsError:
                    pass  # another worker made it: theirs to record
                nxt = _open_component(fd, name, where)
            os.close(fd)
            fd = nxt
            _refuse_destination(walk, fd, where)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_component(dir_fd: int, name: str, where: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        # O_NOFOLLOW says ELOOP of a link, or ENOTDIR with O_DIRECTORY; ENOTDIR of a file.
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if not _is_link(dir_fd, name):
            raise RestoreError(f"{where} exists and is not a directory; restore elsewhere") from None
        raise RestoreError(
            f"{where} is a symbolic link, and restore writes nothing through a link in the "
            "target directory (it can lead outside it, or onto another shard's file); remove "
            "it, or restore into an empty directory") from None


def _refuse_destination(walk: Walk, fd: int, where: Path) -> None:
    """Refuse directory ``where`` (open as ``fd``) if it is the destination's."""
    if walk.keep_out is None:
        return
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) == walk.keep_out:
        raise RestoreError(f"{where} is inside the destination (it is the destination's "
                           "directory, under another path or a bind mount), where a restore "
                           "would write among committed files; restore elsewhere")


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def refuse_links(walk: Walk, dirs: Iterable[Sequence[str]]) -> None:
    """Refuse a link (or a file, or the destination) where any of ``dirs`` or their parents
    goes, before the restore changes anything: a shard's own walk would meet it only once
    others were written."""
    _refuse_destination(walk, walk.root_fd, walk.root)
    for parts in dirs:
        fd = open_dir(walk, parts, None)
        if fd is not None:
            os.close(fd)


def shard_dir(walk: Walk, rel: str, made: Made) -> int:
    """A descriptor of shard ``rel``'s directory, made where missing; a shard file that is not
    there yet is recorded in ``made``."""
    *parts, name = rel.split("/")
    root = walk.root
    fd = open_dir(walk, parts, made)
    assert fd is not None  # (made: never None)
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        made.files.append(root.joinpath(*parts, name))
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_stale_temps(walk: Walk, dirs: Iterable[Sequence[str]]) -> int:
    """Remove the temp files an earlier restore into ``root`` left when it was killed
    (``.<name>.<random>.ckptdrain-tmp`` beside a shard's place) from the directories this one
    writes (``dirs``, reached as :func:`open_dir` does: never behind a link); how many. Found
    attacking restore: the rerun with ``--overwrite`` that the docs advise after a kill left
    them beside the restored checkpoint, hundreds of MiB each. A name with that suffix is
    never a shard's (refused at hand-off). A live restore holds a lock on each of its temp
    files (:func:`_open_temp`) until its name is gone: such a file is left (found attacking:
    a restore into a parent or a child of another's target removed that one's temp files,
    and it failed)."""
    removed = 0
    for parts in dirs:
        fd = open_dir(walk, parts, None)
        if fd is None:
            continue  # not there yet
        try:
            with os.scandir(fd) as listing:
                entries = list(listing)
            for entry in entries:
                if (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)
                        and entry.is_file(follow_symlinks=False)):
                    removed += _remove_unheld(fd, entry.name)
        finally:
            os.close(fd)
    return removed


def _remove_unheld(dir_fd: int, name: str) -> bool:
    """Unlink the temp file ``name`` in ``dir_fd`` unless a live restore holds its lock (or it
    cannot be told: a filesystem without flock); whether it was removed."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False  # gone, or not ours to open: left
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(name, dir_fd=dir_fd)
    except OSError:  # held by a live restore (BlockingIOError), or cannot be told
        return False
    finally:
        os.close(fd)
    return True


def unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def unlink_in(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def put_in_place(dir_fd: int, tmp: str, target: Path) -> None:
    """Rename temp file ``tmp`` to ``target``'s name, both in ``dir_fd``."""
    try:
        os.replace(tmp, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        # Named by the shard's place, not the temp's (a directory there under --overwrite
        # said ".a.bin.<random>.ckptdrain-tmp: Is a directory"; found attacking restore).
        raise OSError(exc.errno, exc.strerror, str(target)) from exc


def write_file(root_fd: int, path: Path, data: bytes) -> None:
    """Write ``path``, a file directly in the target (``root_fd``), through a temp file."""
    tmp = _temp_name(path.name)
    fd = _open_temp(root_fd, tmp, path)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        put_in_place(root_fd, tmp, path)
    finally:
        unlink_in(root_fd, tmp)
        os.close(fd)


def _temp_name(name: str) -> str:
    """``.<name>.<random>.ckptdrain-tmp``, the name part shortened to keep the whole within
    NAME_MAX, as the daemon's own temp names are (``posixtemps.temp_name``). Found attacking
    restore: a shard's name may be 255 bytes (MAX_COMPONENT_BYTES), its temp name was 28
    more, and every restore of it failed "File name too long", from the destination and
    from the local copy alike. The sweep (:func:`remove_stale_temps`) knows a temp file by
    its leading '.' and its suffix alone, so a shortened one is swept as well."""
    tail = f".{secrets.token_hex(RANDOM_HEX // 2)}{TMP_SUFFIX}"
    return f".{name[:NAME_MAX - 1 - len(tail)]}{tail}"


def _open_temp(dir_fd: int, tmp: str, target: Path) -> int:
    """Create ``tmp`` in ``dir_fd``, ``target``'s directory (readable too: the POSIX backend
    checksums what it wrote by mapping it) and lock it, so that another restore's sweep
    (:func:`_remove_unheld`) leaves it."""
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=dir_fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(target)) from exc  # (the temp's name is ours)
    with contextlib.suppress(OSError):  # a filesystem without flock: unlocked
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


async def create_temp(dir_fd: int, target: Path) -> tuple[str, int]:
    """A new temp file beside ``target`` (in ``dir_fd``): its name and fd. Cancelled once the
    thread has created it, the file is closed and removed here: nobody else knows it exists."""
    tmp = _temp_name(target.name)
    return tmp, await open_fd(_open_temp, dir_fd, tmp, target,
                               lost=lambda: unlink_in(dir_fd, tmp))


async def open_fd(opener: Callable[..., int], *args: object,
                   lost: Callable[[], None] | None = None) -> int:
    """``opener(*args)``, which returns a new fd, in a thread. Cancelled once the thread has
    opened it, the fd is closed here (and ``lost`` called), since nobody else holds it."""
    future = asyncio.get_running_loop().run_in_executor(None, opener, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await outlast(future)
        if not future.cancelled() and future.exception() is None:
            os.close(future.result())
            if lost is not None:
                lost()
        raise
