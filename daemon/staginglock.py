"""The lock on ``staging_dir`` that makes one daemon its only user, and that tells a start
after a crash from one after a clean stop (the pid in ``daemon.lock``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path

from ckptdrain.daemon.errors import DiskFull, StartupError
from ckptdrain.daemon.logs import log_event

log = logging.getLogger("ckptdrain.startup")

LOCK_NAME = "daemon.lock"
STOPPED = b"-\n"  # in the lock file after a clean stop, where a pid was


def why(exc: OSError) -> str:
    """An OSError's reason as an operator reads it."""
    return exc.strerror or str(exc) or type(exc).__name__


def is_full(exc: OSError) -> bool:
    """Out of room (ENOSPC) or of quota (EDQUOT): full for now, so a later start may pass."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


class StagingLock:
    """An exclusive ``flock`` on ``staging_dir`` itself and on ``staging_dir/daemon.lock``,
    which holds the owner's pid. The kernel drops both when the process dies, so a crash
    never leaves them stuck.

    The directory's lock is the one that counts: the file can be removed while its lock is
    held (an operator clearing what looks like a stale lock file, as one does for a pidfile),
    and the next daemon then locked a new file and shared the staging directory and journal
    with the running one, which removed the other's temp files at the destination as its
    own (found attacking). The directory's lock goes with the directory: nothing in it can
    be removed to free it. The file's lock is kept too: a daemon of an older version, during
    an upgrade's hand-over, locks only that."""

    def __init__(self, staging_dir: Path) -> None:
        self.path = staging_dir / LOCK_NAME
        self._fd: int | None = None
        self._dir_fd: int | None = None
        # Whether the last owner died without a clean stop: its pid is still in the file
        # (a clean stop writes STOPPED over it). Read by the journal's reserve.
        self.unclean = False
        # Set once recovery has dealt with what an unclean stop left: until then a release
        # keeps the last owner's pid, so a start that fails before (a full disk's exit 75,
        # retried) does not hide the crash from the next one.
        self.settled = False

    def _in_use(self, fd: int | None) -> StartupError:
        """The refusal naming the holder's pid, read from the lock file (``fd``, or the path
        when only the directory's lock was tried)."""
        holder = ""
        with contextlib.suppress(OSError):
            own = (os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK) if fd is None
                   else fd)
            try:
                holder = os.pread(own, 32, 0).decode(errors="replace").strip()
            finally:
                if fd is None:
                    os.close(own)
        return StartupError(
            "staging_dir", f"{self.path.parent} is in use by another ckptdrain daemon "
            f"(pid {holder if holder.isdigit() else 'unknown'}); stop it, or give this daemon "
            "its own staging_dir")

    def _lock_dir(self) -> None:
        try:
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise StartupError("staging_dir", f"cannot open {self.path.parent} "
                               f"({why(exc)}); fix the directory's owner or mode") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use(None) from None
        except OSError as exc:
            # A filesystem whose directories take no flock: the file's lock alone, as before.
            os.close(fd)
            log_event(log, logging.WARNING, "staging_dir_not_lockable",
                      staging_dir=str(self.path.parent), error=why(exc),
                      action=f"none: only {self.path} is locked, and removing it while this "
                      "daemon runs lets a second daemon share staging_dir; put staging_dir "
                      "on a local filesystem")
            return
        self._dir_fd = fd

    def acquire(self) -> None:
        self._lock_dir()
        try:
            self._lock_file()
        except BaseException:
            self.release()
            raise

    def _lock_file(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StartupError("staging_dir", f"cannot open the lock {self.path} "
                               f"({why(exc)}); fix the directory's owner or mode") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = self._in_use(fd)
            os.close(fd)
            raise error from None
        try:
            # Written over the last owner's pid, then cut to length: a lock that has held a
            # pid keeps its block, so a restart onto a full filesystem writes it (truncated
            # first, its block went back and had to be allocated again).
            pid = f"{os.getpid()}\n".encode()
            self.unclean = os.pread(fd, 32, 0).strip().isdigit()
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        except OSError as exc:
            # Found attacking: on a full staging filesystem this came out as "socket: cannot
            # serve: [Errno 28] No space left on device", naming the wrong key; and then as
            # exit 78, which systemd does not retry, for a disk that is only full for now.
            os.close(fd)
            if is_full(exc):
                raise DiskFull("staging_dir", f"cannot write the lock {self.path} "
                               f"({why(exc)}): its filesystem is full; free space there"
                               ) from None
            raise StartupError("staging_dir", f"cannot write the lock {self.path} "
                               f"({why(exc)}); check its filesystem") from None
        self._fd = fd

    def release(self) -> None:
        """Unlock; the file says the owner stopped cleanly (its journal closed by then)."""
        if self._fd is not None and (self.settled or not self.unclean):
            with contextlib.suppress(OSError):  # the next start then takes it for a crash
                os.pwrite(self._fd, STOPPED, 0)
                os.ftruncate(self._fd, len(STOPPED))  # never to 0: the block is kept
        fds, self._fd, self._dir_fd = (self._fd, self._dir_fd), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)  # the file stays: unlinking it would race a daemon that opened it
