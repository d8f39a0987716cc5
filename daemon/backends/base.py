"""The interface every destination implements.

Keys are ``/``-separated and relative to the destination root given by the URI
(``file:///lustre/proj/ckpt`` or ``s3://bucket/prefix``). Every write is atomic as seen by
readers: a key is either absent or holds its complete bytes. Shard writes (``put_file``) are
create-once: they never replace bytes a committed manifest lists (see ``collision.py``).
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckptdrain.client.manifest import MAX_RECORD_BYTES
from ckptdrain.daemon import checksums
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.threads import settled

if TYPE_CHECKING:
    from ckptdrain.daemon.config import DestinationConfig


# Single deletes in flight at once (Backend.delete_many's default): one at a time would take
# minutes for a 100,000-shard generation; an unbounded burst would be throttled (503 SlowDown)
# or swamp a Lustre MDS.
DELETE_CONCURRENCY = 16


class BackendError(DaemonError):
    """A destination operation failed. ``transient`` errors are worth retrying."""

    def __init__(self, message: str, *, transient: bool = False, kind: str = "io") -> None:
        super().__init__(message)
        self.transient = transient
        # Bounded label for metrics: "io", "timeout", "throttled", "auth", "integrity", "conflict",
        # "unsafe" (a link planted in a POSIX destination).
        self.kind = kind


class ShardConflict(BackendError):
    """A shard write found its key taken by bytes this write may not replace: the generation
    is committed (or its MANIFEST.json is otherwise taken). Not transient: retrying cannot
    help; the attempt must save a new step. The committed bytes were left alone."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False, kind="conflict")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    # Unix time of the last write, when the destination reports it (None: unknown). Not part
    # of equality: two listings of the same objects compare equal.
    modified: float | None = field(default=None, compare=False)
    # "crc64nvme:<hex>" (or an older "sha256:<hex>") of the bytes, as the destination recorded it when the object was created
    # (only ``stat`` fills it; None: not recorded, e.g. an object an older version wrote).
    checksum: str | None = field(default=None, compare=False)
    # Whether the destination computed ``checksum`` from the bytes it received and checks it
    # (S3's full-object CRC64NVME), rather than keeping what a writer told it (metadata any
    # client may set): only such a checksum stands in for reading the bytes.
    validated: bool = field(default=False, compare=False)


class Flow(Protocol):
    """How one copy tells the drain about its bytes as they move: ``pace`` before sending
    ``nbytes`` (the drain's token bucket may make it wait), ``moved`` once they are at the
    destination (progress, drained bytes, the drain rate). A 10 GB shard is then paced and
    reported like ten 1 GB ones, not as one lump at its end."""

    async def pace(self, nbytes: int) -> None: ...

    def moved(self, nbytes: int) -> None: ...


class ThreadFlow:
    """A :class:`Flow` for a copy that runs in a worker thread (POSIX): ``pace`` blocks the
    thread (never the loop) until the loop's pacing lets it go, or ``stop`` is set."""

    def __init__(self, flow: Flow, loop: asyncio.AbstractEventLoop) -> None:
        self._flow = flow
        self._loop = loop

    def pace(self, nbytes: int, stop: threading.Event) -> bool:
        """False when ``stop`` was set while waiting."""
        future = asyncio.run_coroutine_threadsafe(self._flow.pace(nbytes), self._loop)
        while True:
            try:
                future.result(timeout=0.2)
                return True
            except concurrent.futures.TimeoutError:
                if stop.is_set():
                    future.cancel()
                    return False

    def moved(self, nbytes: int) -> None:
        self._loop.call_soon_threadsafe(self._flow.moved, nbytes)


class UploadLog(Protocol):
    """Where a resumable upload journals its progress (S3 multipart); POSIX ignores it."""

    async def load(self) -> tuple[str | None, dict[int, tuple[str, str]]]:
        """The upload id begun earlier (or None) and its parts: number -> (etag, checksum)."""
        ...

    async def begun(self, upload_id: str) -> None: ...

    async def part_done(self, number: int, etag: str, checksum: str) -> None: ...

    async def finished(self) -> None: ...

    def is_open(self) -> bool:
        """Whether an upload is journalled as begun and not finished (no I/O)."""
        ...


class Backend(abc.ABC):
    """One destination. Instances are used from one event loop; methods are coroutine-safe."""

    uri: str
    # The node this backend writes for (temp names, upload metadata, tombstones carry it).
    node_id: str = ""
    # Incomplete uploads this backend aborted so far (put_file cleanup and sweeps together).
    aborted_uploads: int = 0
    # Whether the destination itself validated each shard's checksum when it was written and
    # stores it (S3's full-object CRC64NVME): then ``verify`` trusts ``stat`` without reading.
    # A POSIX xattr records a checksum but proves nothing about the bytes beside it.
    validates_checksums: bool = False
    # Small shards the drain may hand over together in one put_files call (see there): at
    # most this many (1: one at a time), of at most ``batch_shard_bytes`` each and
    # ``batch_bytes`` in all.
    batch_shards: int = 1
    batch_shard_bytes: int = 0
    batch_bytes: int = 0
    # Set when the daemon stops: a write cancelled now is the shutdown's, not an abort's, so
    # one that can resume at the next start (a journalled multipart upload) is left to it.
    stopping: bool = False

    @property
    def batch_lanes(self) -> int:
        """How many drains of small shards (a batch, or one alone) may run at once; the drain's
        workers (``destination.max_concurrency``) bound the rest."""
        return 1 << 30

    async def put_files(
        self, items: builtins.list[tuple[str, int, int]],
    ) -> builtins.list[str | BackendError | None]:
        """:meth:`put_file` of several small shards, ``(key, fd, size)`` each, in one go (a
        destination that can share work among them overrides it). Per item, in order: its
        checksum once it is written and durable, the error that failed it, or None when its
        key already exists and nothing was written (the caller sends it through
        :meth:`put_file`, which settles what is in the way). The caller paces and reports
        the bytes."""
        out: builtins.list[str | BackendError | None] = []
        for key, fd, size in items:
            try:
                out.append(await self.put_file(key, fd, size))
            except BackendError as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None,
        flow: Flow | None = None,
    ) -> str:
        """Copy ``size`` bytes of the open file ``fd`` (from offset 0, with ``pread``) to ``key``,
        telling ``flow`` about the bytes as they move.

        Returns the checksum of the bytes written, ``"crc64nvme:<hex>"``, computed from the
        bytes read from ``fd`` (in the same pass, or from the page cache right after). The key becomes visible only complete, and the
        checksum is recorded with it (``stat`` returns it).

        Create-once: when ``key`` already exists, identical bytes (size and checksum) count as
        drained and nothing is written; other bytes are replaced only if their generation is
        not committed, and a committed one raises :class:`ShardConflict` (see collision.py).
        """

    @abc.abstractmethod
    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write a small object. With ``exclusive``, create it only if absent and return False
        when it already existed (``link``/``O_EXCL`` on POSIX, ``If-None-Match: *`` on S3)."""

    @abc.abstractmethod
    async def get_bytes(self, key: str, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes | None:
        """Read a small object, or None when it does not exist. What takes the key but no
        reader may read raises BackendError with a kind in latest.NOT_A_COMMIT: "unsafe" (a
        link) or "integrity" (over ``max_bytes``; on POSIX, no regular file: a FIFO, a
        directory)."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every key under ``prefix`` (recursive), sorted by key; temporary files excluded."""

    @abc.abstractmethod
    async def stat(self, key: str, *, checksum: bool = True) -> ObjectInfo | None:
        """Size, modification time and recorded checksum of ``key``; None when it is absent.
        One request or syscall, never a read of the bytes, except on a POSIX filesystem that
        could not record the checksum (no user xattrs), where the file is hashed instead (and
        the checksum recorded). With ``checksum=False``, size and time only (``checksum`` is
        None): never a read, never a write (POSIX: one ``fstat``)."""

    async def stat_many(self, keys: Sequence[str], *,
                        concurrency: int = 32) -> builtins.list[ObjectInfo | None]:
        """:meth:`stat` of every key, in order (the commit's proof of every shard): here at
        most ``concurrency`` at once. A backend that can answer many in one go overrides it
        (POSIX: one thread job per batch instead of a thread hop per shard)."""

        found: builtins.list[ObjectInfo | None] = [None] * len(keys)

        async def one(i: int) -> None:
            found[i] = await self.stat(keys[i])

        await for_each_bounded(range(len(keys)), one, concurrency)
        return found

    @abc.abstractmethod
    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate "directories" under ``prefix`` (which ends in ``/``), sorted:
        the generation directories of ``<job>/`` in one request, without listing shards."""

    @abc.abstractmethod
    def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncGenerator[bytes, None]:
        """The object's bytes in order, for verify and restore."""

    async def copy_into(
        self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
        progress: Callable[[int], None] | None = None, owned: bool = False,
        expected_size: int | None = None,
    ) -> tuple[int, str]:
        """Write the object into the open file ``out_fd``, each byte at its own offset from 0
        (never at the file's position, and never with O_APPEND); returns (bytes written, their
        checksum with ``algo``, the one the manifest used). Restore's bulk path; a backend may
        do it without a hop to the event loop per chunk (POSIX does). ``owned``: ``out_fd`` is
        a file of the caller's own that nobody else can shrink (restore's temp file, opened for
        reading too), so a backend may checksum it by mapping its pages; never for a client's
        fd, which the client could truncate under the mapping (see filecopy.checksum_into).
        ``expected_size``: the size the manifest lists, when the caller has one; a backend may
        plan the read by it instead of asking the destination first (the caller compares what
        came back with the manifest anyway), and stops as soon as the object is known to differ
        from it: a runaway object is not read to its end into the caller's disk (found
        attacking restore: 48 MiB written for a shard the manifest lists as 1 byte)."""
        del owned  # the chunks are checksummed as they arrive, in order
        digest = checksums.new(algo)
        size = 0
        loop = asyncio.get_running_loop()
        # Closed on every way out: a read given up early lets its connection go at once.
        async with contextlib.aclosing(self.read_chunks(key)) as chunks:
            async for chunk in chunks:
                if expected_size is not None and size + len(chunk) > expected_size:
                    return size + len(chunk), ""  # longer than the manifest says: wrong
                # Waited for even when cancelled: no thread may write to out_fd once we return.
                await settled(loop.run_in_executor(None, _hash_and_write, digest, out_fd,
                                                   chunk, size))
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        return size, digest.value()

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove a key; a missing key is not an error."""

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Remove every key (a missing one is not an error); when this returns, every removal
        has finished and is as durable as :meth:`delete`'s. The first failure is raised, and
        the other keys may or may not be gone. Here, :meth:`delete` with at most
        :data:`DELETE_CONCURRENCY` at once; a backend with a bulk delete overrides it (S3:
        DeleteObjects, 1,000 keys a request; POSIX: one thread job and one directory fsync
        per directory of a batch)."""

        await for_each_bounded(keys, self.delete, DELETE_CONCURRENCY)

    async def remove_empty(self, prefixes: Sequence[str], unchanged_since: float, *,
                           dry_run: bool = False) -> builtins.list[str]:
        """Remove what is left of the generation directories ``prefixes`` when they hold no
        key: empty directories not changed since ``unchanged_since`` (Unix time), deepest
        first, never following a link (POSIX: a removal interrupted before its directories
        went, a generation that never wrote a shard). Returns the prefixes whose directory
        went; with ``dry_run`` removes nothing and returns those whose directory would go.
        Stores without directories have none."""
        del unchanged_since, dry_run
        return []

    async def prepare_prefix(self, prefix: str) -> None:  # noqa: B027 - optional hook
        """Called once before the first object under a generation prefix is written
        (POSIX creates the directory and applies Lustre striping)."""

    async def abort_upload(self, key: str, upload_log: UploadLog) -> bool:
        """Give up the resumable upload ``upload_log`` holds for ``key`` (a shard whose
        generation failed or was cancelled): abort it, confirm nothing is left, and clear the
        log. True when nothing remains; destinations without uploads have nothing to do."""
        return True

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        """Abort incomplete uploads under the root not in ``owned_upload_ids`` and older than
        ``grace_s``; returns how many were aborted. Destinations without uploads return 0."""
        return 0

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Start what the destination runs (S3 upload workers) before the first drain needs
        it, so the first checkpoint does not wait for it. A failure here is not fatal: what
        failed to start is started again on first use."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def _hash_and_write(digest: Any, fd: int, chunk: bytes, at: int) -> None:
    """Add ``chunk`` to ``digest`` and write it at offset ``at`` of ``fd``: at its own offset,
    as every copy_into writes, so the result does not depend on the fd's file position."""
    digest.update(chunk)
    view = memoryview(chunk)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


def open_backend(config: DestinationConfig, node_id: str, *, workers: int = 0,
                 writes_on_loop: bool = False, readers: int = 0) -> Backend:
    """The backend for ``config.uri`` (``file://`` or ``s3://``), acting for ``node_id``
    (temp names and upload metadata carry it, so sweeps know whose leftovers they see).
    ``workers``: processes that send S3 parts (0: the caller's own event loop).
    ``writes_on_loop``: an S3 restore writes what it reads into its file on the event loop's
    thread; for a process whose loop serves that alone (the ``ckptdrain`` command), never the
    daemon. ``readers``: processes that read a large S3 object's ranges for a restore (0: the
    caller's own event loop)."""
    uri = config.uri
    if uri.startswith("file://"):
        from ckptdrain.daemon.backends.posix import PosixBackend

        return PosixBackend(config, node_id)
    if uri.startswith("s3://"):
        from ckptdrain.daemon.backends.s3 import S3Backend

        return S3Backend(config, node_id, workers=workers, writes_on_loop=writes_on_loop,
                         readers=readers)
    if uri.startswith("memory://"):
        from ckptdrain.daemon.backends.memory import MemoryBackend

        return MemoryBackend.named(uri, node_id)
    raise ValueError(f"unsupported destination URI {uri!r}: use file:///path or s3://bucket/prefix")
