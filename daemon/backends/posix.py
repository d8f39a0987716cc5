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

Built in layers as the S3 backend is: posixroot.py (the root, its threads, keys made paths;
every blocking call runs in a worker thread, never on the event loop), posixreads.py (the
reads), and this module: the writes, removal, and the sweep of interrupted writes.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import shutil
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptdrain.daemon.backends.base import Backend, BackendError, Flow, ThreadFlow, UploadLog
from ckptdrain.daemon.backends.beneath import Entry, UnsafePath
from ckptdrain.daemon.backends.collision import check_replaced, settle_existing
from ckptdrain.daemon.backends.posixbatch import (
    BATCH_BYTES,
    BATCH_SHARDS,
    SMALL_SHARD_BYTES,
    create_many,
)
from ckptdrain.daemon.backends.posixfs import (
    NAME_MAX,
    backend_error,
    link_temp,
    temp_vanished,
    write_all,
)
from ckptdrain.daemon.backends.posixlayout import LFS_TIMEOUT_S, striped_mkdir
from ckptdrain.daemon.backends.posixreads import PosixReads
from ckptdrain.daemon.backends.posixremove import (
    REMOVE_AT_ONCE,
    REMOVE_BATCH,
    remove_empty_tree,
    remove_many,
    remove_one,
)
from ckptdrain.daemon.backends.posixtemps import sweep_temps, temp_name
from ckptdrain.daemon.directcopy import DIRECT_MIN_BYTES, direct_copy_and_checksum
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.filecopy import (
    COPY_RANGE_BYTES,
    copy_and_checksum,
    parallel_copy_and_checksum,
)
from ckptdrain.daemon.logs import log_event

# Re-exported: the names tests and older imports know this module by.
__all__ = ["COPY_RANGE_BYTES", "LFS_TIMEOUT_S", "NAME_MAX", "PosixBackend", "ReadSettings",
           "UnsafePath", "backend_error", "temp_name"]

log = logging.getLogger(__name__)

# How often a create-once write retries when the existing file it found vanished before it
# could be compared (retention removing an abandoned generation at that very moment).
_CREATE_ROUNDS = 3
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


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


class PosixBackend(PosixReads, Backend):
    """A directory tree; keys are relative paths under ``config.root_path``."""

    batch_shards = BATCH_SHARDS
    batch_shard_bytes = SMALL_SHARD_BYTES
    batch_bytes = BATCH_BYTES

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
