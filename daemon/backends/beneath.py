"""Paths under the POSIX destination root, resolved without following a symbolic link.

The daemon often runs as a more privileged user than the jobs that share the destination, and
those users may write to it: a symlink planted at ``<root>/<job>`` or
``<root>/<job>/<step>`` would otherwise redirect the daemon's own writes (shards, part
records, MANIFEST.json, LATEST, tombstones) wherever its owner likes. So every directory and
file under the root is reached from a descriptor of the root, one component at a time:
``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` where the kernel has it (Linux 5.6+), else
``openat(O_NOFOLLOW | O_DIRECTORY)`` per component. The last step of every operation (create,
link, rename, unlink, stat) is a ``*at`` call on a directory descriptor obtained that way, with
names that never hold a ``/``. A symlink met on the way is :class:`UnsafePath`: logged, and the
operation fails (the daemon serves on). The root itself is the operator's and is trusted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.logs import log_event

log = logging.getLogger("ckptdrain.daemon.backends.posix")

_CLOEXEC = os.O_CLOEXEC | os.O_NOFOLLOW
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
# O_NONBLOCK: opening a FIFO someone planted under a shard's name must not hang a thread.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC

# openat2(2), from <linux/openat2.h>; the syscall number is the same on every architecture
# that has it (the generic table).
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


class UnsafePath(BackendError):
    """A symbolic link (or a path leading out of the root) where the destination layout has
    a directory or a file: someone who can write to the destination planted it. Not
    transient; the operation is refused and nothing is written through it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False, kind="unsafe")


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64))


def _load_openat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return syscall


_syscall = _load_openat2()


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """``openat2(dir_fd, path, {flags, mode, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS})``; raises
    OSError like ``os.open`` (ENOSYS where the kernel or a seccomp filter lacks it)."""
    if _syscall is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)
    how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE)
    fd = _syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd),
                  ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                  ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


def kernel_has_openat2() -> bool:
    top = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(openat2(top, ".", DIR_FLAGS))
    except OSError:
        return False
    finally:
        os.close(top)
    return True


@dataclass(frozen=True)
class Entry:
    """A name in a directory under the root: ``dir`` components, then ``name`` (no '/')."""

    dir: tuple[str, ...]
    name: str

    def with_name(self, name: str) -> Entry:
        return Entry(self.dir, name)

    @property
    def parts(self) -> list[str]:
        return [*self.dir, self.name]


def link_in(dir_fd: int, src: str, dst: str) -> None:
    """link() within one directory; EEXIST when ``dst`` exists, a link there included."""
    os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)


class RootDevices:
    """The filesystem (``st_dev``) each destination root was on when this node last opened
    it, kept in a file on the node's own disk where the daemon says (:meth:`keep_in`) so a
    restart remembers it too (a node rebooted before its mounts came back)."""

    MAX_ROOTS = 64

    def __init__(self) -> None:
        self._devs: dict[str, int] = {}
        self._file: Path | None = None
        self._lock = threading.Lock()
        # What the file lacks (its write failed: a full disk); written at the next note.
        self._unsaved = False

    def keep_in(self, path: Path) -> None:
        with self._lock:
            self._file = path
            with contextlib.suppress(OSError, ValueError):
                loaded = json.loads(_read_no_link(path, 1 << 16))
                if isinstance(loaded, dict):
                    self._devs.update({str(k): v for k, v in loaded.items()
                                       if isinstance(v, int) and not isinstance(v, bool)})

    def get(self, root: Path) -> int | None:
        return self._devs.get(str(root))

    def note(self, root: Path, dev: int) -> None:
        key = str(root)
        if self._devs.get(key) == dev and not self._unsaved:
            return
        with self._lock:
            self._devs[key] = dev
            while len(self._devs) > self.MAX_ROOTS:
                del self._devs[next(iter(self._devs))]
            if self._file is None:
                return
            tmp = self._file.with_name(self._file.name + ".tmp")
            self._unsaved = True  # till the file has it: a write that failed (a full staging
            # disk) was not tried again till the root's filesystem changed (found fixing a full
            # staging disk's restart)
            with contextlib.suppress(OSError):  # best effort: the running daemon still knows
                # Never through a link planted at the temp name (found attacking): a fresh
                # file, made durable before it replaces the last.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, json.dumps(self._devs).encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self._file)
                self._unsaved = False


ROOT_DEVICES = RootDevices()


def _read_no_link(path: Path, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _unmounted_mount_point(directory: Path) -> bool:
    """Whether ``directory`` is empty, nothing is mounted on it, and its parent is no mount
    point either (a root made anew below a mount point whose filesystem came back fresh, on
    a new device, is no unmounted one)."""
    try:
        if os.path.ismount(directory) or os.path.ismount(directory.parent):
            return False
        with os.scandir(directory) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _unmounted(directory: Path) -> BackendError | None:
    """Why the missing root ``directory`` looks like a filesystem that is not mounted: its
    parent is missing too (``/lustre`` left an empty directory), or is on another filesystem
    than the root was when this node last opened it (:data:`ROOT_DEVICES`), or the root is a
    link to nowhere. None when only the root itself is missing (a new destination)."""
    parent = directory.parent
    if not os.path.lexists(parent):  # (a parent that is a file: mkdir says so itself)
        return BackendError(
            f"the destination root {directory} does not exist, and neither does {parent}: is "
            "its filesystem mounted? (a new destination: create the root once, mkdir -p)",
            transient=True)
    seen = ROOT_DEVICES.get(directory)
    if seen is not None and not directory.is_symlink():
        # The recommended layout, the root one directory below the mount point: unmounted,
        # the mount point is a directory of the node's own disk, and making the root there
        # committed checkpoints onto it, with `latest` answering "nothing committed" (found
        # attacking). A root this node opened on another filesystem than its parent is on
        # now is that filesystem not mounted; its mount point, mounted, is made into as before.
        with contextlib.suppress(OSError):
            if not os.path.ismount(parent) and os.stat(parent).st_dev != seen:
                return BackendError(
                    f"the destination root {directory} does not exist, and this node last "
                    f"saw it on another filesystem than {parent} is on now: is its "
                    "filesystem mounted? (if the root was removed on purpose, create it "
                    f"again: mkdir -p {directory})", transient=True)
    if directory.is_symlink() and not directory.exists():
        return BackendError(  # a link to a filesystem that is not mounted: the same wait
            f"the destination root {directory} is a symbolic link to "
            f"{os.readlink(directory)}, which does not exist: is its filesystem mounted?",
            transient=True)
    return None


def why_unmounted(directory: Path) -> str | None:
    """Why a missing ``directory`` (a destination root) looks like a filesystem that is not
    mounted, for the start-up warning; None when it exists or is merely new."""
    if directory.exists():
        return None
    unmounted = _unmounted(directory)
    return str(unmounted) if unmounted is not None else None


def _make_root(directory: Path) -> None:
    """``mkdir`` of the (trusted) root, made durable (a file fsynced into a directory whose own
    entry was never fsynced can vanish after a power cut). Only the root itself is made: when
    it looks unmounted (:func:`_unmounted`), ``mkdir -p`` would have drained checkpoints
    onto the node's own disk, committed where no other node or restart looks."""
    parent = directory.parent
    unmounted = _unmounted(directory)
    if unmounted is not None:
        raise unmounted
    try:
        directory.mkdir()
    except FileExistsError:
        return  # another writer made it; its creator makes it durable
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Beneath:
    """Opens directories and files under ``root`` by their components, refusing symlinks."""

    def __init__(self, root: Path, *, use_openat2: bool | None = None) -> None:
        self.root = root
        self.openat2 = kernel_has_openat2() if use_openat2 is None else use_openat2

    def _shown(self, parts: Sequence[str]) -> str:
        return str(self.root.joinpath(*parts))

    def _unsafe(self, parts: Sequence[str]) -> UnsafePath:
        where = self._shown(parts)
        log_event(log, logging.ERROR, "destination_symlink_refused", path=where)
        return UnsafePath(f"{where} is a symbolic link or leads out of the destination root; "
                          "ckptdrain neither reads nor writes through links under the "
                          "destination: remove it, and keep the destination writable only by "
                          "the daemon")

    def _is_link(self, dir_fd: int, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def _step(self, dir_fd: int, name: str, flags: int, parts: Sequence[str],
              mode: int = 0o644) -> int:
        """Open one component (no '/') under ``dir_fd``, never through a link."""
        try:
            return os.open(name, flags | _CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            # O_NOFOLLOW reports a link as ELOOP, or as ENOTDIR with O_DIRECTORY.
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and self._is_link(dir_fd, name):
                raise self._unsafe(parts) from None
            raise

    def _root_fd(self, create: bool) -> int:
        if create and not self.root.is_dir():
            _make_root(self.root)
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            # A read of a root that looks unmounted is no answer: read as "nothing there",
            # `latest` told a restarting job that nothing was committed, and it started again
            # from step 0 (found attacking). Only a root that was never made reads as empty.
            unmounted = _unmounted(self.root)
            if unmounted is not None:
                raise unmounted from None
            raise
        try:
            dev = os.fstat(fd).st_dev
        except OSError:
            return fd
        seen = ROOT_DEVICES.get(self.root)
        if seen is not None and dev != seen and _unmounted_mount_point(self.root):
            # The root itself the mount point, unmounted: an empty directory of the node's
            # disk, which was written into, and `latest` said "nothing committed" (found
            # attacking: and the filesystem remembered was overwritten with the node's).
            os.close(fd)
            raise BackendError(
                f"the destination root {self.root} is an empty directory that is no mount "
                "point, on another filesystem than this node last saw it on: is its "
                "filesystem mounted? (if the destination moved there on purpose, put the "
                "destination one directory below the mount point)", transient=True)
        ROOT_DEVICES.note(self.root, dev)  # (written only when it changed)
        return fd

    def _walk(self, root_fd: int, parts: Sequence[str], create: bool) -> int:
        fd = os.dup(root_fd)
        try:
            for i, name in enumerate(parts):
                try:
                    nxt = self._step(fd, name, DIR_FLAGS, parts[: i + 1])
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):  # another writer made it
                        os.mkdir(name, 0o755, dir_fd=fd)
                        os.fsync(fd)  # the new entry is durable before files go in it
                    nxt = self._step(fd, name, DIR_FLAGS, parts[: i + 1])
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _resolve(self, root_fd: int, parts: Sequence[str], flags: int, mode: int = 0o644) -> int:
        if self.openat2:
            try:
                # Without O_NOFOLLOW: a trailing link is then ELOOP (RESOLVE_NO_SYMLINKS), not
                # a link opened as itself (ENOTDIR, indistinguishable from a file).
                return openat2(root_fd, "/".join(parts),
                               (flags | os.O_CLOEXEC) & ~os.O_NOFOLLOW, mode)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EXDEV):
                    raise self._unsafe(parts) from None
                if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.E2BIG, errno.EINVAL):
                    raise
                self.openat2 = False  # a seccomp filter or an old kernel: walk from now on
        *dirs, name = parts
        dir_fd = self._walk(root_fd, dirs, create=False)
        try:
            return self._step(dir_fd, name, flags, parts, mode)
        finally:
            os.close(dir_fd)

    @contextlib.contextmanager
    def dir(self, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory ``root/parts`` (made, durably, when ``create``);
        FileNotFoundError when it is missing, :class:`UnsafePath` when a link is on the way."""
        root_fd = self._root_fd(create)
        try:
            if not parts:
                fd = os.dup(root_fd)
            elif create:
                fd = self._walk(root_fd, parts, create=True)
            else:
                fd = self._resolve(root_fd, parts, DIR_FLAGS)
        finally:
            os.close(root_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def open(self, parts: Sequence[str], flags: int = READ_FLAGS) -> int:
        """A descriptor of the existing file ``root/parts`` (never through a link). Its
        directory is resolved first and the file opened by its own name in it, the same
        ``openat(dir, name)`` every other file operation ends with (and that tracers such as
        ``strace -P name`` can aim at)."""
        *dirs, name = parts
        with self.dir(dirs) as dir_fd:
            return self._step(dir_fd, name, flags, parts)

    def check_entry(self, dir_fd: int, name: str, parts: Sequence[str]) -> os.stat_result | None:
        """lstat of ``name`` in ``dir_fd``: None when absent, UnsafePath when a link."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise self._unsafe(parts)
        return st
