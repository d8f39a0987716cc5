"""The read side of the POSIX destination: small objects, listings, stats (a batch of keys to
a thread job), streaming reads, and restore's copy of a file into the caller's fd. A base of
:class:`~ckptdrain.daemon.backends.posix.PosixBackend`, on the plumbing of
:class:`~ckptdrain.daemon.backends.posixroot.PosixRoot`, as s3reads.py is of the S3 one.
"""

from __future__ import annotations

import builtins
import errno
import os
import threading
from collections.abc import AsyncGenerator, Callable, Sequence

from ckptdrain.client.manifest import MAX_RECORD_BYTES
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo
from ckptdrain.daemon.backends.posixfs import (
    STAT_BATCH,
    list_dirs,
    list_files,
    open_existing,
    read_small,
    read_some,
    stat_file,
    stat_files,
)
from ckptdrain.daemon.backends.posixroot import PosixRoot
from ckptdrain.daemon.bufferedcopy import buffered_copy_and_checksum
from ckptdrain.daemon.checksums import ALGO
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.filecopy import copy_and_checksum

# What only the file written to fails with: a read of the destination never runs out of room
# (ENOSPC, EDQUOT, EFBIG), is never refused for a seal or an immutable or append-only file
# (EPERM), and never meets a read-only filesystem (EROFS).
_OUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EPERM, errno.EROFS})


class _OutFailed(DaemonError):
    """The caller's file (a restore's target, a reader's fd) refused the bytes: its own
    OSError, not the destination's ("the destination is full" sent a restore's user to the
    wrong disk; a reader's sealed memfd read as "permission denied ... check the
    destination", found attacking)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error

class PosixReads(PosixRoot, Backend):
    """Reading files (a base of PosixBackend)."""

    async def get_bytes(self, key: str, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes | None:
        return await self._run(f"reading {key}", read_small, self.fs, self._parts(key), max_bytes)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        # Keys match by string prefix like S3; walk only the deepest directory the prefix names.
        base_key = prefix.rpartition("/")[0]
        base = self._parts(base_key) if base_key else []
        return await self._run(f"listing {prefix or '/'}", list_files, self.fs, base, prefix)

    async def stat(self, key: str, *, checksum: bool = True) -> ObjectInfo | None:
        found = await self._run(f"checking {key}", stat_file, self.fs, self._parts(key),
                                self._xattr if checksum else None)
        if found is None:
            return None
        size, modified, recorded = found
        return ObjectInfo(key=key, size=size, modified=modified, checksum=recorded)

    async def stat_many(self, keys: Sequence[str], *,
                        concurrency: int = 32) -> builtins.list[ObjectInfo | None]:
        # Up to STAT_BATCH keys to a thread job: 10,000 small shards' proofs were 10,000 thread
        # hops, a sixth of the event loop's time in a commit of them. Never fewer jobs than
        # threads: a file with no checksum xattr is hashed, and a few large ones hash in
        # parallel as before.
        del concurrency  # the pool's threads bound it
        size = max(1, min(STAT_BATCH, -(-len(keys) // self.max_threads)))
        batches = [keys[i:i + size] for i in range(0, len(keys), size)]
        found: builtins.list[builtins.list[tuple[int, float, str | None] | None]] = [
            [] for _ in batches]

        async def one(i: int) -> None:
            found[i] = await self._run(f"checking {len(batches[i])} shards", stat_files, self.fs,
                                       [self._parts(k) for k in batches[i]], self._xattr)

        await for_each_bounded(range(len(batches)), one, self.max_threads)
        return [None if f is None else ObjectInfo(key=k, size=f[0], modified=f[1], checksum=f[2])
                for batch, results in zip(batches, found, strict=True)
                for k, f in zip(batch, results, strict=True)]

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        base = prefix.rstrip("/")
        return await self._run(
            f"listing {prefix or '/'}", list_dirs, self.fs, self._parts(base) if base else []
        )

    async def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncGenerator[bytes, None]:
        fd = await self._run(f"opening {key}", open_existing, self.fs, self._parts(key))
        # The fd is closed however the iteration ends (exhausted, broken off, cancelled).
        try:
            while True:
                chunk = await self._run(f"reading {key}", read_some, fd, chunk_bytes)
                if not chunk:
                    return
                yield chunk
        finally:
            os.close(fd)

    async def copy_into(
        self, key: str, out_fd: int, *, algo: str = ALGO,
        progress: Callable[[int], None] | None = None, owned: bool = False,
        expected_size: int | None = None,
    ) -> tuple[int, str]:
        # One thread job per file: no event-loop hop per piece.
        try:
            return await self._run(f"reading {key}", self._copy_into_sync, self._parts(key),
                                   out_fd, algo, progress, owned, expected_size)
        except _OutFailed as exc:
            raise exc.error from None

    def _copy_into_sync(self, parts: builtins.list[str], out_fd: int, algo: str,
                        progress: Callable[[int], None] | None, owned: bool,
                        expected_size: int | None, stop: threading.Event) -> tuple[int, str]:
        src = open_existing(self.fs, parts, stop)
        try:
            size = os.fstat(src).st_size
            if expected_size is not None and size != expected_size:
                return size, ""  # the caller reports the size; nothing copied for nothing
            # A restore is not fsynced (it is repeatable): no write-behind to wait on. The
            # caller's own file (``owned``: the restore command's) takes each piece
            # checksummed in the buffer it is written from (bufferedcopy.py), not read again
            # after a kernel copy. A client's fd (a reader's fetch through the daemon: a
            # memfd, a file on another filesystem) keeps the kernel copy, the source read
            # again for the checksum (never mapped: the client may truncate it).
            try:
                if owned:
                    checksum = buffered_copy_and_checksum(src, out_fd, size, stop, parts[-1],
                                                          algo, progress=progress)
                else:
                    checksum = copy_and_checksum(src, out_fd, size, stop, parts[-1], algo,
                                                 progress=progress, write_behind=False)
            except OSError as exc:
                if exc.errno in _OUT_ERRNOS:
                    raise _OutFailed(exc) from exc
                raise
            if os.preadv(src, [bytearray(1)], size):
                raise BackendError(f"{'/'.join(parts)} grew while it was read",
                                   kind="integrity", transient=True)
            return size, checksum
        finally:
            os.close(src)
