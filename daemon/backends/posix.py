"""The POSIX destination (Lustre, NFS, a local directory): ``file:///path``.

Every file is written under a temporary name in its final directory (same directory, same
mount: no EXDEV), fsynced, put in place, and the directory fsynced, so a key is either absent
or complete even across a power cut. Shards and the manifest are created once, with
``link()``, which fails on an existing name atomically on every POSIX filesystem Lustre
included (``O_EXCL`` alone would expose a half-written file, ``rename`` would replace one);
a shard's checksum travels with its inode in an xattr (see posixfs.py). Part records and
LATEST, which are rewritten, use ``rename``.

Every path is reached from the destination root one component at a time, never through a
symbolic link (beneath.py): a link planted in the destination is refused, not followed.

All blocking calls run in worker threads, never on the event loop. A cancelled call waits for
its thread to reach the next chunk boundary and clean up before the cancellation propagates,
so the caller may close the source fd as soon as the await returns.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from ckptdrain.client.manifest import MAX_RECORD_BYTES
from ckptdrain.daemon.backends.base import (
    Backend,
    BackendError,
    Flow,
    ObjectInfo,
    ThreadFlow,
    UploadLog,
)
from ckptdrain.daemon.backends.beneath import Beneath, Entry, UnsafePath
from ckptdrain.daemon.backends.collision import check_replaced, settle_existing
from ckptdrain.daemon.backends.posixbatch import (
    BATCH_BYTES,
    BATCH_SHARDS,
    LOCAL_BATCH_LANES,
    SMALL_SHARD_BYTES,
    create_many,
)
from ckptdrain.daemon.backends.posixfs import (
    LFS_TIMEOUT_S,
    NAME_MAX,
    STAT_BATCH,
    ChecksumXattr,
    Watched,
    backend_error,
    link_temp,
    list_dirs,
    list_files,
    open_existing,
    read_small,
    read_some,
    stat_file,
    stat_files,
    striped_mkdir,
    sweep_temps,
    temp_name,
    temp_vanished,
    write_all,
    writes_direct,
    writes_in_parallel,
)
from ckptdrain.daemon.backends.posixremove import (
    REMOVE_AT_ONCE,
    REMOVE_BATCH,
    remove_empty_tree,
    remove_many,
    remove_one,
)
from ckptdrain.daemon.checksums import ALGO
from ckptdrain.daemon.directcopy import DIRECT_MIN_BYTES, direct_copy_and_checksum
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.filecopy import (
    COPY_RANGE_BYTES,
    PARALLEL_SEGMENTS,
    Truncated,
    copy_and_checksum,
    parallel_copy_and_checksum,
    yield_to_handoffs,
)
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import settled

# Re-exported: the names tests and older imports know this module by.
__all__ = ["COPY_RANGE_BYTES", "LFS_TIMEOUT_S", "NAME_MAX", "PosixBackend", "ReadSettings",
           "UnsafePath", "backend_error", "temp_name"]

_T = TypeVar("_T")

log = logging.getLogger(__name__)

# Threads beyond max_concurrency, for small metadata operations during a full drain.
EXTRA_THREADS = 4
# How often a create-once write retries when the existing file it found vanished before it
# could be compared (retention removing an abandoned generation at that very moment).
_CREATE_ROUNDS = 3
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Settings(Protocol):
    """What the POSIX backend takes from its destination's configuration
    (config.DestinationConfig has it all)."""

    @property
    def uri(self) -> str: ...
    @property
    def root_path(self) -> Path: ...
    @property
    def stripe_count(self) -> int: ...
    @property
    def stripe_size_bytes(self) -> int: ...
    @property
    def max_concurrency(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ReadSettings:
    """A ``file://`` destination to read (``ckptdrain ls``, ``verify``, ``restore``): nothing
    in the configuration changes how a directory is read, so those commands need not load it
    (pydantic and its models were two thirds of their start-up). Reading creates no directory
    there: striping is left to the filesystem (0)."""

    uri: str
    root_path: Path
    stripe_count: int = 0
    stripe_size_bytes: int = 0
    # Threads: a restore copies 8 shards at once (restore.restore), a verify 4.
    max_concurrency: int = 8


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


class PosixBackend(Backend):
    """A directory tree; keys are relative paths under ``config.root_path``."""

    batch_shards = BATCH_SHARDS
    batch_shard_bytes = SMALL_SHARD_BYTES
    batch_bytes = BATCH_BYTES

    def __init__(self, config: Settings, node_id: str) -> None:
        self.uri = config.uri
        self.root = Path(config.root_path)
        self._root_str = str(self.root)
        self.node_id = node_id
        self.stripe_count = int(config.stripe_count)
        self.stripe_size_bytes = int(config.stripe_size_bytes)
        # Its own threads, sized to the configured drain concurrency plus headroom so a part
        # record or manifest write is not queued behind full-size shard copies (the shared
        # default executor has min(32, cores + 4) threads and serves everyone else too).
        self.max_concurrency = int(config.max_concurrency)
        self.max_threads = self.max_concurrency + EXTRA_THREADS
        self._executor: ThreadPoolExecutor | None = None
        self._segments: ThreadPoolExecutor | None = None
        self._segments_lock = threading.Lock()
        # Whether large shards are copied as parallel segments: None until the first copy
        # asks the destination's filesystem (tests set it).
        self.parallel_writes: bool | None = None
        # Whether shards are written with direct I/O (local block filesystems); learnt once.
        self.direct_writes: bool | None = None
        # Temp names this process is writing right now: a sweep (at start-up or periodic)
        # must never take a file from under a copy in flight.
        self._live: set[str] = set()
        # Other nodes' temps the sweeps have seen, and since when unchanged (sweep_temps).
        self._watched: Watched = {}
        self.clock: Callable[[], float] = time.monotonic  # the sweeps' clock (tests move it)
        self._xattr = ChecksumXattr()
        self.fs = Beneath(self.root)

    @property
    def batch_lanes(self) -> int:
        """A few on a local filesystem, the drain's concurrency on a network one; a local
        filesystem's until the first batch learns which (posixbatch.LOCAL_BATCH_LANES)."""
        return self.max_concurrency if self.parallel_writes else LOCAL_BATCH_LANES

    # --- plumbing ---------------------------------------------------------------------------

    def _parts(self, key: str) -> list[str]:
        """The components of ``key``; keys are built from validated names, so a key that
        could leave the root is a bug and fails loudly."""
        parts = key.split("/")
        if (
            not key
            or key.startswith("/")
            or any(p in ("", ".", "..") for p in parts)
            or "\0" in key
        ):
            raise ValueError(f"invalid destination key {key!r}")
        return parts

    def _entry(self, key: str) -> Entry:
        *dirs, name = self._parts(key)
        return Entry(tuple(dirs), name)

    def _live_key(self, entry: Entry) -> str:
        # The form sweep_temps compares against: the temp file's full path. (Not through
        # pathlib: twice per shard, its parsing was about half the Python time of a batch of
        # small shards under cProfile.)
        return os.path.join(self._root_str, *entry.parts)

    async def _run(self, what: str, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn(*args, stop)`` in a worker thread; OSError becomes BackendError.

        On cancellation the thread is told to stop and awaited (it checks between chunks),
        so no thread keeps using the caller's fd or leaves a temp file behind.
        """
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_threads, thread_name_prefix="posix-dest",
                                                initializer=yield_to_handoffs)

        def call() -> _T:
            try:
                return fn(*args, stop)
            except OSError as exc:
                # Mapped in the thread: an ENOSPC asks the root's filesystem whether it is
                # out of inodes (statvfs, which may wait on a server), never on the loop.
                raise backend_error(exc, f"{what} at {self.uri}", self._root_str) from exc

        future = loop.run_in_executor(self._executor, call)
        try:
            # Cancelled, the thread finishes its current chunk (bounded by one buffer's I/O)
            # and cleans up before we return.
            return await settled(future, stop=stop)
        except Truncated as exc:
            raise BackendError(str(exc), kind="integrity") from exc

    # --- writes -----------------------------------------------------------------------------

    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None,
        flow: Flow | None = None,
    ) -> str:
        # upload_log is for resumable multipart uploads; a POSIX write restarts from zero.
        del upload_log
        if size < 0:
            raise ValueError(f"size must be >= 0, not {size}")
        final = self._entry(key)
        thread_flow = None if flow is None else ThreadFlow(flow, asyncio.get_running_loop())
        checksum, tmp = await self._run(
            f"writing {key}", self._create_sync, final, fd, size, thread_flow
        )
        if tmp is None:
            return checksum
        # The name was taken. The complete temp file is kept until we know what to do: it is
        # either renamed over a leftover or unlinked, on every way out.
        try:
            for _ in range(_CREATE_ROUNDS):
                existing = await self.stat(key)
                if existing is None:
                    if await self._run(f"writing {key}", self._link_sync, tmp, final):
                        tmp = None
                        return checksum
                    continue
                if await settle_existing(self, key, size, checksum, existing):
                    return checksum
                await self._run(f"replacing {key}", self._replace_sync, tmp, final)
                tmp = None
                await check_replaced(self, key, size, checksum)
                return checksum
            raise BackendError(
                f"{key} at {self.uri} kept appearing and vanishing while it was written; "
                "something else is writing or deleting it",
                transient=True,
            )
        finally:
            if tmp is not None:
                await self._run(f"removing the temp file of {key}", self._discard_sync, tmp)

    async def put_files(
        self, items: builtins.list[tuple[str, int, int]],
    ) -> builtins.list[str | BackendError | None]:
        # One thread job for the whole batch (posixbatch.py): the fsyncs overlap and the
        # directory is fsynced once for every shard linked into it.
        entries = [(self._entry(key), fd, size) for key, fd, size in items]
        return await self._run(f"writing {len(items)} shards", self._create_many_sync, entries)

    def _create_many_sync(self, entries: builtins.list[tuple[Entry, int, int]],
                          stop: threading.Event) -> builtins.list[str | BackendError | None]:
        return create_many(self, entries, stop)

    def _open_temp(self, dir_fd: int, final: Entry) -> tuple[Entry, int]:
        """A new temp file beside ``final`` (in ``dir_fd``), marked live so no sweep takes it;
        the caller links, renames or unlinks it and then drops it from ``_live``."""
        tmp = final.with_name(temp_name(final.name, self.node_id))
        self._live.add(self._live_key(tmp))
        try:
            return tmp, os.open(tmp.name, _NEW_FILE, 0o644, dir_fd=dir_fd)
        except BaseException:
            self._live.discard(self._live_key(tmp))
            raise

    def _unlink_temp(self, dir_fd: int, tmp: Entry) -> None:
        """Remove a temp file this process is done with. One whose directory refuses the
        removal (made read-only or immutable under the write, its permissions changed) is
        logged and left to the sweep, which takes this node's temps at any age: raised here,
        the refusal replaced the write's own error and skipped the ``_live`` discard, so every
        sweep passed the temp over as being written, and a full-size shard's temp stayed at
        the destination until the daemon restarted (found attacking)."""
        try:
            os.unlink(tmp.name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log_event(log, logging.WARNING, "destination_temp_left", path=self._live_key(tmp),
                      error=exc.strerror or str(exc),
                      action="the next sweep removes it once its directory takes changes")
        finally:
            self._live.discard(self._live_key(tmp))

    def _create_sync(
        self, final: Entry, src_fd: int, size: int, flow: ThreadFlow | None,
        stop: threading.Event,
    ) -> tuple[str, Entry | None]:
        """Write the shard and link it into place: (checksum, None) when created, or
        (checksum, the complete temp file) when the name exists."""
        with self.fs.dir(final.dir, create=True) as dir_fd:
            tmp, out = self._open_temp(dir_fd, final)
            # The temp exists from here: every way out links and unlinks it, or hands it back.
            kept = False
            try:
                try:
                    if size >= DIRECT_MIN_BYTES and self._direct_writes(dir_fd):
                        checksum = direct_copy_and_checksum(src_fd, out, size, stop,
                                                            final.name, flow=flow)
                    elif self._parallel_writes(dir_fd):
                        checksum = parallel_copy_and_checksum(
                            self._segment_pool(), src_fd, out, size, stop, final.name,
                            flow=flow)
                    else:
                        checksum = copy_and_checksum(src_fd, out, size, stop, final.name,
                                                     flow=flow, mapped=src_fd)
                    # On the inode before it has a final name: the name appears with it.
                    self._xattr.record(out, checksum)
                    os.fsync(out)
                finally:
                    os.close(out)
                if not link_temp(dir_fd, tmp.name, final.name, f"writing {final.name} at {self.uri}"):
                    kept = True
                    return checksum, tmp
            finally:
                if not kept:
                    self._unlink_temp(dir_fd, tmp)
            os.fsync(dir_fd)
        return checksum, None

    def _link_sync(self, tmp: Entry, final: Entry, stop: threading.Event) -> bool:
        """Link the temp in place where ``stat`` found no file; False when the name is taken
        again (by a regular file made meanwhile: the caller looks again)."""
        del stop
        with self.fs.dir(final.dir) as dir_fd:
            if not link_temp(dir_fd, tmp.name, final.name, f"writing {final.name} at {self.uri}"):
                self._check_squatter(dir_fd, final)
                return False
            self._unlink_temp(dir_fd, tmp)
            os.fsync(dir_fd)
        return True

    def _check_squatter(self, dir_fd: int, final: Entry) -> None:
        """Raise when what holds ``final``'s name is no regular file (``stat`` reads such a
        name as no file): a directory or a FIFO someone made where a shard goes read as a file
        "appearing and vanishing", a transient error retried for drain.retry_budget_s before
        failing with that wrong reason (found attacking a generation directory made first by
        someone else). Nothing is written over it: it is not ckptdrain's."""
        found = self.fs.check_entry(dir_fd, final.name, final.parts)  # (a link: UnsafePath)
        if found is None or stat.S_ISREG(found.st_mode):
            return
        what = ("directory" if stat.S_ISDIR(found.st_mode) else
                "FIFO" if stat.S_ISFIFO(found.st_mode) else
                "socket" if stat.S_ISSOCK(found.st_mode) else "device")
        raise BackendError(
            f"{self.root.joinpath(*final.parts)} is a {what}, where a shard of that name goes; "
            "ckptdrain writes nothing over it: remove it (someone other than the daemon made "
            "it: keep the destination writable only by the daemon), then `ckptdrain retry` "
            "the step", kind="conflict")

    def _replace_sync(self, tmp: Entry, final: Entry, stop: threading.Event) -> None:
        """Put the temp file over a leftover no manifest names (collision.py decided)."""
        del stop
        with self.fs.dir(final.dir) as dir_fd:
            # rename() replaces the name itself, never what a link there points to.
            try:
                os.rename(tmp.name, final.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileNotFoundError:
                raise temp_vanished(f"writing {final.name} at {self.uri}") from None
            self._live.discard(self._live_key(tmp))
            os.fsync(dir_fd)

    def _discard_sync(self, tmp: Entry, stop: threading.Event) -> None:
        del stop
        try:
            with self.fs.dir(tmp.dir) as dir_fd:
                self._unlink_temp(dir_fd, tmp)
        except FileNotFoundError:
            pass  # its directory went with it
        finally:
            self._live.discard(self._live_key(tmp))

    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        return await self._run(
            f"writing {key}", self._put_bytes_sync, self._entry(key), bytes(data), exclusive
        )

    def _put_bytes_sync(
        self, final: Entry, data: bytes, exclusive: bool, stop: threading.Event
    ) -> bool:
        del stop  # one small write: nothing to interrupt
        with self.fs.dir(final.dir, create=True) as dir_fd:
            tmp, out = self._open_temp(dir_fd, final)
            created = True
            try:
                try:
                    write_all(out, data)
                    os.fsync(out)
                finally:
                    os.close(out)
                try:
                    if exclusive:
                        # link() fails with EEXIST if the name exists, and the name appears
                        # with the complete, fsynced bytes: an atomic create-if-absent.
                        created = link_temp(dir_fd, tmp.name, final.name,
                                            f"writing {final.name} at {self.uri}")
                    else:
                        os.rename(tmp.name, final.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except FileNotFoundError:
                    raise temp_vanished(f"writing {final.name} at {self.uri}") from None
            finally:
                self._unlink_temp(dir_fd, tmp)
            if created:
                os.fsync(dir_fd)
        return created

    async def prepare_prefix(self, prefix: str) -> None:
        await self._run(f"creating {prefix}", self._prepare_sync, self._entry(prefix.rstrip("/")))

    def _prepare_sync(self, directory: Entry, stop: threading.Event) -> None:
        del stop
        with self.fs.dir(directory.dir, create=True) as parent_fd:
            found = self.fs.check_entry(parent_fd, directory.name, directory.parts)
            if found is not None and stat.S_ISDIR(found.st_mode):
                return
            lfs = shutil.which("lfs")
            if lfs is None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(directory.name, 0o755, dir_fd=parent_fd)
                    os.fsync(parent_fd)
                return
            self._striped_mkdir(lfs, parent_fd, directory)
            os.fsync(parent_fd)

    def _striped_mkdir(self, lfs: str, parent_fd: int, directory: Entry) -> None:
        # Striping applies only to files created after it is set, and other nodes write into
        # the same generation directory. So stripe a private temp directory and rename it into
        # place: the generation directory appears already striped, and no node can create a
        # file in it first. Whoever loses the race removes its (empty) temp directory.
        tmp = directory.with_name(temp_name(directory.name, self.node_id))
        self._live.add(self._live_key(tmp))
        try:
            striped_mkdir(lfs, parent_fd, tmp.name, directory.name, self.stripe_count,
                          self.stripe_size_bytes)
        finally:
            self._live.discard(self._live_key(tmp))

    async def delete(self, key: str) -> None:
        await self._run(f"deleting {key}", remove_one, self.fs, self._entry(key))

    async def delete_many(self, keys: Sequence[str]) -> None:
        # A batch per thread job (posixremove): one walk and one fsync per directory. The keys
        # are split into directories in the thread too: 100,000 of them take 0.25 s.
        batches = [keys[i:i + REMOVE_BATCH] for i in range(0, len(keys), REMOVE_BATCH)]

        async def remove(batch: Sequence[str]) -> None:
            await self._run(f"deleting {len(batch)} keys from {batch[0]}", self._remove_keys,
                            batch)

        await for_each_bounded(batches, remove, REMOVE_AT_ONCE)

    def _remove_keys(self, keys: Sequence[str], stop: threading.Event) -> None:
        remove_many(self.fs, [self._entry(key) for key in keys], stop)

    async def remove_empty(self, prefixes: Sequence[str], unchanged_since: float, *,
                           dry_run: bool = False) -> builtins.list[str]:
        removed = []
        for prefix in prefixes:
            if await self._run(f"removing the empty directories of {prefix}", remove_empty_tree,
                               self.fs, self._parts(prefix.rstrip("/")), unchanged_since,
                               dry_run):
                removed.append(prefix)
        return removed

    # --- reads ------------------------------------------------------------------------------

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
        # One thread job per file, copied by the kernel and checksummed from the page cache:
        # no event-loop hop and no user-space write loop.
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
            # checksum maps what was written when that is the caller's own file, never the
            # destination's file or a client's, which others may truncate (checksum_into).
            try:
                checksum = copy_and_checksum(src, out_fd, size, stop, parts[-1], algo,
                                             progress=progress, write_behind=False,
                                             mapped=out_fd if owned else None)
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

    # --- housekeeping -----------------------------------------------------------------------

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        """Remove temp files and temp directories left by interrupted writes: this node's at
        any age (call it before this node starts draining), other nodes' once this process
        has seen them unchanged for ``grace_s`` (they may still be writing them)."""
        del owned_upload_ids  # POSIX has no uploads; its leftovers are temp names
        return await self._run(
            "sweeping temp files", sweep_temps, self.fs, self.node_id, self._live, grace_s,
            self._watched, self.clock(),
        )

    def _parallel_writes(self, dir_fd: int) -> bool:
        """Large shards go as parallel segments only where the destination's filesystem
        takes writes to one file at once (posixfs.writes_in_parallel); learnt once."""
        if self.parallel_writes is None:
            self.parallel_writes = writes_in_parallel(dir_fd)
        return self.parallel_writes

    def _direct_writes(self, dir_fd: int) -> bool:
        """Shards go with direct I/O where the destination is a local block filesystem
        (posixfs.writes_direct); learnt once."""
        if self.direct_writes is None:
            self.direct_writes = writes_direct(dir_fd)
        return self.direct_writes

    def _segment_pool(self) -> ThreadPoolExecutor:
        """Threads for the segments of large shards, apart from the threads that wait for them
        (one pool for both could fill with waiters and deadlock)."""
        with self._segments_lock:
            if self._segments is None:
                self._segments = ThreadPoolExecutor(
                    self.max_threads * PARALLEL_SEGMENTS, thread_name_prefix="posix-segment",
                    initializer=yield_to_handoffs)
            return self._segments

    async def aclose(self) -> None:
        """Stop the worker threads once their current calls finish."""
        executor, self._executor = self._executor, None
        if executor is not None:
            # Waits for running calls (each is bounded by one chunk after a cancel).
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
        with self._segments_lock:
            segments, self._segments = self._segments, None
        if segments is not None:
            await asyncio.to_thread(segments.shutdown, wait=True, cancel_futures=True)
