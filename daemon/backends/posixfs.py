"""The synchronous filesystem operations the POSIX backend runs in its worker threads.

Nothing here touches the event loop. Every function that loops over a file's bytes takes a
``stop`` event and checks it between chunks, so a cancelled call ends within one chunk.

A shard is created once: written under a temp name in its final directory, its checksum
recorded in the ``user.ckptdrain.checksum`` xattr of that same inode, fsynced, and then
``link()``ed to its final name, which fails with EEXIST instead of replacing a file (rename
would). The name therefore appears with its bytes and its checksum at once.

The temp names and the sweep of temps left behind are posixtemps.py's; which filesystem a file
lands on, and what that means for how it is written (segments, direct I/O, Lustre striping),
is posixlayout.py's.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pwd
import stat
import threading
from collections.abc import Iterator

from ckptdrain.client.manifest import TMP_SUFFIX
from ckptdrain.client.names import MAX_PATH_BYTES
from ckptdrain.client.recordfields import ManifestError, parse_checksum
from ckptdrain.daemon.backends.base import BackendError, ObjectInfo
from ckptdrain.daemon.backends.beneath import Beneath, link_in
from ckptdrain.daemon.checksums import Stopped
from ckptdrain.daemon.filecopy import hash_file

# Longest file name on Linux filesystems, Lustre included (names are ASCII, so bytes = chars).
NAME_MAX = 255
# Where a shard's checksum is recorded. Lustre, ext4, XFS and NFS 4.2 keep user xattrs; a
# filesystem that refuses them costs a re-read of the file whenever its checksum is asked.
CHECKSUM_XATTR = "user.ckptdrain.checksum"
_NO_XATTR_ERRNOS = frozenset(
    {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM, errno.EACCES, errno.ENODATA}
)
# EMFILE/ENFILE: this process or the node ran out of file descriptors, which passes once
# others close (a same-node user's idle connections, found attacking the daemon).
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT,
                               errno.ESTALE, errno.EMFILE, errno.ENFILE})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_AUTH_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def backend_error(exc: OSError, what: str, root: str | None = None) -> BackendError:
    """Map an OSError to the BackendError kind operators see in metrics and alerts; with the
    destination's ``root``, an ENOSPC there says whether it is out of inodes."""
    code = exc.errno
    if code == errno.ENOSPC and root is not None and out_of_inodes(root):
        # With bytes free, "free space" sent the operator to `df -h`, which showed room (found
        # attacking: another user's small files took every inode, or a job's many small shards).
        return BackendError(
            f"{what}: the destination's filesystem is out of inodes (files), though it has "
            "bytes free (`df -i`); remove files there (old generations, others' small files) "
            "or raise its inode quota, or save fewer, larger shards",
            kind="full",
        )
    if code in _FULL_ERRNOS:
        return BackendError(
            f"{what}: the destination is full ({exc.strerror}); free space or raise the quota",
            kind="full",
        )
    if code in _AUTH_ERRNOS:
        # Whoever this process runs as: the daemon, or a user's `ckptdrain restore` (found
        # attacking: a read refused to a restoring user said "let the daemon's user write
        # there", which was neither the user nor the access refused).
        return BackendError(
            f"{what}: permission denied ({exc.strerror}); let {running_as()}, whom this runs "
            "as, have access there",
            kind="auth",
        )
    if code == errno.ETIMEDOUT:
        return BackendError(f"{what}: {exc.strerror}", transient=True, kind="timeout")
    if code == errno.EROFS:
        # Said bare ("Read-only file system"), it named no way out (found attacking).
        return BackendError(
            f"{what}: the destination's filesystem is read-only ({exc.strerror}); remount it "
            "read-write (a mount that turned read-only after a disk or server error: see "
            "dmesg), then `ckptdrain retry` the failed steps")
    return BackendError(f"{what}: {exc.strerror or exc}", transient=code in _TRANSIENT_ERRNOS)


def out_of_inodes(path: str) -> bool:
    """Whether the filesystem at ``path`` has no inode left for the daemon but bytes free
    (False where it cannot be asked, or counts no inodes: btrfs reports none; and where it is
    out of bytes as well, which "full" says)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_files > 0 and st.f_favail == 0 and st.f_bavail > 0


@functools.cache  # (a name service may be slow; an error path repeats it)
def running_as() -> str:
    """The user this process runs as, for a message: ``user 'name' (uid N)``."""
    uid = os.geteuid()
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:  # a uid with no name (a container's)
        return f"uid {uid}"


def temp_vanished(what: str) -> BackendError:
    """Our temp file was gone when it was to be put in place: someone removed it (a sweep on
    a node whose clock runs ahead, a cleanup script). The shard is sent again from its staged
    file, as an S3 upload removed under the drain is (found attacking: the generation failed
    for good, and every node of the job with it)."""
    return BackendError(f"{what}: its temp file was removed while it was written (another "
                        "node's sweep or a cleanup script); it is sent again", transient=True)


def link_temp(dir_fd: int, tmp: str, name: str, what: str) -> bool:
    """Put the complete temp file ``tmp`` in place as ``name`` (both in ``dir_fd``) with
    ``link``: False when ``name`` exists (a link there included); :func:`temp_vanished` when
    ``tmp`` is gone. Every create-if-absent of the backend ends here."""
    try:
        link_in(dir_fd, tmp, name)
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise temp_vanished(what) from None
    return True



def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class ChecksumXattr:
    """Records and reads a file's checksum in its xattr, remembering whether the filesystem
    keeps user xattrs at all (so one that refuses them is asked once, not per file)."""

    def __init__(self) -> None:
        self.supported = True

    def record(self, fd: int, checksum: str) -> None:
        """Best effort: a checksum that cannot be recorded is recomputed when asked for."""
        if not self.supported:
            return
        try:
            os.setxattr(fd, CHECKSUM_XATTR, checksum.encode("ascii"))
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                self.supported = False
            elif exc.errno not in _NO_XATTR_ERRNOS:
                raise

    def read(self, fd: int) -> str | None:
        if not self.supported:
            return None
        try:
            raw = os.getxattr(fd, CHECKSUM_XATTR)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                self.supported = False
                return None
            if exc.errno in _NO_XATTR_ERRNOS:
                return None  # not recorded (a file an older version wrote)
            raise
        try:
            text = raw.decode("ascii")
            parse_checksum(text)
        except (UnicodeDecodeError, ManifestError):
            return None  # not ours to trust: recompute
        return text


def stat_file(
    fs: Beneath, parts: list[str], xattr: ChecksumXattr | None, stop: threading.Event
) -> tuple[int, float, str | None] | None:
    """(size, mtime, checksum) of the regular file at ``path``, or None when there is none.

    The checksum is the recorded one; a file without one (an older version wrote it, or the
    filesystem keeps no user xattrs) is hashed, and the result recorded when possible, so
    the next ask is cheap again. With no ``xattr``, no checksum (None): one ``fstat``.
    """
    try:
        fd = fs.open(parts)
    except _MISSING:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if xattr is None:
            return st.st_size, st.st_mtime, None
        checksum = xattr.read(fd)
        if checksum is None:
            checksum = hash_file(fd, stop)
            # Only a convenience here: on a destination that takes no writes (read-only,
            # full, out of quota) the failed record failed the check itself (found attacking).
            with contextlib.suppress(OSError):
                xattr.record(fd, checksum)
        return st.st_size, st.st_mtime, checksum
    finally:
        os.close(fd)


# Paths stat'ed in one thread job by PosixBackend.stat_many.
STAT_BATCH = 256


def stat_files(fs: Beneath, many: list[list[str]], xattr: ChecksumXattr,
               stop: threading.Event) -> list[tuple[int, float, str | None] | None]:
    """:func:`stat_file` of each path, in one worker-thread job; raises Stopped on ``stop``."""
    found = []
    for parts in many:
        if stop.is_set():
            raise Stopped
        found.append(stat_file(fs, parts, xattr, stop))
    return found


def read_small(fs: Beneath, parts: list[str], max_bytes: int,
               stop: threading.Event) -> bytes | None:
    """The whole file at ``parts`` (at most ``max_bytes``), or None when there is none; a
    BackendError ("integrity") when something that is not a regular file takes the name."""
    del stop
    path = fs.root.joinpath(*parts)
    try:
        fd = fs.open(parts)
    except _MISSING:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            # Not "no key": found attacking gc, a FIFO at an old MANIFEST.json read as none,
            # so retention, whose tombstone could not take the name, took it for a key
            # removed since and deleted the shards with no tombstone there. Like a link
            # (UnsafePath), it is no object any reader takes for one.
            raise BackendError(
                f"{path} is not a regular file (a FIFO, a directory, a device or a socket); "
                "remove it, and keep the destination writable only by the daemon",
                kind="integrity",
            )
        if st.st_size > max_bytes:
            raise BackendError(
                f"{path} is {st.st_size} bytes, over the {max_bytes}-byte limit for a "
                "small object",
                kind="integrity",
            )
        chunks = []
        while data := os.read(fd, max(st.st_size, 1 << 16)):
            chunks.append(data)
            if sum(map(len, chunks)) > max_bytes:
                raise BackendError(
                    f"{path} grew past {max_bytes} bytes while being read", kind="integrity"
                )
        return b"".join(chunks)
    finally:
        os.close(fd)


# The deepest directory under the root a key of ours can be in: <job>/<step>/ and a shard
# path's directories (MAX_PATH_BYTES holds at most half as many components, one byte and a
# '/' each).
MAX_KEY_DEPTH = 2 + MAX_PATH_BYTES // 2


def walk(top_fd: int, depth: int) -> Iterator[tuple[str, list[str], list[str], int]]:
    """``os.fwalk`` of the directory ``top_fd``, ``depth`` levels below the root, going no
    deeper than MAX_KEY_DEPTH, where nothing is a key of ours. Found attacking gc: a
    directory chain some thousand levels deep planted under a generation made fwalk (which
    recurses once per level, holding each level's descriptor) raise RecursionError, a
    traceback from `gc`, `verify` and the daemon's retention and temp sweep on every run."""
    for dirpath, dirs, files, dir_fd in os.fwalk(".", dir_fd=top_fd):
        if depth + (0 if dirpath == "." else dirpath.count(os.sep)) >= MAX_KEY_DEPTH:
            dirs[:] = []  # (topdown: fwalk goes into what is left of dirs)
        yield dirpath, dirs, files, dir_fd


def list_files(fs: Beneath, base: list[str], prefix: str, stop: threading.Event) -> list[ObjectInfo]:
    """Every regular file under ``base`` whose key (path relative to the root) starts with
    ``prefix``, sorted by key; temp files excluded. Links are neither listed nor followed
    (fwalk holds each directory open, so none can be swapped for a link under it)."""
    found: list[ObjectInfo] = []
    try:
        with fs.dir(base) as base_fd:
            for dirpath, _dirs, files, dir_fd in walk(base_fd, len(base)):
                if stop.is_set():
                    raise Stopped
                rel = os.path.normpath(dirpath)
                key_dir = "/".join([*base, *([] if rel == "." else rel.split(os.sep))])
                key_dir += "/" if key_dir else ""
                for name in files:
                    if name.endswith(TMP_SUFFIX):
                        continue
                    key = key_dir + name
                    if not key.startswith(prefix):
                        continue
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted since the directory was read
                    if stat.S_ISREG(st.st_mode):
                        found.append(ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime))
    except _MISSING:
        return []
    found.sort(key=lambda info: info.key)
    return found


def list_dirs(fs: Beneath, parts: list[str], stop: threading.Event) -> list[str]:
    """Names of the subdirectories of ``parts`` (temp ones and links excluded), sorted."""
    del stop
    try:
        with fs.dir(parts) as dir_fd:
            entries = list(os.scandir(dir_fd))
    except _MISSING:
        return []
    return sorted(
        e.name for e in entries if not e.name.endswith(TMP_SUFFIX) and e.is_dir(follow_symlinks=False)
    )


def open_existing(fs: Beneath, parts: list[str], stop: threading.Event) -> int:
    """A read descriptor of the regular file at ``parts``."""
    del stop
    path = fs.root.joinpath(*parts)
    try:
        fd = fs.open(parts)
    except _MISSING as exc:
        raise BackendError(f"{path} does not exist", kind="integrity") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BackendError(f"{path} is not a regular file", kind="integrity")
    return fd


def read_some(fd: int, chunk_bytes: int, stop: threading.Event) -> bytes:
    del stop
    return os.read(fd, chunk_bytes)



