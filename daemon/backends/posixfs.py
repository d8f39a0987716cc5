"""The synchronous filesystem operations the POSIX backend runs in its worker threads.

Nothing here touches the event loop. Every function that loops over a file's bytes takes a
``stop`` event and checks it between chunks, so a cancelled call ends within one chunk.

A shard is created once: written under a temp name in its final directory, its checksum
recorded in the ``user.ckptdrain.checksum`` xattr of that same inode, fsynced, and then
``link()``ed to its final name, which fails with EEXIST instead of replacing a file (rename
would). The name therefore appears with its bytes and its checksum at once.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import threading
from pathlib import Path

from ckptdrain.client.manifest import TMP_SUFFIX, ManifestError, format_checksum, parse_checksum
from ckptdrain.daemon.backends.base import BackendError

COPY_BUFFER_BYTES = 8 << 20
RANDOM_HEX = 12
# Longest file name on Linux filesystems, Lustre included (names are ASCII, so bytes = chars).
NAME_MAX = 255
# Where a shard's checksum is recorded. Lustre, ext4, XFS and NFS 4.2 keep user xattrs; a
# filesystem that refuses them costs a re-read of the file whenever its checksum is asked.
CHECKSUM_XATTR = "user.ckptdrain.checksum"
_NO_XATTR_ERRNOS = frozenset(
    {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM, errno.EACCES, errno.ENODATA}
)
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_AUTH_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC

# One copy buffer per worker thread, reused for every file: allocating 8 MiB per file costs
# more than the copy (fresh memory is ~10x slower than a reused buffer).
_buffers = threading.local()


def copy_buffer() -> memoryview:
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = memoryview(bytearray(COPY_BUFFER_BYTES))
        _buffers.buf = buf
    return buf


class Stopped(Exception):
    """The awaiting coroutine was cancelled; the worker thread abandons the copy."""


def backend_error(exc: OSError, what: str) -> BackendError:
    """Map an OSError to the BackendError kind operators see in metrics and alerts."""
    code = exc.errno
    if code in _FULL_ERRNOS:
        return BackendError(
            f"{what}: the destination is full ({exc.strerror}); free space or raise the quota",
            kind="full",
        )
    if code in _AUTH_ERRNOS:
        return BackendError(
            f"{what}: permission denied ({exc.strerror}); let the daemon's user write there",
            kind="auth",
        )
    if code == errno.ETIMEDOUT:
        return BackendError(f"{what}: {exc.strerror}", transient=True, kind="timeout")
    return BackendError(f"{what}: {exc.strerror or exc}", transient=code in _TRANSIENT_ERRNOS)


def temp_name(final_name: str, node_id: str) -> str:
    """``.<name>.<node>.<random>.ckptdrain-tmp``: hidden, unique, and saying whose it is, so
    a sweep can remove this node's leftovers at once and other nodes' only when old.

    The name part is shortened to keep the whole within NAME_MAX: it is only there to help a
    human, while the owner and suffix (which sweeps parse from the end) must survive.
    """
    tail = f".{node_id}.{secrets.token_hex(RANDOM_HEX // 2)}{TMP_SUFFIX}"
    budget = max(0, NAME_MAX - 1 - len(tail))
    return f".{final_name[:budget]}{tail}"


def temp_owner_matches(name: str, node_id: str) -> bool:
    stem = name[: -len(TMP_SUFFIX)]
    head, dot, rand = stem.rpartition(".")
    if not dot or len(rand) != RANDOM_HEX:
        return False
    return head.endswith(f".{node_id}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(directory: Path) -> None:
    """``mkdir -p`` that makes each new directory entry durable: a file fsynced into a
    directory whose own entry was never fsynced can vanish with it after a power cut."""
    missing: list[Path] = []
    probe = directory
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            continue  # another writer made it; its creator makes it durable
        fsync_dir(path.parent)


def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def copy_and_hash(src_fd: int, out: int, size: int, stop: threading.Event, name: str) -> str:
    """Copy ``size`` bytes of ``src_fd`` into ``out``; the sha256 hex of them."""
    buf = copy_buffer()
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        if stop.is_set():
            raise Stopped
        want = min(len(buf), size - offset)
        got = os.preadv(src_fd, [buf[:want]], offset)
        if got == 0:
            raise BackendError(
                f"source of {name} ended at byte {offset} of {size}: the staged file "
                "was truncated",
                kind="integrity",
            )
        chunk = buf[:got]
        # hashlib releases the GIL for large updates, so other drains proceed meanwhile.
        digest.update(chunk)
        write_all(out, chunk)
        offset += got
    return digest.hexdigest()


def hash_file(fd: int, stop: threading.Event) -> str:
    """``"sha256:<hex>"`` of everything ``fd`` holds, read with pread from offset 0."""
    buf = copy_buffer()
    digest = hashlib.sha256()
    offset = 0
    while got := os.preadv(fd, [buf], offset):
        if stop.is_set():
            raise Stopped
        digest.update(buf[:got])
        offset += got
    return format_checksum("sha256", digest.hexdigest())


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
    path: Path, xattr: ChecksumXattr, stop: threading.Event
) -> tuple[int, float, str] | None:
    """(size, mtime, checksum) of the regular file at ``path``, or None when there is none.

    The checksum is the recorded one; a file without one (an older version wrote it, or the
    filesystem keeps no user xattrs) is hashed, and the result recorded when possible, so
    the next ask is cheap again.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        checksum = xattr.read(fd)
        if checksum is None:
            checksum = hash_file(fd, stop)
            xattr.record(fd, checksum)
        return st.st_size, st.st_mtime, checksum
    finally:
        os.close(fd)
