"""The root of a POSIX destination as :class:`~ckptdrain.daemon.backends.posix.PosixBackend`
reaches it: keys made entries below the root (beneath.py), the worker threads every blocking
call runs in, and what the destination's filesystem was learnt to take (parallel segments,
direct I/O). A base of the backend, as s3client.py is of the S3 one; the reads
(posixreads.py) and the writes (posix.py) are built on it.

All blocking calls run in worker threads, never on the event loop. A cancelled call waits for
its thread to reach the next chunk boundary and clean up before the cancellation propagates,
so the caller may close the source fd as soon as the await returns.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.beneath import Beneath, Entry
from ckptdrain.daemon.backends.posixbatch import LOCAL_BATCH_LANES
from ckptdrain.daemon.backends.posixfs import ChecksumXattr, backend_error
from ckptdrain.daemon.backends.posixlayout import writes_direct, writes_in_parallel
from ckptdrain.daemon.backends.posixtemps import Watched
from ckptdrain.daemon.filecopy import PARALLEL_SEGMENTS, Truncated, yield_to_handoffs
from ckptdrain.daemon.threads import settled

_T = TypeVar("_T")

# Threads beyond max_concurrency, for small metadata operations during a full drain.
EXTRA_THREADS = 4


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


class PosixRoot:
    """A directory tree; keys are relative paths under ``config.root_path`` (the plumbing of
    PosixBackend)."""

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

    def _parallel_writes(self, dir_fd: int) -> bool:
        """Large shards go as parallel segments only where the destination's filesystem
        takes writes to one file at once (posixlayout.writes_in_parallel); learnt once."""
        if self.parallel_writes is None:
            self.parallel_writes = writes_in_parallel(dir_fd)
        return self.parallel_writes

    def _direct_writes(self, dir_fd: int) -> bool:
        """Shards go with direct I/O where the destination is a local block filesystem
        (posixlayout.writes_direct); learnt once."""
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
