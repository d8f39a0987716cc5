"""The POSIX destination (Lustre, NFS, a local directory): ``file:///path``.

Every file is written under a temporary name in its final directory (same directory, same
mount: ``rename`` never meets EXDEV), fsynced, renamed into place, and the directory fsynced,
so a key is either absent or complete even across a power cut. Exclusive creates (the
manifest) use ``link()``, which fails on an existing name atomically on every POSIX
filesystem Lustre included, where ``O_EXCL`` alone would expose a half-written file.

All blocking calls run in worker threads, never on the event loop. A cancelled call waits for
its thread to reach the next chunk boundary and clean up before the cancellation propagates,
so the caller may close the source fd as soon as the await returns.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import hashlib
import logging
import os
import secrets
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckptdrain.client.manifest import TMP_SUFFIX, format_checksum
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo, UploadLog

if TYPE_CHECKING:
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

_T = TypeVar("_T")

COPY_BUFFER_BYTES = 8 << 20
# Threads beyond max_concurrency, for small metadata operations during a full drain.
EXTRA_THREADS = 4
# `lfs setstripe` talks to the MDS; if it hangs, the generation is written with the directory's
# default layout rather than not at all.
LFS_TIMEOUT_S = 30.0
_RANDOM_HEX = 12
# Longest file name on Linux filesystems, Lustre included (names are ASCII, so bytes = chars).
NAME_MAX = 255
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_AUTH_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC

# One copy buffer per worker thread, reused for every file: allocating 8 MiB per file costs
# more than the copy (seeds: fresh memory is ~10x slower than a reused buffer).
_buffers = threading.local()


def _copy_buffer() -> memoryview:
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = memoryview(bytearray(COPY_BUFFER_BYTES))
        _buffers.buf = buf
    return buf


class _Stopped(Exception):
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
    tail = f".{node_id}.{secrets.token_hex(_RANDOM_HEX // 2)}{TMP_SUFFIX}"
    budget = max(0, NAME_MAX - 1 - len(tail))
    return f".{final_name[:budget]}{tail}"


def _temp_owner_matches(name: str, node_id: str) -> bool:
    stem = name[: -len(TMP_SUFFIX)]
    head, dot, rand = stem.rpartition(".")
    if not dot or len(rand) != _RANDOM_HEX:
        return False
    return head.endswith(f".{node_id}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(directory: Path) -> None:
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
        _fsync_dir(path.parent)


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class PosixBackend(Backend):
    """A directory tree; keys are relative paths under ``config.root_path``."""

    def __init__(self, config: DestinationConfig, node_id: str) -> None:
        self.uri = config.uri
        self.root = Path(config.root_path)
        self.node_id = node_id
        self.stripe_count = int(config.stripe_count)
        self.stripe_size_bytes = int(config.stripe_size_bytes)
        # Its own threads, sized to the configured drain concurrency plus headroom so a part
        # record or manifest write is not queued behind full-size shard copies (the shared
        # default executor has min(32, cores + 4) threads and serves everyone else too).
        self.max_threads = int(config.max_concurrency) + EXTRA_THREADS
        self._executor: ThreadPoolExecutor | None = None
        # Temp names this process is writing right now: a sweep (at start-up or periodic)
        # must never take a file from under a copy in flight.
        self._live: set[str] = set()

    # --- plumbing ---------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """The file for ``key``; keys are built from validated names, so a key that could
        leave the root is a bug and fails loudly."""
        parts = key.split("/")
        if (
            not key
            or key.startswith("/")
            or any(p in ("", ".", "..") for p in parts)
            or "\0" in key
        ):
            raise ValueError(f"invalid destination key {key!r}")
        return self.root.joinpath(*parts)

    async def _run(self, what: str, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn(*args, stop)`` in a worker thread; OSError becomes BackendError.

        On cancellation the thread is told to stop and awaited (it checks between chunks),
        so no thread keeps using the caller's fd or leaves a temp file behind.
        """
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_threads, thread_name_prefix="posix-dest")
        future = loop.run_in_executor(self._executor, lambda: fn(*args, stop))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            stop.set()
            # The thread finishes its current chunk (bounded by one buffer's I/O) and cleans up.
            await asyncio.wait([future])
            if not future.cancelled():
                future.exception()  # retrieved: the cancellation is what the caller sees
            raise
        except OSError as exc:
            raise backend_error(exc, f"{what} at {self.uri}") from exc

    # --- writes -----------------------------------------------------------------------------

    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None
    ) -> str:
        # upload_log is for resumable multipart uploads; a POSIX write restarts from zero.
        del upload_log
        if size < 0:
            raise ValueError(f"size must be >= 0, not {size}")
        return await self._run(f"writing {key}", self._put_file_sync, self._path(key), fd, size)

    def _open_temp(self, final: Path) -> tuple[Path, int]:
        """A new temp file beside ``final``, marked live so no sweep takes it; the caller
        renames or unlinks it and then drops it from ``_live``."""
        tmp = final.with_name(temp_name(final.name, self.node_id))
        self._live.add(str(tmp))
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except BaseException:
            self._live.discard(str(tmp))
            raise

    def _put_file_sync(self, final: Path, src_fd: int, size: int, stop: threading.Event) -> str:
        _makedirs(final.parent)
        tmp, out = self._open_temp(final)
        # The temp exists from here: every way out either renames it or unlinks it.
        published = False
        try:
            try:
                digest = self._copy(src_fd, out, size, stop, final)
                os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, final)
            published = True
        finally:
            if not published:
                tmp.unlink(missing_ok=True)
            self._live.discard(str(tmp))
        _fsync_dir(final.parent)
        return format_checksum("sha256", digest)

    @staticmethod
    def _copy(src_fd: int, out: int, size: int, stop: threading.Event, final: Path) -> str:
        buf = _copy_buffer()
        digest = hashlib.sha256()
        offset = 0
        while offset < size:
            if stop.is_set():
                raise _Stopped
            want = min(len(buf), size - offset)
            got = os.preadv(src_fd, [buf[:want]], offset)
            if got == 0:
                raise BackendError(
                    f"source of {final.name} ended at byte {offset} of {size}: the staged file "
                    "was truncated",
                    kind="integrity",
                )
            chunk = buf[:got]
            # hashlib releases the GIL for large updates, so other drains proceed meanwhile.
            digest.update(chunk)
            _write_all(out, chunk)
            offset += got
        return digest.hexdigest()

    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        return await self._run(
            f"writing {key}", self._put_bytes_sync, self._path(key), bytes(data), exclusive
        )

    def _put_bytes_sync(
        self, final: Path, data: bytes, exclusive: bool, stop: threading.Event
    ) -> bool:
        del stop  # one small write: nothing to interrupt
        _makedirs(final.parent)
        tmp, out = self._open_temp(final)
        created = True
        try:
            try:
                _write_all(out, data)
                os.fsync(out)
            finally:
                os.close(out)
            if exclusive:
                # link() fails with EEXIST if the name exists, and the name appears with the
                # complete, fsynced bytes: an atomic create-if-absent.
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    created = False
            else:
                os.rename(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
            self._live.discard(str(tmp))
        if created:
            _fsync_dir(final.parent)
        return created

    async def prepare_prefix(self, prefix: str) -> None:
        await self._run(f"creating {prefix}", self._prepare_sync, self._path(prefix.rstrip("/")))

    def _prepare_sync(self, directory: Path, stop: threading.Event) -> None:
        del stop
        if directory.is_dir():
            return
        lfs = shutil.which("lfs")
        if lfs is None:
            _makedirs(directory)
            return
        # Striping applies only to files created after it is set, and other nodes write into
        # the same generation directory. So stripe a private temp directory and rename it into
        # place: the generation directory appears already striped, and no node can create a
        # file in it first. Whoever loses the race removes its (empty) temp directory.
        _makedirs(directory.parent)
        tmp = directory.with_name(temp_name(directory.name, self.node_id))
        self._live.add(str(tmp))
        try:
            tmp.mkdir()
        except BaseException:
            self._live.discard(str(tmp))
            raise
        try:
            self._setstripe(lfs, tmp)
            try:
                os.rename(tmp, directory)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            if tmp.exists():
                tmp.rmdir()
            self._live.discard(str(tmp))
        _fsync_dir(directory.parent)

    def _setstripe(self, lfs: str, directory: Path) -> None:
        cmd = [
            lfs,
            "setstripe",
            "-c",
            str(self.stripe_count),
            "-S",
            str(self.stripe_size_bytes),
            str(directory),
        ]
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

    async def delete(self, key: str) -> None:
        await self._run(f"deleting {key}", self._delete_sync, self._path(key))

    def _delete_sync(self, path: Path, stop: threading.Event) -> None:
        del stop
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        # Retention deletes a manifest before its shards; the unlink must be durable before
        # the shards go, or a crash could resurrect a manifest whose shards are gone.
        try:
            _fsync_dir(path.parent)
        except FileNotFoundError:
            return  # a concurrent delete emptied and removed the directory: durable already
        # Directories left empty (a removed generation's) would use up Lustre inodes. Only
        # retention deletes, and only generations nobody writes; <root>/<job> itself stays.
        parent = path.parent
        while parent != self.root and parent.parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break  # not empty (or gone): stop here
            parent = parent.parent

    # --- reads ------------------------------------------------------------------------------

    async def get_bytes(self, key: str, *, max_bytes: int = 64 << 20) -> bytes | None:
        return await self._run(f"reading {key}", self._get_bytes_sync, self._path(key), max_bytes)

    @staticmethod
    def _get_bytes_sync(path: Path, max_bytes: int, stop: threading.Event) -> bytes | None:
        del stop
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
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

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self._run(f"listing {prefix or '/'}", self._list_sync, prefix)

    def _list_sync(self, prefix: str, stop: threading.Event) -> builtins.list[ObjectInfo]:
        # Keys match by string prefix like S3; walk only the deepest directory the prefix names.
        base_key = prefix.rpartition("/")[0]
        base = self._path(base_key) if base_key else self.root
        found: builtins.list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(base):
            if stop.is_set():
                raise _Stopped
            rel = os.path.relpath(dirpath, self.root)
            key_dir = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in files:
                if name.endswith(TMP_SUFFIX):
                    continue
                key = key_dir + name
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted since the directory was read
                if stat.S_ISREG(st.st_mode):
                    found.append(ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime))
        found.sort(key=lambda info: info.key)
        return found

    async def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncIterator[bytes]:
        path = self._path(key)
        fd = await self._run(f"opening {key}", self._open_sync, path)
        # The fd is closed however the iteration ends (exhausted, broken off, cancelled).
        try:
            while True:
                chunk = await self._run(f"reading {key}", self._read_sync, fd, chunk_bytes)
                if not chunk:
                    return
                yield chunk
        finally:
            os.close(fd)

    async def copy_into(
        self, key: str, out_fd: int, *, progress: Callable[[int], None] | None = None
    ) -> tuple[int, str]:
        # One thread job per file: read into a reused buffer, hash, write; no event-loop hop
        # and no fresh allocation per chunk.
        return await self._run(f"reading {key}", self._copy_into_sync, self._path(key), out_fd,
                               progress)

    def _copy_into_sync(self, path: Path, out_fd: int, progress: Callable[[int], None] | None,
                        stop: threading.Event) -> tuple[int, str]:
        src = self._open_sync(path, stop)
        try:
            view = _copy_buffer()
            digest = hashlib.sha256()
            size = 0
            while n := os.readv(src, [view]):
                if stop.is_set():
                    raise _Stopped
                chunk = view[:n]
                digest.update(chunk)
                _write_all(out_fd, chunk)
                size += n
                if progress is not None:
                    progress(n)
            return size, format_checksum("sha256", digest.hexdigest())
        finally:
            os.close(src)

    @staticmethod
    def _open_sync(path: Path, stop: threading.Event) -> int:
        del stop
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise BackendError(f"{path} does not exist", kind="integrity") from exc

    @staticmethod
    def _read_sync(fd: int, chunk_bytes: int, stop: threading.Event) -> bytes:
        del stop
        return os.read(fd, chunk_bytes)

    # --- housekeeping -----------------------------------------------------------------------

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        """Remove temp files and temp directories left by interrupted writes: this node's at
        any age (call it before this node starts draining), other nodes' once older than
        ``grace_s`` (they may still be writing younger ones)."""
        del owned_upload_ids  # POSIX has no uploads; its leftovers are temp names
        return await self._run("sweeping temp files", self._sweep_sync, grace_s)

    def _sweep_sync(self, grace_s: float, stop: threading.Event) -> int:
        if not self.root.is_dir():
            return 0
        cutoff = time.time() - grace_s
        removed = 0
        for dirpath, dirs, files in os.walk(self.root):
            if stop.is_set():
                raise _Stopped
            for name in [*files, *dirs]:
                if not name.endswith(TMP_SUFFIX):
                    continue
                path = os.path.join(dirpath, name)
                if path in self._live:
                    continue
                try:
                    st = os.lstat(path)
                    mine = _temp_owner_matches(name, self.node_id)
                    if not mine and st.st_mtime > cutoff:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        os.rmdir(path)  # only ever an empty striping temp directory
                    else:
                        os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                        continue
                    raise
                removed += 1
                log.info("removed leftover temp %s", path)
            dirs[:] = [d for d in dirs if not d.endswith(TMP_SUFFIX)]
        return removed

    async def aclose(self) -> None:
        """Stop the worker threads once their current calls finish."""
        executor, self._executor = self._executor, None
        if executor is not None:
            # Waits for running calls (each is bounded by one chunk after a cancel).
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
