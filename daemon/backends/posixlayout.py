"""How files are best laid out and written on the filesystem they land on.

Which kind of filesystem a descriptor is on (statfs ``f_type``) decides how a large file is
written to it: as parallel segments (the network filesystems) or in one copy, and with direct
I/O from the staged pages (local block filesystems) or through the page cache. On Lustre, a
generation's directory is striped before its first file (``lfs setstripe``).

Apart from posixfs.py because the S3 backend's ranged reads into a local file ask the same
question of their target (s3ranges.py, s3reads.py), and because none of this is a read or a
write of the destination's objects. Logged under the POSIX backend's logger, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import subprocess
from pathlib import Path

__all__ = [
    "DIRECT_WRITE_FILESYSTEMS",
    "LFS_TIMEOUT_S",
    "PARALLEL_WRITE_FILESYSTEMS",
    "filesystem_type",
    "setstripe",
    "striped_mkdir",
    "writes_direct",
    "writes_in_parallel",
]

# Logged under the backend's name: operators filter on it.
log = logging.getLogger("ckptdrain.daemon.backends.posix")

# `lfs setstripe` talks to the MDS; if it hangs, the generation is written with the directory's
# default layout rather than not at all.
LFS_TIMEOUT_S = 30.0

# Filesystems whose clients write ranges of one file at once (statfs f_type): Lustre, NFS,
# GPFS, BeeGFS, CephFS. On a local filesystem (ext4, XFS, tmpfs) buffered writes to one file
# take its inode lock in turn, so a file copied as parallel segments only adds contention:
# 8 x 128 MiB to ext4 here cost 6.9-8.0 CPU s/GB in segments against 3.8-4.8 in one copy
# per file, at 0.22-0.27 against 0.34-0.50 GB/s (docs/benchmarks.md).
PARALLEL_WRITE_FILESYSTEMS = frozenset({0x0BD00BD0, 0x6969, 0x47504653, 0x19830326, 0x00C36400})


def filesystem_type(fd: int) -> int | None:
    """statfs ``f_type`` of the filesystem ``fd`` is on (None where it cannot be asked)."""
    try:
        fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):  # not Linux/glibc
        return None
    # struct statfs begins with f_type (a long) on every Linux ABI; 256 bytes hold it all.
    buf = ctypes.create_string_buffer(256)
    if fstatfs(ctypes.c_int(fd), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def writes_in_parallel(fd: int) -> bool:
    """Whether a large file on ``fd``'s filesystem is best written as parallel segments."""
    return filesystem_type(fd) in PARALLEL_WRITE_FILESYSTEMS


# Local block filesystems (statfs f_type: ext2/3/4, XFS), where a shard is written from the
# staged pages with direct I/O (directcopy.py) instead of being copied into the page cache.
# Elsewhere it is not: a network filesystem's client has its own direct I/O semantics (on NFS
# each direct write is a round trip), and tmpfs keeps every byte in memory anyway.
DIRECT_WRITE_FILESYSTEMS = frozenset({0xEF53, 0x58465342})


def writes_direct(fd: int) -> bool:
    """Whether shards on ``fd``'s filesystem are written with direct I/O."""
    return filesystem_type(fd) in DIRECT_WRITE_FILESYSTEMS



def setstripe(lfs: str, directory: Path, stripe_count: int, stripe_size_bytes: int) -> None:
    """``lfs setstripe`` on ``directory``; a failure is logged, never raised: the files then
    get the filesystem's default layout, and the checkpoint is still written."""
    cmd = [lfs, "setstripe", "-c", str(stripe_count), "-S", str(stripe_size_bytes), str(directory)]
    try:
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=LFS_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning(
            "lfs setstripe on %s failed (%s); files get the default layout", directory, exc
        )
        return
    if result.returncode != 0:
        log.warning(
            "lfs setstripe on %s exited %d (%s); files get the default layout",
            directory,
            result.returncode,
            result.stderr.strip()[:500],
        )


def striped_mkdir(lfs: str, parent_fd: int, tmp_name: str, name: str, stripe_count: int,
                  stripe_size_bytes: int) -> None:
    """Make directory ``name`` in ``parent_fd`` already striped: stripe the private, empty
    ``tmp_name`` and rename it into place (a lost race to another node leaves theirs)."""
    os.mkdir(tmp_name, 0o755, dir_fd=parent_fd)
    try:
        tmp_fd = os.open(tmp_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=parent_fd)
        try:
            # lfs is handed the directory we hold, not a path someone could swap under it.
            setstripe(lfs, Path(f"/proc/{os.getpid()}/fd/{tmp_fd}"), stripe_count,
                      stripe_size_bytes)
        finally:
            os.close(tmp_fd)
        try:
            os.rename(tmp_name, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(tmp_name, dir_fd=parent_fd)

