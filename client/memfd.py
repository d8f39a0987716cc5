"""A pool of memfds for ``ack = "memory"`` hand-offs (Linux).

The client copies a shard into a memfd and passes the fd; the daemon owns the bytes from
then on. Reusing memfds avoids allocating and zeroing fresh shared memory for every shard
(about 3x faster here). A memfd is reusable only once the daemon has let go of it: the daemon
holds a shared POSIX record lock on every memfd it keeps, and the kernel drops that lock when
the daemon closes its copy, so a failed non-blocking exclusive lock here means "still in use".

An idle memfd keeps its pages, charged to the training process's memory, until it is reused
or closed: the pool keeps at most ``max_idle_bytes`` of them (found attacking: after a save
of 8 shards of 16 MiB the client held 96 MiB between checkpoints, and with shards of several
GiB it would hold up to 8 of them). Closing one here frees its pages once the daemon has let
go of its copy too; the daemon's copy is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading

from ckptdrain.client import forks
from ckptdrain.client.errors import DaemonUnavailable

DEFAULT_MAX_FDS = 8
# Idle memfds' bytes kept for reuse (Client(memfd_pool_bytes=...)).
DEFAULT_MAX_IDLE_BYTES = 1 << 30


def create(name: str, doing: str, what_for: str) -> int:
    """A new memfd (close-on-exec), or the typed error saying why none could be made: this
    process out of fds (EMFILE) or memory. The bare OSError reached callers outside DrainError
    (found attacking a resume and a save at a low RLIMIT_NOFILE). ``doing``: what could not
    be done ("cannot read 'x' ..."); ``what_for``: what the memfd was to hold."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError as exc:
        raise DaemonUnavailable(
            f"{doing}: this process could not make a memfd {what_for} "
            f"({exc.strerror or exc}); close file descriptors it no longer needs, or raise its "
            "RLIMIT_NOFILE, and retry",
            details={"errno": exc.errno},
        ) from exc


def in_use_elsewhere(fd: int) -> bool:
    """Whether another process (the daemon) holds a record lock on the memfd."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    fcntl.lockf(fd, fcntl.LOCK_UN)
    return False


def fill(fd: int, data: memoryview) -> None:
    """Make the memfd hold exactly ``data``."""
    offset, total = 0, data.nbytes
    while offset < total:
        offset += os.pwrite(fd, data[offset:], offset)
    os.ftruncate(fd, total)


class MemfdPool:
    """At most ``max_fds`` idle memfds, of ``max_idle_bytes`` in all, kept for reuse;
    thread-safe."""

    def __init__(self, max_fds: int = DEFAULT_MAX_FDS,
                 max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES) -> None:
        self.max_fds = max_fds
        self.max_idle_bytes = max_idle_bytes
        self._fds: list[int] = []  # idle, oldest first
        self._sizes: dict[int, int] = {}  # an idle memfd's bytes
        self._out: set[int] = set()  # acquired, not given back yet
        self._closed = False  # closed: a memfd given back is closed, never kept
        # Re-entrant: a signal handler saving (ack=memory) while its thread was in here
        # waited for good on a plain lock (found attacking).
        self._lock = threading.RLock()
        forks.register(self)

    def acquire(self) -> int:
        with self._lock:
            for fd in list(self._fds):
                # Checked again after the check: a signal handler run meanwhile (the lock is
                # re-entrant) may have taken it.
                if fd in self._fds and not in_use_elsewhere(fd) and fd in self._fds:
                    self._fds.remove(fd)
                    self._sizes.pop(fd, None)
                    self._out.add(fd)
                    return fd
            with forks.creating():  # registered (in _out) before any fork can copy it
                fd = os.memfd_create("ckptdrain-shard", os.MFD_CLOEXEC)
                self._out.add(fd)
            return fd

    def release(self, fd: int, size: int) -> None:
        """Keep ``fd`` (holding ``size`` bytes) for reuse (the daemon may still hold it:
        acquire checks), closing the oldest idle ones beyond the pool's bounds."""
        with self._lock:
            self._out.discard(fd)
            if self._closed:
                # Given back by a generation still open when its Client was closed: kept, it
                # stayed open (its pages charged to the job) until the process exited, the
                # pool's close having run (found attacking).
                self.discard(fd)
                return
            self._fds.append(fd)
            self._sizes[fd] = size
            while self._fds and (len(self._fds) > self.max_fds
                                 or sum(self._sizes.values()) > self.max_idle_bytes):
                oldest = self._fds.pop(0)
                self._sizes.pop(oldest, None)
                os.close(oldest)

    def discard(self, fd: int) -> None:
        with self._lock:
            self._out.discard(fd)
        os.close(fd)

    def _forget_in_child(self) -> None:
        """In a child just forked (client/forks.py): close this process's copies of the
        parent's memfds, idle and in use (the parent keeps and reuses them; two processes
        filling one memfd mixed their shards' bytes), and start empty."""
        fds = [*self._fds, *self._out]
        self._fds, self._out, self._sizes = [], set(), {}
        self._lock = threading.RLock()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close the idle memfds, and each memfd in use when it is given back."""
        with self._lock:
            self._closed = True
            fds, self._fds, self._sizes = self._fds, [], {}
        for fd in fds:
            os.close(fd)
